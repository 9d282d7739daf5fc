"""flashmonoid as torch.library custom ops: autograd, torch.compile and fake tensors.

Ops (all under the ``flashmonoid`` namespace, see ``torch.ops.flashmonoid``):

  fwd(q, k, v, ...) -> (out, lse)             q (b, s_q, h, d); lse float32 (b, h, s_q)
  bwd(dout, q, k, v, out, lse, ...) -> (dq, dk, dv)
  fwd_varlen / bwd_varlen                     packed q (total_q, h, d); lse (h, total_q)
  merge(outs, lses) -> (out, lse)

Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through them
without graph breaks, and fwd / fwd_varlen have a registered autograd formula that calls the bwd
ops. lse is returned for inspection and merging but is not differentiable (as in flash-attn): its
gradient would need the softmax probabilities, which the kernels never materialise. merge is not
differentiable either. flashmonoid.attention and attention_varlen call the implementations
directly, without the dispatcher, when nothing is traced or differentiated (_eager: plain tensors,
no input that autograd must track); the dispatcher's share of a forward's host time was ~95 us on
the H100 machine (profiled before this path existed; the path itself was timed on CPU tensors only).
Differentiated eager calls on plain tensors run the same formula as an autograd.Function
(_plain, _EagerFwd, _EagerFwdVarlen); only traced calls (torch.compile, export, fake tensors,
functorch transforms) go through the ops.

Dtypes: float32, float16 and bfloat16 run in the C++ library (CPU or CUDA). float64 runs an
exact float64 torch implementation of the same semantics (flashmonoid._reference), including the
same Philox dropout mask; it exists so that torch.autograd.gradcheck can check the autograd wiring
(GQA reduction, saved tensors, masks, softcap, ALiBi, dropout) in float64. It materialises the
scores and is meant for small inputs; the C++ kernels are checked in fp32 against a float64
reference by the tests.

Dropout: the keep-mask is a function of (seed, offset); the public wrappers draw a fresh seed
from torch's default CPU generator (so torch.manual_seed makes runs reproducible) and pass it to
the ops as a CPU int64 tensor ``rng = [seed, offset]``, saved for the backward.
"""

import atexit
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _backend, _C, _reference


def _options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, rng, deterministic=False):
    seed, offset = (0, 0) if rng is None else (int(rng[0]), int(rng[1]))
    return _C.Options(softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                      window_right=window_right, softcap=softcap, dropout_p=dropout_p,
                      dropout_seed=seed, dropout_offset=offset, deterministic=deterministic)


def _math_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng):
    seed, offset = (0, 0) if rng is None else (int(rng[0]), int(rng[1]))
    return dict(scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
                softcap=softcap, alibi=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)


def _c(x):
    """x with a contiguous last dimension, the only layout rule of the C++ API (expanded gradients
    break it). is_contiguous() is a cached flag (0.1 us); stride(-1) costs 0.3 us."""
    if x is None or x.is_contiguous() or x.stride(-1) == 1:
        return x
    return x.contiguous()


def _eager(*tensors):
    """Whether a call may run an op's implementation directly instead of through torch's dispatcher:
    in eager mode, on plain tensors (not fake, functional or other subclass tensors, not fx proxies,
    not traced by torch.compile or torch.export) with nothing for autograd to record. The dispatcher
    (custom_op's Python layers and autograd wrapper) took ~95 us of host time per forward on the
    H100 machine (cProfile there: 160 us for flashmonoid.attention against 64 us for the same call
    below the op), more than the kernel itself at short sequences. Differentiable calls run
    _EagerFwd / _EagerFwdVarlen (_plain); traced calls go through the ops."""
    return _eager_contiguous((), tensors)


