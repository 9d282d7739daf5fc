"""Calls into flashmonoid._C for any DLPack array family: NumPy, torch, CuPy.

The C++ API never allocates and never picks a stream, so this module does both, in the family of
the inputs: outputs and workspace come from that family's allocator (torch's caching allocator for
torch tensors), and CUDA work goes on the family's current stream of the inputs' device. The
library selects the inputs' GPU itself around every CUDA call, and every allocation here names
its device, so no device guard is needed on this side.

Host time matters (a decoding step calls forward_kvcache once per layer per token; issue 10's bar
is 15 us per call), so torch tensors take the cheapest route (_Torch; the costs quoted there are
for one call on a Zen 3 VM core, torch 2.15, CPU tensors).
"""

import contextlib
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
    """"best" (AVX-512 where the CPU has it, bf16 products on AMX tiles where it has AMX-BF16; capped by
    FLASHMONOID_CPU_ISA) or "avx2" for CPU calls."""
    global _cpu_isa
    _cpu_isa = _C.CpuIsa.__members__[name]


def get_cpu_isa():
    return _cpu_isa.name


def family(x):
    """"torch", "numpy" or "cupy": which allocator and stream go with x."""
    f = _families.get(type(x))
    if f is None:
        module = type(x).__module__
        if module.startswith("torch"):
            f = "torch"
        elif module.startswith("cupy"):
            f = "cupy"
        elif isinstance(x, np.ndarray):
            f = "numpy"
        else:
            raise TypeError(f"flashmonoid: expected a NumPy array, a torch tensor or a CuPy array, got "
                            f"{type(x).__name__}")
        _families[type(x)] = f
    return f


_families = {}  # type -> family: a lookup costs 0.05 us, the module test 0.3 us


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


class _Torch:
    """The route of torch tensors into _C, the cheapest measured:
    - arrays go as DLPack capsules from torch.utils.dlpack.to_dlpack, a C function. Given the
      tensor itself, nanobind calls Tensor.__dlpack__, a Python method that checks grad,
      conjugation, layout, the current device and streams: 3.8 us per tensor against 0.34 us;
    - the stream is torch's current raw stream handle of the inputs' device, an int, without a
      torch.cuda.Stream object;
    - forward_kvcache's workspace is kept per (device, stream) and grown (kept_workspace), with no
      size query per call (_C says when it is short);
    - forward_kvcache passes the tensors themselves to _C.forward_kvcache_torch, which reads them
      through torch's DLPack C exchange table (torch >= 2.10; ~0.05 us a tensor, no capsule), with
      the Context as plain arguments (a _C.Context from keywords costs ~2 us)."""

    def __init__(self):
        import torch
        from torch.utils.dlpack import to_dlpack

        self.torch = torch
        self.to_dlpack = to_dlpack
        # Present in CUDA builds of torch (torch._inductor launches through it); a CPU-only
        # torch has no CUDA tensors to ask about.
        self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        # torch.cuda.is_current_stream_capturing is a Python wrapper of this (0.3 us more).
        self.capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        self.kept = {}
        self.exchange = _C.has_torch_exchange(torch.empty(0))
        if self.exchange:  # the types _C.kvcache_eager_torch takes (flash_attn_with_kvcache's eager route)
            _C.set_torch_types(torch.Tensor, torch.nn.Parameter)

    def export(self, x):
        return None if x is None else self.to_dlpack(x)

    def stream(self, x):
        return self.raw_stream(x.get_device()) if x.is_cuda else 0

    def kept_workspace(self, like, nbytes, stream):
        """At least nbytes on like's device for work on `stream`, the same buffer call after call
        (a decoding loop repeats one shape; an allocation costs ~2.5 us). Work on one stream runs
        in order, so a call never overwrites what an earlier call on that stream still reads; a
        bigger request replaces the buffer, which torch frees in stream order. While the stream
        is captured into a CUDA graph the buffer is a fresh one from the graph's pool, which the
        graph keeps as long as it lives: a kept buffer could be replaced and freed under it."""
        torch = self.torch
        if self.capturing():
            return torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        key = (like.get_device(), stream)
        ws = self.kept.get(key)
        if ws is None or ws.numel() < nbytes:
            ws = self.kept[key] = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        return ws

    def forward_kvcache(self, q, k_cache, v_cache, k_new, v_new, cos, sin, interleaved, seqlens, seqlen, batch_idx,
                        leftpad, block_table, out, lse, options, alibi_slopes, num_splits, keep):
        """_backend.forward_kvcache for torch tensors: the kept workspace (keep) goes in as it is, and
        when _C finds it short (it then runs nothing) a big enough one follows; no size query per call."""
        stream, ws = 0, None
        if q.is_cuda:
            device = q.get_device()
            stream = self.raw_stream(device)
            ws = None if self.capturing() or not keep else self.kept.get((device, stream))
        args = (q, k_cache, v_cache, k_new, v_new, cos, sin, interleaved, seqlens, seqlen, batch_idx, leftpad,
                block_table, out, lse, options, alibi_slopes)
        need = _C.forward_kvcache_torch(*args, ws, stream, num_splits, _cpu_algorithm, _cpu_isa)
        if need:
            ws = self.kept_workspace(q, need, stream) if keep else self.torch.empty(need, dtype=self.torch.uint8,
                                                                                    device=q.device)
            _C.forward_kvcache_torch(*args, ws, stream, num_splits, _cpu_algorithm, _cpu_isa)


