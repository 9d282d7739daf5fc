"""flashmonoid: exact FlashAttention on the CPU and on CUDA GPUs.

Attention is a fold over key blocks in the online-softmax monoid; see the C++ headers in
include/flashmonoid for the full semantics. These functions take NumPy arrays (CPU; float32 and
float16), torch tensors (CPU or CUDA; float32, float16, bfloat16, and float64 through an exact
torch implementation) and CuPy arrays, without copying them. Layouts follow FlashAttention-2:

    q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, heads_k, head_dim); heads % heads_k == 0
    out like q; lse float32 (batch, heads, seqlen_q), the natural log-sum-exp of each row's scores
    varlen: q (total_q, heads, head_dim), k, v (total_k, heads_k, head_dim), cu_seqlens int32 (batch + 1,),
            lse (heads, total_q)

Masks are aligned to the bottom-right corner of the score matrix: query i sees key j iff
i + s_k - s_q - window[0] <= j <= i + s_k - s_q + window[1] (-1: unbounded; causal: window[1] = 0).
A query that sees no key gets out = 0 and lse = -inf (the identity of merge).

Torch tensors go through the custom ops of flashmonoid.torch_ops, so they carry gradients and
compile with torch.compile(fullgraph=True). Other arrays call the library directly; their
gradients come from attention_backward.

Errors: invalid input raises ValueError whose message names the argument, e.g.
"flashmonoid: k: dtype bf16 differs from q's fp16". Valid input that this build or device cannot
run (say, CUDA arrays on a CPU-only build) raises NotSupportedError, a subclass of both
NotImplementedError and ValueError.
"""

import math

import numpy as np

from . import _backend, _C
from ._backend import get_cpu_algorithm, get_cpu_isa, set_cpu_algorithm, set_cpu_isa

__version__ = _C.__version__
NotSupportedError = _C.NotSupportedError

__all__ = [
    "attention", "attention_varlen", "attention_backward", "attention_varlen_backward", "merge", "supports",
    "cuda_available", "set_cpu_algorithm", "get_cpu_algorithm", "set_cpu_isa", "get_cpu_isa", "NotSupportedError", "__version__",
]


def cuda_available():
    """True when this build has the CUDA backend and a GPU of compute capability >= 8.0 is visible."""
    return _C.cuda_available()


def _check_ndim(x, name, ndim, layout):
    _backend.family(x)  # TypeError for anything that is not an array of a known family
    if x.ndim != ndim:
        raise ValueError(f"flashmonoid: {name}: must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}")