def _traced():
    """Whether calls now are traced (torch.compile, export) or transformed (functorch): they must go
    through the ops, whose fake kernels and registered formulas these mechanisms use."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _eager_contiguous(contiguous, others):
    """_eager(*contiguous, *others), and every tensor of `contiguous` contiguous: one pass for the
    decoding step's fast path (flash_attn_with_kvcache), 2 us instead of 4.7 for two."""
    if _traced():
        return False
    grad = torch.is_grad_enabled()
    for t in contiguous:
        if t is not None and (type(t) not in _PLAIN_TENSORS or (grad and t.requires_grad) or not t.is_contiguous()):
            return False
    for t in others:
        if t is not None and (type(t) not in _PLAIN_TENSORS or (grad and t.requires_grad)):
            return False
    return True


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain(*tensors):
    """Whether a call that autograd must record may still skip the dispatcher: in eager mode, on plain
    tensors (as _eager, gradients allowed). Such calls run _EagerFwd / _EagerFwdVarlen, an
    autograd.Function over the same implementations, instead of the custom op and its registered
    autograd: the op's Python layers cost ~70 us of host time per forward and backward pair (local
    EPYC, a tiny varlen call: 166 -> 88 us), and made transformers' training step host-bound on the
    H200 (54 ms of host time in a 66 ms step; sdpa's 39)."""
    if _traced():
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


def new_rng(dropout_p):
    """[seed, offset] for a dropout call, or None without dropout."""
    if dropout_p <= 0:
        return None
    return torch.stack([torch.randint(0, 2**62, (), dtype=torch.int64), torch.zeros((), dtype=torch.int64)])


# ---------------------------------------------------------------------------------------------
# Batched (b, s, h, d)


def _fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
              deterministic):
    if q.dtype == torch.float64:
        o = _math_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
        return _reference.forward(q, k, v, o)
    b, s_q, h, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s_q), dtype=torch.float32, device=q.device)
    opts = _options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, rng)
    _backend.forward(_c(q), _c(k), _c(v), out, lse, opts, _c(alibi_slopes))
    return out, lse


@torch.library.custom_op("flashmonoid::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
        softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float, rng: Optional[Tensor],
        deterministic: bool) -> Tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
                     deterministic)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
      deterministic):
    b, s_q, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s_q), dtype=torch.float32)


def _bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              dropout_p, rng, deterministic):
    if q.dtype == torch.float64:
        o = _math_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
        return _reference.backward(dout, q, k, v, out, o)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    opts = _options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, rng, deterministic)
    _backend.backward(_c(dout), _c(q), _c(k), _c(v), _c(out), _c(lse), dq, dk, dv, opts, _c(alibi_slopes))
    return dq, dk, dv


@torch.library.custom_op("flashmonoid::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
        causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
        dropout_p: float, rng: Optional[Tensor], deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                     dropout_p, rng, deterministic)


@bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
      dropout_p, rng, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_N_OPTION_ARGS = 9  # softmax_scale ... deterministic: the non-tensor tail of fwd's arguments


def _setup_fwd(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.options = options
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)