_torch_route = None


def _torch():
    global _torch_route
    if _torch_route is None:
        _torch_route = _Torch()
    return _torch_route


def kvcache_eager():
    """Whether _C.kvcache_eager_torch can take torch tensors here (torch >= 2.10)."""
    return _torch().exchange


def _same(x):
    return x


def _exporter(x):
    """What turns an array of x's family into an argument of _C (each argument freshly: a capsule
    is consumed by the call that takes it)."""
    return _torch().export if family(x) == "torch" else _same


def _stream(x):
    f = family(x)
    if f == "torch":
        return _torch().stream(x)
    if f == "cupy":
        import cupy

        with x.device:
            return cupy.cuda.get_current_stream().ptr
    return 0


# Context::persistent_kernels for the calls of this process; the ring turns it off around its
# forwards and backwards while an exchange is in flight (distributed.py), so NCCL's kernels get SMs.
_persistent_kernels = True


@contextlib.contextmanager
def persistent_kernels(on: bool):
    global _persistent_kernels
    before, _persistent_kernels = _persistent_kernels, bool(on)
    try:
        yield
    finally:
        _persistent_kernels = before


def context(x, num_splits=0, stream=None):
    return _C.Context(stream=_stream(x) if stream is None else stream, num_splits=num_splits,
                      cpu_algorithm=_cpu_algorithm, cpu_isa=_cpu_isa, persistent_kernels=_persistent_kernels)


def _workspace(like, nbytes):
    return None if nbytes == 0 else empty(like, (nbytes,), "uint8")


def _on_device(x):
    """CuPy's __dlpack__, which nanobind calls, orders streams of the current device: make it x's.
    torch tensors go as capsules, NumPy arrays live on the host, and the library selects the GPU
    itself around every CUDA call."""
    return x.device if family(x) == "cupy" else _no_guard


_no_guard = contextlib.nullcontext()


def _device_index(x):
    return x.get_device() if family(x) == "torch" else x.device.id


def forward(q, k, v, out, lse, options, alibi_slopes=None, varlen=None, num_splits=0, block_table=None):
    """out, lse <- attention. varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k[, seqused_q,
    seqused_k]); with a block_table (paged varlen), k and v are pages (num_pages, page_size, h_k, d)."""
    a = _exporter(q)
    cu = lambda: () if varlen is None else (a(varlen[0]), a(varlen[1]), varlen[2], varlen[3])  # noqa: E731
    with _on_device(q):
        ctx = context(q, num_splits)
        ws = None
        if is_cuda(q) and block_table is None:
            ws = _workspace(q, _C.forward_workspace_size(a(q), a(k), options, *cu()))
        if varlen is None:
            _C.forward(a(q), a(k), a(v), a(out), a(lse), options, ctx, a(alibi_slopes), a(ws))
        else:
            _C.forward_varlen(a(q), a(k), a(v), *cu(), a(out), a(lse), options, ctx, a(alibi_slopes), a(ws),
                              a(block_table), *_used(a, varlen))


