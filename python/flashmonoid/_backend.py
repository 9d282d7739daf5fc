"""Calls into flashmonoid._C for any DLPack array family: NumPy, torch, CuPy.

The C++ API never allocates and never picks a stream, so this module does both, in the family of
the inputs: outputs and workspace come from that family's allocator (torch's caching allocator for
torch tensors), and CUDA work goes on the family's current stream of the inputs' device.
"""

import os

import numpy as np

from . import _C

_cpu_algorithm = _C.CpuAlgorithm.__members__[os.environ.get("FLASHMONOID_CPU_ALGORITHM", "flash")]


def set_cpu_algorithm(name):
    """"flash" (tiled, the default) or "reference" (the float64 oracle) for CPU calls."""
    global _cpu_algorithm
    _cpu_algorithm = _C.CpuAlgorithm.__members__[name]


def get_cpu_algorithm():
    return _cpu_algorithm.name


_cpu_isa = _C.CpuIsa.best


def set_cpu_isa(name):
    """"best" (AVX-512 where the CPU has it, unless FLASHMONOID_CPU_ISA=avx2) or "avx2" for CPU calls."""
    global _cpu_isa
    _cpu_isa = _C.CpuIsa.__members__[name]


def get_cpu_isa():
    return _cpu_isa.name


def family(x):
    """"torch", "numpy" or "cupy": which allocator and stream go with x."""
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    raise TypeError(f"flashmonoid: expected a NumPy array, a torch tensor or a CuPy array, got {type(x).__name__}")


def is_cuda(x):
    f = family(x)
    return (f == "torch" and x.is_cuda) or f == "cupy"


def empty(like, shape, dtype=None):
    """Uninitialised array of the family and device of `like`; dtype None = like's, "float32"."""
    f = family(like)
    if f == "torch":
        import torch

        dt = like.dtype if dtype is None else getattr(torch, dtype)
        return torch.empty(shape, dtype=dt, device=like.device)
    if f == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)
    return np.empty(shape, dtype=like.dtype if dtype is None else dtype)


def _stream(x):
    f = family(x)
    if f == "torch" and x.is_cuda:
        import torch

        return torch.cuda.current_stream(x.device).cuda_stream
    if f == "cupy":
        import cupy

        with x.device:
            return cupy.cuda.get_current_stream().ptr
    return 0


def context(x, num_splits=0):
    return _C.Context(stream=_stream(x), num_splits=num_splits, cpu_algorithm=_cpu_algorithm, cpu_isa=_cpu_isa)


def _workspace(like, nbytes):
    if nbytes == 0:
        return None
    f = family(like)
    if f == "torch":
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    return empty(like, (nbytes,), "uint8")


def _on_device(x):
    """The torch device guard for x: launches and workspace follow the inputs' GPU."""
    if family(x) == "torch" and x.is_cuda:
        import torch

        return torch.cuda.device(x.device)
    if family(x) == "cupy":
        return x.device
    import contextlib

    return contextlib.nullcontext()


def forward(q, k, v, out, lse, options, alibi_slopes=None, varlen=None, num_splits=0, block_table=None):
    """out, lse <- attention. varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); with a
    block_table (paged varlen), k and v are pages (num_pages, page_size, h_k, d)."""
    with _on_device(q):
        ctx = context(q, num_splits)
        ws = None
        if is_cuda(q) and block_table is None:
            ws = _workspace(q, _C.forward_workspace_size(q, k, options, *(varlen or ())))
        if varlen is None:
            _C.forward(q, k, v, out, lse, options, ctx, alibi_slopes, ws)
        else:
            _C.forward_varlen(q, k, v, *varlen, out, lse, options, ctx, alibi_slopes, ws, block_table)


# Workspace bytes of forward_kvcache by call signature: they depend on shapes and devices only, and
# a decoding loop repeats one signature, so the second validation and its DLPack conversions are
# paid once per shape instead of every step (host time is the serving bar, issue 10).
_kvcache_ws = {}


def _kvcache_workspace_size(q, k_cache, v_cache, k_new, cos, sin, interleaved, seqlens, seqlen, batch_idx, leftpad,
                            block_table, options):
    sig = lambda x: None if x is None else (tuple(x.shape), str(x.dtype), str(x.device))  # noqa: E731
    key = (sig(q), sig(k_cache), sig(k_new), sig(cos), sig(block_table), batch_idx is None, seqlens is None,
           leftpad is None, options.causal, options.window_left, options.window_right)
    n = _kvcache_ws.get(key)
    if n is None:
        if len(_kvcache_ws) > 256:
            _kvcache_ws.clear()
        n = _kvcache_ws[key] = _C.forward_kvcache_workspace_size(q, k_cache, v_cache, k_new, cos, sin, interleaved,
                                                                 seqlens, seqlen, batch_idx, leftpad, block_table,
                                                                 options)
    return n


def forward_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, interleaved, seqlens, seqlen, batch_idx, leftpad,
                    block_table, out, lse, options, alibi_slopes=None, num_splits=0):
    """out, lse <- attention over the KV cache after appending k_new, v_new into it in place
    (flashmonoid::forward_kvcache). seqlens: int32 (b) array or None, then seqlen (an int, -1 = full)."""
    with _on_device(q):
        ctx = context(q, num_splits)
        ws = None
        if is_cuda(q):
            ws = _workspace(q, _kvcache_workspace_size(q, k_cache, v_cache, k_new, cos, sin, interleaved, seqlens,
                                                       seqlen, batch_idx, leftpad, block_table, options))
        _C.forward_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, interleaved, seqlens, seqlen, batch_idx,
                           leftpad, block_table, out, lse, options, ctx, alibi_slopes, ws)


def backward(dout, q, k, v, out, lse, dq, dk, dv, options, alibi_slopes=None, varlen=None):
    with _on_device(q):
        ctx = context(q)
        ws = None
        if is_cuda(q):
            ws = _workspace(q, _C.backward_workspace_size(q, k, options, *(varlen or ())))
        if varlen is None:
            _C.backward(dout, q, k, v, out, lse, dq, dk, dv, options, ctx, alibi_slopes, ws)
        else:
            _C.backward_varlen(dout, q, k, v, *varlen, out, lse, dq, dk, dv, options, ctx, alibi_slopes, ws)


def merge(outs, lses, out, lse):
    with _on_device(out):
        _C.merge(list(outs), list(lses), out, lse, context(out))