def _backward_fwd(ctx, dout, dlse, run=None):
    """fwd's formula: the bwd op, or `run`, a function of its signature (_EagerFwd: _bwd_impl)."""
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = (run or bwd)(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * _N_OPTION_ARGS


torch.library.register_autograd("flashmonoid::fwd", _backward_fwd, setup_context=_setup_fwd)


class _EagerFwd(torch.autograd.Function):
    """fwd and its registered autograd formula (_setup_fwd, _backward_fwd) without the dispatcher, for
    eager calls on plain tensors (_plain). A backward that builds a graph (create_graph=True) runs
    the formula through the bwd op, which has no derivative: differentiating it raises, as through
    fwd."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        output = _fwd_impl(q, k, v, *options)
        _setup_fwd(ctx, (q, k, v, *options), output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward_fwd(ctx, dout, dlse, bwd if torch.is_grad_enabled() else _bwd_impl)


# ---------------------------------------------------------------------------------------------
# Packed variable-length (total, h, d)


def _fwd_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, dropout_p, rng, deterministic, seqused_q=None,
                     seqused_k=None):
    if q.dtype == torch.float64:
        o = _math_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
        return _reference.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, o, seqused_q, seqused_k)
    # With used lengths the kernels write only the used rows: the others are 0 and -inf, as rows of no
    # sequence are in the float64 path (the identity of merge).
    if seqused_q is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    else:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    opts = _options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, rng)
    varlen = (_c(cu_seqlens_q), _c(cu_seqlens_k), max_seqlen_q, max_seqlen_k, _c(seqused_q), _c(seqused_k))
    _backend.forward(_c(q), _c(k), _c(v), out, lse, opts, _c(alibi_slopes), varlen)
    return out, lse


@torch.library.custom_op("flashmonoid::fwd_varlen", mutates_args=())
def fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float, rng: Optional[Tensor],
               deterministic: bool, seqused_q: Optional[Tensor] = None,
               seqused_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return _fwd_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_left, window_right, softcap, alibi_slopes, dropout_p, rng, deterministic, seqused_q,
                            seqused_k)


@fwd_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
      window_right, softcap, alibi_slopes, dropout_p, rng, deterministic, seqused_q=None, seqused_k=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _bwd_varlen_impl(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, softmax_scale,
                     causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng, deterministic,
                     seqused_q=None, seqused_k=None):
    if q.dtype == torch.float64:
        o = _math_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
        return _reference.backward_varlen(dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k, o, seqused_q, seqused_k)
    new_q = torch.empty if seqused_q is None else torch.zeros  # rows past the used ones: gradient 0
    new_k = torch.empty if seqused_k is None else torch.zeros
    dq = new_q(q.shape, dtype=q.dtype, device=q.device)
    dk = new_k(k.shape, dtype=k.dtype, device=k.device)
    dv = new_k(v.shape, dtype=v.dtype, device=v.device)
    opts = _options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, rng, deterministic)
    varlen = (_c(cu_seqlens_q), _c(cu_seqlens_k), max_seqlen_q, max_seqlen_k, _c(seqused_q), _c(seqused_k))
    _backend.backward(_c(dout), _c(q), _c(k), _c(v), _c(out), _c(lse), dq, dk, dv, opts, _c(alibi_slopes), varlen)
    return dq, dk, dv


@torch.library.custom_op("flashmonoid::bwd_varlen", mutates_args=())
def bwd_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, out: Tensor, lse: Tensor, softmax_scale: float, causal: bool,
               window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
               dropout_p: float, rng: Optional[Tensor], deterministic: bool, seqused_q: Optional[Tensor] = None,
               seqused_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    return _bwd_varlen_impl(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                            softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
                            deterministic, seqused_q, seqused_k)


@bwd_varlen.register_fake
def _(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, dropout_p, rng, deterministic, seqused_q=None, seqused_k=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_fwd_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, *rest = inputs
    out, lse = output
    ctx.varlen = (max_q, max_k)
    ctx.options = rest[:_N_OPTION_ARGS]
    ctx.used = (tuple(rest[_N_OPTION_ARGS:]) + (None, None))[:2]  # seqused_q, seqused_k
    ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
    ctx.mark_non_differentiable(lse)


_N_VARLEN_ARGS = 7 + _N_OPTION_ARGS + 2  # q ... max_seqlen_k, the options, seqused_q / _k


def _backward_fwd_varlen(ctx, dout, dlse, run=None):
    """fwd_varlen's formula: the bwd_varlen op, or `run`, a function of its signature (_bwd_varlen_impl)."""
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    dq, dk, dv = (run or bwd_varlen)(dout, q, k, v, cu_q, cu_k, *ctx.varlen, out, lse, *ctx.options, *ctx.used)
    return (dq, dk, dv) + (None,) * (_N_VARLEN_ARGS - 3)


torch.library.register_autograd("flashmonoid::fwd_varlen", _backward_fwd_varlen, setup_context=_setup_fwd_varlen)


class _EagerFwdVarlen(torch.autograd.Function):
    """fwd_varlen and its registered autograd formula without the dispatcher (as _EagerFwd)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, *options):
        output = _fwd_varlen_impl(q, k, v, cu_q, cu_k, max_q, max_k, *options)
        _setup_fwd_varlen(ctx, (q, k, v, cu_q, cu_k, max_q, max_k, *options), output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward_fwd_varlen(ctx, dout, dlse, bwd_varlen if torch.is_grad_enabled() else _bwd_varlen_impl)


# ---------------------------------------------------------------------------------------------
# Paged varlen (prefill into a paged cache; forward only) and KV-cache attention (decoding)


def _fwd_varlen_paged_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                           softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_k=None):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    opts = _options(softmax_scale, causal, window_left, window_right, softcap, 0.0, None)
    varlen = (_c(cu_seqlens_q), _c(cu_seqlens_k), max_seqlen_q, max_seqlen_k, None, _c(seqused_k))
    _backend.forward(_c(q), k.detach(), v.detach(), out, lse, opts, _c(alibi_slopes), varlen,
                     block_table=_c(block_table))
    return out, lse


@torch.library.custom_op("flashmonoid::fwd_varlen_paged", mutates_args=())
def fwd_varlen_paged(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor],
                     max_seqlen_q: int, max_seqlen_k: int, block_table: Tensor, softmax_scale: float, causal: bool,
                     window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                     seqused_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return _fwd_varlen_paged_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                  softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_k)


@fwd_varlen_paged.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, seqused_k=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _fwd_kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                      cache_batch_idx, cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_left,
                      window_right, softcap, rotary_interleaved, num_splits, keep_workspace=True):
    b, s_q, h, _ = q.shape
    # Sizes as separate ints and empty_like: 1.5 us each, against 3.7 us for torch.empty(q.shape, ...);
    # the memory_format argument alone costs 1.5 us, and a contiguous q's format is contiguous.
    out = torch.empty_like(q) if q.is_contiguous() else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
    opts = _kvcache_options(softmax_scale, causal, window_left, window_right, softcap,
                            torch.are_deterministic_algorithms_enabled())
    # The caches are written in place: never copied (their last dimension is contiguous by contract).
    _backend.forward_kvcache(_c(q), k_cache, v_cache, _c(k), _c(v), _c(rotary_cos), _c(rotary_sin),
                             rotary_interleaved, _c(cache_seqlens), cache_seqlen, _c(cache_batch_idx),
                             _c(cache_leftpad), _c(block_table), out, lse, opts, _c(alibi_slopes), num_splits,
                             keep_workspace)
    return out, lse


# _C.Options of forward_kvcache calls by value: a decoding loop repeats one set, and building the
# object from keyword arguments costs ~2 us. The objects are never changed once made, and are let
# go at exit (nanobind reports instances alive at its shutdown as leaks).
_kv_options = {}
atexit.register(_kv_options.clear)


def _kvcache_options(softmax_scale, causal, window_left, window_right, softcap, deterministic):
    # deterministic: torch.use_deterministic_algorithms(True) keeps CUDA split-KV decoding's split
    # blocks on fixed key ranges (Options::deterministic), so its bits repeat run to run.
    key = (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    opts = _kv_options.get(key)
    if opts is None:
        if len(_kv_options) > 256:
            _kv_options.clear()
        opts = _kv_options[key] = _options(softmax_scale, causal, window_left, window_right, softcap, 0.0, None,
                                           deterministic)
    return opts


@torch.library.custom_op("flashmonoid::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_seqlen: int, cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                num_splits: int) -> Tuple[Tensor, Tensor]:
    # A fresh workspace per call (_backend.forward_kvcache's keep_workspace): this op runs in compiled
    # graphs, whose CUDA graph trees allocate from their own pool while warming up.
    return _fwd_kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                             cache_batch_idx, cache_leftpad, block_table, alibi_slopes, softmax_scale, causal,
                             window_left, window_right, softcap, rotary_interleaved, num_splits, keep_workspace=False)


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad,
      block_table, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
      num_splits):
    b, s_q, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s_q), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Merge of partial results over disjoint key sets


def _merge_impl(outs, lses):
    out = torch.empty(outs[0].shape, dtype=outs[0].dtype, device=outs[0].device)
    lse = torch.empty(lses[0].shape, dtype=torch.float32, device=lses[0].device)
    if out.dtype == torch.float64:
        # The monoid's merge in float64 torch math: weights exp(lse_i - lse); a part at -inf adds 0.
        stacked = torch.stack([x.double() for x in lses])
        lse_all = torch.logsumexp(stacked, dim=0)
        w = torch.where(torch.isneginf(lse_all), torch.zeros_like(stacked), torch.exp(stacked - lse_all))
        # lse (b, h, s) or (h, total) against out (b, s, h, d) or (total, h, d).
        out.copy_(sum(wi.transpose(-1, -2)[..., None] * oi for wi, oi in zip(w, outs)))
        lse.copy_(lse_all)
        return out, lse
    _backend.merge([_c(o) for o in outs], [_c(x) for x in lses], out, lse)
    return out, lse


@torch.library.custom_op("flashmonoid::merge", mutates_args=())
def merge(outs: List[Tensor], lses: List[Tensor]) -> Tuple[Tensor, Tensor]:
    return _merge_impl(outs, lses)


@merge.register_fake
def _(outs, lses):
    return outs[0].new_empty(outs[0].shape), lses[0].new_empty(lses[0].shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Attention sinks: one more score per query head in every row's softmax, with value 0 (gpt-oss's
# s_aux, vLLM's s_aux)


def check_sinks(sinks, heads, name="sinks"):
    """A clear error, naming the argument, for sinks that are not a float tensor of shape (heads,)."""
    if tuple(sinks.shape) != (heads,) or not sinks.is_floating_point():
        raise ValueError(f"flashmonoid: {name}: must be a float tensor of shape (heads,) = ({heads},), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")


def merge_sink(out, lse, sinks):
    """(out, lse) of attention merged with a key of score sinks[h] and value 0: the library's merge
    (the monoid's) of (out, lse) with the part (0, sinks[h]), so out * exp(lse) / (exp(lse) +
    exp(sink)) and lse -> log(exp(lse) + exp(sink)). lse (b, h, s) or (h, total) against out
    (b, s, h, d) or (total, h, d), as merge's; a row without keys (lse -inf) gives 0 and lse = sink.
    Not differentiable itself (as merge): _Sinks and _SinksVarlen give the gradients."""
    check_sinks(sinks, lse.shape[-2])
    sink = sinks.to(device=lse.device, dtype=torch.float32).view(-1, 1).expand_as(lse).contiguous()  # h: dim -2
    outs, lses = [out, torch.zeros_like(out)], [lse, sink]
    return (_merge_impl if _eager(out, lse, sink) else merge)(outs, lses)


def _sinks_grad(dout, out, lse, sinks):
    """The sinks' gradient: -sum over each head's rows of exp(sink - lse) * D, D = rowsum(dout * out)
    (lse the merged one, in (b, h, s) or (h, total) against out's (b, s, h, d) or (total, h, d))."""
    d_rows = (dout.float() * out.float()).sum(-1).transpose(-1, -2)
    per_row = torch.exp(sinks.float()[:, None] - lse) * d_rows
    return -per_row.sum(dim=[i for i in range(per_row.dim()) if i != per_row.dim() - 2]).to(sinks.dtype)


class _Sinks(torch.autograd.Function):
    """The batched op with sinks, differentiable in q, k, v and the sinks. Forward: the op's (out,
    lse) merged with the sinks (merge_sink). Backward: the op's backward at the merged (out, lse) is
    exact for attention with sinks (it recomputes each key's probability as exp(score - lse), the
    merged lse's; and a sink's value 0 adds nothing to D = rowsum(dout * out)), and the sinks' own
    gradient is _sinks_grad."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, *options):
        alibi = options[5]  # fwd's options: scale, causal, window (2), softcap, alibi_slopes, ...
        out, lse = (_fwd_impl if _plain(q, k, v, alibi) else fwd)(q, k, v, *options)
        out, lse = merge_sink(out, lse, sinks)
        ctx.options = options
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        run = bwd if torch.is_grad_enabled() or not _plain(q, k, v) else _bwd_impl
        dq, dk, dv = run(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv, _sinks_grad(dout, out, lse, sinks)) + (None,) * len(ctx.options)


class _SinksVarlen(torch.autograd.Function):
    """_Sinks over the varlen ops (packed q, k, v; used lengths included)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, sinks, *options):
        tensors = (q, k, v, cu_q, cu_k, options[5]) + tuple(options[_N_OPTION_ARGS:])
        op = _fwd_varlen_impl if _plain(*tensors) else fwd_varlen
        out, lse = op(q, k, v, cu_q, cu_k, max_q, max_k, *options)
        out, lse = merge_sink(out, lse, sinks)
        ctx.varlen = (max_q, max_k)
        ctx.options = options[:_N_OPTION_ARGS]
        ctx.used = tuple(options[_N_OPTION_ARGS:])
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, sinks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, cu_q, cu_k, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        run = bwd_varlen if torch.is_grad_enabled() or not _plain(q, k, v) else _bwd_varlen_impl
        dq, dk, dv = run(dout, q, k, v, cu_q, cu_k, *ctx.varlen, out, lse, *ctx.options, *ctx.used)
        return ((dq, dk, dv, None, None, None, None, _sinks_grad(dout, out, lse, sinks))
                + (None,) * (len(ctx.options) + len(ctx.used)))


# ---------------------------------------------------------------------------------------------
# Python-level entry points with defaults resolved (used by flashmonoid.attention and friends)


# The CUDA kernels move rows in 16-byte vectors, so their head dims are multiples of 8; as
# flash-attn does, other head dims are zero-padded here (exact: zero features add nothing to q·kᵀ,
# and the padded output columns, zero, are sliced off). Cost: one padded copy of each input, plus
# autograd's slice of the gradients; for forward_kvcache a padded copy of the whole cache and a
# copy back (as flash-attn), O(cache) per call. The scale stays 1/sqrt(d) of the true head dim.
_HEAD_DIM_MULTIPLE = 8


def _needs_pad(x):
    return x.is_cuda and x.shape[-1] % _HEAD_DIM_MULTIPLE != 0


def _pad(x):
    return None if x is None else torch.nn.functional.pad(x, (0, -x.shape[-1] % _HEAD_DIM_MULTIPLE))


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, deterministic=False, rng=None, sinks=None):
    """(out, lse) for torch tensors, differentiable in q, k and v. sinks (h,): attention sinks, one
    more score per query head in every row's softmax whose value is 0 (differentiable too; lse then
    counts them)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if rng is None:
        rng = new_rng(dropout_p)
    d = q.shape[-1]
    if _needs_pad(q):
        q, k, v = _pad(q), _pad(k), _pad(v)
    if sinks is not None:
        check_sinks(sinks, q.shape[-2])
        out, lse = _Sinks.apply(q, k, v, sinks, scale, bool(causal), int(window[0]), int(window[1]), float(softcap),
                                alibi_slopes, float(dropout_p), rng, bool(deterministic))
        return out[..., :d], lse
    op = _fwd_impl if _eager(q, k, v, alibi_slopes) else _EagerFwd.apply if _plain(q, k, v, alibi_slopes) else fwd
    out, lse = op(q, k, v, scale, bool(causal), int(window[0]), int(window[1]), float(softcap), alibi_slopes,
                  float(dropout_p), rng, bool(deterministic))
    return out[..., :d], lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     deterministic=False, rng=None, seqused_q=None, seqused_k=None, sinks=None):
    """(out, lse) of packed q (total_q, h, d) over k, v (total_k, h_k, d), differentiable in q, k and v.
    seqused_q / seqused_k (int32 (b)): sequence b is the first seqused rows of its slot in cu_seqlens
    (a padded batch in place: q.view(b * s_q, h, d), cu_seqlens_q = arange(b + 1) * s_q); the other
    rows get out 0, lse -inf and gradient 0, and max_seqlen bounds the used lengths. sinks: as
    attention's (a row without keys: out 0, lse = its sink)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if rng is None:
        rng = new_rng(dropout_p)
    d = q.shape[-1]
    if _needs_pad(q):
        q, k, v = _pad(q), _pad(k), _pad(v)
    if sinks is not None:
        check_sinks(sinks, q.shape[-2])
        out, lse = _SinksVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), sinks,
                                      scale, bool(causal), int(window[0]), int(window[1]), float(softcap),
                                      alibi_slopes, float(dropout_p), rng, bool(deterministic), seqused_q, seqused_k)
        return out[..., :d], lse
    op = (_fwd_varlen_impl if _eager(q, k, v, alibi_slopes, seqused_q, seqused_k) else
          _EagerFwdVarlen.apply if _plain(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
          else fwd_varlen)
    out, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal),
                  int(window[0]), int(window[1]), float(softcap), alibi_slopes, float(dropout_p), rng,
                  bool(deterministic), seqused_q, seqused_k)
    return out[..., :d], lse


def attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, *,
                           causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                           seqused_k=None):
    """(out, lse) of packed q over paged k, v (num_pages, page_size, h_k, d); forward only. Key counts:
    cu_seqlens_k's lengths, or seqused_k int32 (b) (cu_seqlens_k may then be None; given both, each
    within its slot)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    d = q.shape[-1]
    if _needs_pad(q):
        q, k, v = _pad(q), _pad(k), _pad(v)
    op = _fwd_varlen_paged_impl if _eager(q, k, v, alibi_slopes) else fwd_varlen_paged
    out, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), block_table, scale,
                  bool(causal), int(window[0]), int(window[1]), float(softcap), alibi_slopes, seqused_k)
    return out[..., :d], lse


def attention_kvcache(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, causal=False, softmax_scale=None,
                      window=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0):
    """(out, lse) of flashmonoid::forward_kvcache; k, v are appended into the caches in place.
    cache_seqlens: int32 tensor (b), an int, or None (every sequence holds the whole cache)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if isinstance(cache_seqlens, int):
        seqlens, seqlen = None, cache_seqlens
    else:
        seqlens, seqlen = cache_seqlens, -1
    d = q.shape[-1]
    caches = None
    if _needs_pad(q):  # rotary pairs stay within the first rotary_dim <= d features: unaffected
        caches = (k_cache, v_cache)
        q, k, v, k_cache, v_cache = _pad(q), _pad(k), _pad(v), _pad(k_cache), _pad(v_cache)
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad,
               block_table, alibi_slopes)
    op = _fwd_kvcache_impl if _eager(*tensors) else fwd_kvcache
    out, lse = op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, seqlen, cache_batch_idx,
                  cache_leftpad, block_table, alibi_slopes, scale, bool(causal), int(window[0]), int(window[1]),
                  float(softcap), bool(rotary_interleaved), int(num_splits))
    if caches is None:
        return out, lse
    if k is not None:  # the append went into the padded copies
        caches[0].copy_(k_cache[..., :d])
        caches[1].copy_(v_cache[..., :d])
    return out[..., :d], lse


__all__ = ["fwd", "bwd", "fwd_varlen", "bwd_varlen", "fwd_varlen_paged", "fwd_kvcache", "merge", "merge_sink",
           "attention", "attention_varlen", "attention_varlen_paged", "attention_kvcache", "new_rng"]