# Workspace bytes of forward_kvcache by call signature: they depend on shapes, dtype, device and
# options only, and a decoding loop repeats one signature, so the size query (a second
# validation) runs once per signature. The key reads shapes only (str() of a dtype or a device
# costs 0.5 us each).
_kvcache_ws = {}


def _kvcache_workspace_size(a, q, k_cache, v_cache, k_new, cos, sin, interleaved, seqlens, seqlen, batch_idx,
                            leftpad, block_table, options):
    shape = lambda x: None if x is None else x.shape  # noqa: E731
    key = (q.shape, q.dtype, _device_index(q), k_cache.shape,
           shape(k_new), shape(cos), shape(block_table), batch_idx is None, seqlens is None, seqlen,
           leftpad is None, options.causal, options.window_left, options.window_right)
    n = _kvcache_ws.get(key)
    if n is None:
        if len(_kvcache_ws) > 256:
            _kvcache_ws.clear()
        n = _kvcache_ws[key] = _C.forward_kvcache_workspace_size(
            a(q), a(k_cache), a(v_cache), a(k_new), a(cos), a(sin), interleaved, a(seqlens), seqlen, a(batch_idx),
            a(leftpad), a(block_table), options)
    return n


def forward_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, interleaved, seqlens, seqlen, batch_idx, leftpad,
                    block_table, out, lse, options, alibi_slopes=None, num_splits=0, keep_workspace=True):
    """out, lse <- attention over the KV cache after appending k_new, v_new into it in place
    (flashmonoid::forward_kvcache). seqlens: int32 (b) array or None, then seqlen (an int, -1 = full).
    keep_workspace=False: a torch call's workspace is a fresh tensor, not the one kept per stream
    (the torch op does so: a compiled graph's CUDA graph trees allocate from their own pool while they
    warm up, and a buffer kept past the graph's accounting there makes them fail)."""
    if _families.get(type(q)) == "torch" and _torch().exchange:
        return _torch_route.forward_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, interleaved, seqlens, seqlen,
                                            batch_idx, leftpad, block_table, out, lse, options, alibi_slopes,
                                            num_splits, keep_workspace)
    a = _exporter(q)
    with _on_device(q):
        stream = _stream(q)
        ws = None
        if is_cuda(q):
            n = _kvcache_workspace_size(a, q, k_cache, v_cache, k_new, cos, sin, interleaved, seqlens, seqlen,
                                        batch_idx, leftpad, block_table, options)
            if n > 0:
                ws = _torch().kept_workspace(q, n, stream) if family(q) == "torch" and keep_workspace else \
                    _workspace(q, n)
        _C.forward_kvcache(a(q), a(k_cache), a(v_cache), a(k_new), a(v_new), a(cos), a(sin), interleaved,
                           a(seqlens), seqlen, a(batch_idx), a(leftpad), a(block_table), a(out), a(lse), options,
                           context(q, num_splits, stream), a(alibi_slopes), a(ws))


def _used(a, varlen):
    """(seqused_q, seqused_k) of a varlen tuple, exported (None where not given)."""
    return (a(varlen[4]), a(varlen[5])) if len(varlen) > 4 else (None, None)


def backward(dout, q, k, v, out, lse, dq, dk, dv, options, alibi_slopes=None, varlen=None):
    a = _exporter(q)
    cu = lambda: () if varlen is None else (a(varlen[0]), a(varlen[1]), varlen[2], varlen[3])  # noqa: E731
    with _on_device(q):
        ctx = context(q)
        ws = None
        if is_cuda(q):
            ws = _workspace(q, _C.backward_workspace_size(a(q), a(k), options, *cu()))
        if varlen is None:
            _C.backward(a(dout), a(q), a(k), a(v), a(out), a(lse), a(dq), a(dk), a(dv), options, ctx,
                        a(alibi_slopes), a(ws))
        else:
            _C.backward_varlen(a(dout), a(q), a(k), a(v), *cu(), a(out), a(lse), a(dq), a(dk), a(dv), options,
                               ctx, a(alibi_slopes), a(ws), *_used(a, varlen))


def merge(outs, lses, out, lse):
    a = _exporter(out)
    with _on_device(out):
        _C.merge([a(o) for o in outs], [a(x) for x in lses], a(out), a(lse), context(out))