def _scale(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _seed(dropout_p, dropout_seed):
    # NumPy's global generator, so that np.random.seed makes dropout reproducible.
    if dropout_p > 0 and dropout_seed is None:
        return int(np.random.randint(0, 2**62, dtype=np.int64))
    return 0 if dropout_seed is None else int(dropout_seed)


def _torch_rng(q, dropout_p, dropout_seed, dropout_offset):
    from . import torch_ops

    if dropout_p <= 0:
        return None
    if dropout_seed is None:
        return torch_ops.new_rng(dropout_p)
    import torch

    return torch.tensor([int(dropout_seed), int(dropout_offset)], dtype=torch.int64)


def _options(q, causal, softmax_scale, window, softcap, dropout_p, dropout_seed, dropout_offset, deterministic=False):
    return _C.Options(softmax_scale=_scale(q, softmax_scale), causal=bool(causal), window_left=int(window[0]),
                      window_right=int(window[1]), softcap=float(softcap), dropout_p=float(dropout_p),
                      dropout_seed=_seed(dropout_p, dropout_seed), dropout_offset=int(dropout_offset),
                      deterministic=bool(deterministic))


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, return_lse=False, dropout_seed=None, dropout_offset=0, deterministic=False, sinks=None):
    """out = softmax(mask(softmax_scale · q kᵀ)) v for q (b, s_q, h, d), k and v (b, s_k, h_k, d).

    softmax_scale: default 1/sqrt(d). window: (left, right), -1 unbounded. softcap: scores become
    softcap·tanh(score/softcap) when > 0. alibi_slopes: float32 (h,) or (b, h), adds
    -slope·|i + s_k - s_q - j|. dropout_p: drops probabilities with the Philox mask of
    (dropout_seed, dropout_offset); a None seed draws one (torch's or NumPy's global generator):
    pass it explicitly to reproduce the mask in attention_backward. deterministic: backward only.
    sinks: float (h,) of q's family: attention sinks, one more score per head in every row's softmax
    whose value is 0 (gpt-oss's), merged into the result (merge with the part (0, sink); differentiable
    for torch tensors; lse counts them). Returns out, or (out, lse) with return_lse.
    """
    _check_ndim(q, "q", 4, "(batch, seqlen_q, heads, head_dim)")
    if _backend.family(q) == "torch":
        from . import torch_ops

        out, lse = torch_ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                       softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                       deterministic=deterministic,
                                       rng=_torch_rng(q, dropout_p, dropout_seed, dropout_offset), sinks=sinks)
        return (out, lse) if return_lse else out
    b, s_q, h, _ = q.shape
    out = _backend.empty(q, q.shape)
    lse = _backend.empty(q, (b, h, s_q), "float32")
    opts = _options(q, causal, softmax_scale, window, softcap, dropout_p, dropout_seed, dropout_offset)
    _backend.forward(q, k, v, out, lse, opts, alibi_slopes)
    if sinks is not None:
        out, lse = _merge_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _merge_sinks(out, lse, sinks):
    """NumPy / CuPy (out, lse) merged with the part (out 0, lse = each head's sink): attention sinks.
    lse (b, h, s) or (h, total), the head its second-to-last dim."""
    if tuple(sinks.shape) != (lse.shape[-2],):
        raise ValueError(f"flashmonoid: sinks: must have shape (heads,) = ({lse.shape[-2]},), got {tuple(sinks.shape)}")
    zeros = _backend.empty(out, out.shape)
    zeros.fill(0)
    sink = _backend.empty(lse, lse.shape, "float32")
    sink[...] = sinks.reshape(-1, 1)
    return merge([out, zeros], [lse, sink])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     return_lse=False, dropout_seed=None, dropout_offset=0, deterministic=False, seqused_q=None,
                     seqused_k=None, sinks=None):
    """attention() over packed sequences: q (total_q, h, d), k and v (total_k, h_k, d); sequence i
    owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q (int32, on q's device). lse is (h, total_q).
    seqused_q / seqused_k (int32 (b)): sequence i is the first seqused rows of that slot (a padded
    batch in place); the other rows get out 0 and lse -inf, and max_seqlen bounds the used lengths.
    sinks: as attention()'s (a row without keys: out 0, lse = its sink)."""
    _check_ndim(q, "q", 3, "(total_q, heads, head_dim)")
    if _backend.family(q) == "torch":
        from . import torch_ops

        out, lse = torch_ops.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
            dropout_p=dropout_p, deterministic=deterministic,
            rng=_torch_rng(q, dropout_p, dropout_seed, dropout_offset), seqused_q=seqused_q, seqused_k=seqused_k,
            sinks=sinks)
        return (out, lse) if return_lse else out
    out = _backend.empty(q, q.shape)
    lse = _backend.empty(q, (q.shape[1], q.shape[0]), "float32")
    if seqused_q is not None:  # the kernels write the used rows only
        out.fill(0)
        lse.fill(-math.inf)
    opts = _options(q, causal, softmax_scale, window, softcap, dropout_p, dropout_seed, dropout_offset)
    _backend.forward(q, k, v, out, lse, opts, alibi_slopes,
                     (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), seqused_q, seqused_k))
    if sinks is not None:
        out, lse = _merge_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=0, dropout_offset=0,
                       deterministic=False):
    """(dq, dk, dv), the gradients of sum(dout · out); out and lse from attention() with the same
    options (and, with dropout, the same dropout_seed and dropout_offset). dk, dv are summed over
    each group of query heads under GQA."""
    _check_ndim(q, "q", 4, "(batch, seqlen_q, heads, head_dim)")
    if _backend.family(q) == "torch":
        from . import torch_ops

        rng = _torch_rng(q, dropout_p, dropout_seed, dropout_offset)
        return torch_ops.bwd(dout, q, k, v, out, lse, _scale(q, softmax_scale), bool(causal), int(window[0]),
                             int(window[1]), float(softcap), alibi_slopes, float(dropout_p), rng,
                             bool(deterministic))
    dq, dk, dv = _backend.empty(q, q.shape), _backend.empty(k, k.shape), _backend.empty(v, v.shape)
    opts = _options(q, causal, softmax_scale, window, softcap, dropout_p, dropout_seed, dropout_offset,
                    deterministic)
    _backend.backward(dout, q, k, v, out, lse, dq, dk, dv, opts, alibi_slopes)
    return dq, dk, dv


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, *,
                              causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                              dropout_p=0.0, dropout_seed=0, dropout_offset=0, deterministic=False, seqused_q=None,
                              seqused_k=None):
    """attention_backward() for packed sequences (see attention_varlen; rows past used lengths get 0)."""
    _check_ndim(q, "q", 3, "(total_q, heads, head_dim)")
    if _backend.family(q) == "torch":
        from . import torch_ops

        rng = _torch_rng(q, dropout_p, dropout_seed, dropout_offset)
        return torch_ops.bwd_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                    int(max_seqlen_k), out, lse, _scale(q, softmax_scale), bool(causal),
                                    int(window[0]), int(window[1]), float(softcap), alibi_slopes, float(dropout_p),
                                    rng, bool(deterministic), seqused_q, seqused_k)
    dq, dk, dv = _backend.empty(q, q.shape), _backend.empty(k, k.shape), _backend.empty(v, v.shape)
    for x, used in ((dq, seqused_q), (dk, seqused_k), (dv, seqused_k)):
        if used is not None:  # the kernels write the used rows only
            x.fill(0)
    opts = _options(q, causal, softmax_scale, window, softcap, dropout_p, dropout_seed, dropout_offset,
                    deterministic)
    _backend.backward(dout, q, k, v, out, lse, dq, dk, dv, opts, alibi_slopes,
                      (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), seqused_q, seqused_k))
    return dq, dk, dv


def merge(outs, lses):
    """(out, lse) of attention over the union of disjoint key sets, from the parts' (out_i, lse_i).

    Layouts: out (b, s, h, d) with lse (b, h, s), or packed out (total, h, d) with lse (h, total).
    A part with lse = -inf contributes nothing; the result has the dtype of outs[0]."""
    outs, lses = list(outs), list(lses)
    if not outs:
        raise ValueError("flashmonoid: outs: needs at least one part")
    if _backend.family(outs[0]) == "torch":
        from . import torch_ops

        return torch_ops.merge(outs, lses)
    out = _backend.empty(outs[0], outs[0].shape)
    lse = _backend.empty(lses[0], lses[0].shape, "float32")
    _backend.merge(outs, lses, out, lse)
    return out, lse


def supports(q, k, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, dropout_p=0.0):
    """(ok, reason): whether this build runs these inputs on their device; the table the dispatcher
    uses. Torch tensors that require grad are fine (only shapes, dtypes and devices are read)."""
    if _backend.family(q) == "torch":
        q, k = q.detach(), k.detach()
    opts = _options(q, causal, softmax_scale, window, softcap, dropout_p, 0, 0)
    return _C.supports(q, k, opts)
