"""flash_attn_with_kvcache and flash_attn_varlen_func(block_table=...) against a float64 torch
model of flash-attn 2.8's semantics: append in place, rotary positions, paged caches of any page
size, batch index, leftpad, masks aligned to the cache length after the append."""

import pytest

torch = pytest.importorskip("torch")

import flashmonoid as fm  # noqa: E402
from flashmonoid import flash_attn_interface as fa  # noqa: E402

from torch_reference import attention as ref_attention  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fm.cuda_available()
CONFIGS = [("cpu", torch.float32)] + [
    pytest.param("cuda", dt, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build"))
    for dt in (torch.float16, torch.bfloat16)]


def rope(x, cos, sin, pos, interleaved):
    """x (n, heads, d) rotated at positions pos (n,), in float64 (flash-attn's apply_rotary_emb)."""
    x = x.double().clone()
    half = cos.shape[1]
    c, s = cos[pos].double()[:, None, :].to(x.device), sin[pos].double()[:, None, :].to(x.device)
    a_idx = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    b_idx = a_idx + 1 if interleaved else a_idx + half
    a, b = x[..., a_idx].clone(), x[..., b_idx].clone()
    x[..., a_idx] = a * c - b * s
    x[..., b_idx] = a * s + b * c
    return x


class Case:
    """A random cache problem; the physical cache holds NaN wherever no sequence has a row."""

    def __init__(self, device, dtype, b=3, s_q=2, s_new=2, h=4, h_k=2, d=32, capacity=40, page=0, batch_idx=False,
                 leftpad=False, rotary_dim=0, interleaved=True, seed=0, head_major=False):
        g = torch.Generator().manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
        self.page, self.s_new, self.device = page, s_new, device
        if page:
            self.max_pages = -(-capacity // page)
            capacity = self.max_pages * page
            num_pages = b * self.max_pages + 2
            perm = torch.randperm(num_pages, generator=g)[: b * self.max_pages].to(torch.int32)
            self.block_table = perm.reshape(b, self.max_pages).to(device)
            shape = (num_pages, page, h_k, d)
        else:
            self.block_table = None
            b_cache = b + (2 if batch_idx else 0)
            shape = (b_cache, capacity, h_k, d)
        self.capacity = capacity
        self.batch_idx = torch.randperm(b + 2, generator=g)[:b].to(torch.int32).to(device) if batch_idx else None
        self.seqlens = torch.randint(0, capacity - s_new + 1, (b,), generator=g, dtype=torch.int32).to(device)
        lp = [int(torch.randint(0, int(n) + 1, (), generator=g)) if leftpad else 0 for n in self.seqlens.cpu()]
        self.leftpad = torch.tensor(lp, dtype=torch.int32, device=device) if leftpad else None
        # head_major: views of (slots, h_k, rows, d) memory, HF transformers' cache layout.
        held = (shape[0], h_k, shape[1], d) if head_major else shape
        full = lambda: torch.full(held, float("nan"), dtype=dtype, device=device)  # noqa: E731
        self.k_cache = full().transpose(1, 2) if head_major else full()
        self.v_cache = full().transpose(1, 2) if head_major else full()
        for i in range(b):
            rows = torch.arange(lp[i], int(self.seqlens[i]))
            self.set_rows(self.k_cache, i, rows, rnd(len(rows), h_k, d))
            self.set_rows(self.v_cache, i, rows, rnd(len(rows), h_k, d))
        self.q = rnd(b, s_q, h, d)
        self.k = rnd(b, s_new, h_k, d) if s_new else None
        self.v = rnd(b, s_new, h_k, d) if s_new else None
        self.cos = self.sin = None
        if rotary_dim:
            angle = torch.rand(capacity, rotary_dim // 2, generator=g, dtype=torch.float64) * 6.283185307179586
            self.cos, self.sin = angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)
        self.interleaved = interleaved

    def where(self, i, rows):
        """(slot, row) of sequence i's cache rows, on the cache's device."""
        rows = rows.to(self.device)
        if self.page:
            return self.block_table[i].long()[rows // self.page], rows % self.page
        slot = int(self.batch_idx[i]) if self.batch_idx is not None else i
        return torch.full_like(rows, slot), rows

    def set_rows(self, cache, i, rows, x):
        slot, r = self.where(i, rows)
        cache[slot, r] = x

    def get_rows(self, cache, i, rows):
        slot, r = self.where(i, rows)
        return cache[slot, r]

    def run(self, **kw):
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        out, lse = fa.flash_attn_with_kvcache(
            self.q, kc, vc, self.k, self.v, rotary_cos=self.cos, rotary_sin=self.sin, cache_seqlens=self.seqlens,
            cache_batch_idx=self.batch_idx, cache_leftpad=self.leftpad, block_table=self.block_table,
            rotary_interleaved=self.interleaved, return_softmax_lse=True, **kw)
        return out, lse, kc, vc

    def expected(self, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, upcast=True):
        """(out, new k rows per sequence) in float64 (or the input dtype, upcast=False)."""
        per_row = causal or window_size[0] >= 0 or window_size[1] >= 0
        outs, new_k = [], []
        s_q = self.q.shape[1]
        for i in range(self.q.shape[0]):
            n = int(self.seqlens[i].cpu())
            lp = 0 if self.leftpad is None else int(self.leftpad[i].cpu())
            keys = self.get_rows(self.k_cache, i, torch.arange(lp, n)).double()
            vals = self.get_rows(self.v_cache, i, torch.arange(lp, n)).double()
            q = self.q[i].double()
            kn = self.k[i].double() if self.k is not None else keys[:0]
            if self.cos is not None:
                kn = rope(kn, self.cos.cpu(), self.sin.cpu(), torch.arange(n, n + self.s_new), self.interleaved)
                # Queries past the cos/sin table take its last row (kvcache.hpp).
                pos = (torch.arange(n, n + s_q) if per_row else torch.full((s_q,), n)).clamp(max=self.cos.shape[0] - 1)
                q = rope(q.cpu(), self.cos.cpu(), self.sin.cpu(), pos, self.interleaved)
            dev, dt = self.q.device, self.q.dtype
            new_k.append(kn.to(device=dev, dtype=dt))
            keys = torch.cat([keys.to(dev), kn.to(dev)])
            vals = torch.cat([vals.to(dev), self.v[i].double() if self.v is not None else vals[:0]])
            if not upcast:  # the same math in the input dtype, on the rounded rotated inputs
                q, keys, vals = (x.to(dt) for x in (q, keys, vals))
            slopes = alibi_slopes[i:i + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
            outs.append(ref_attention(q.to(dev)[None], keys[None], vals[None], causal=causal, window=window_size,
                                      softcap=softcap, alibi_slopes=slopes, upcast=upcast))
        return torch.cat(outs), new_k


def check(case, **kw):
    out, lse, kc, vc = case.run(**kw)
    assert lse.shape == (case.q.shape[0], case.q.shape[2], case.q.shape[1])
    check_result(case, out, kc, vc, **kw)


def check_result(case, out, kc, vc, **kw):
    """out and the caches after a call (kc, vc) against case's expected attention and append."""
    ref, new_k = case.expected(**kw)
    low, _ = case.expected(upcast=False, **kw)
    floor = 1e-5 if case.q.dtype == torch.float32 else 0.0
    assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + floor
    for i in range(case.q.shape[0]):
        n = int(case.seqlens[i].cpu())
        rows = torch.arange(n, n + case.s_new)
        if case.s_new:
            # The rotated new keys are stored rounded to the cache's dtype: one rounding of float64.
            torch.testing.assert_close(case.get_rows(kc, i, rows), new_k[i], rtol=2e-3, atol=2e-3)
            assert torch.equal(case.get_rows(vc, i, rows), case.v[i])
    # Every other element is untouched (NaN where it was NaN).
    for before, after in ((case.k_cache, kc), (case.v_cache, vc)):
        written = torch.zeros(after.shape[:2], dtype=torch.bool, device=after.device)
        for i in range(case.q.shape[0]):
            n = int(case.seqlens[i].cpu())
            slot, r = case.where(i, torch.arange(n, n + case.s_new))
            written[slot, r] = True
        assert torch.equal(before[~written].isnan(), after[~written].isnan())
        assert torch.equal(before[~written].nan_to_num(), after[~written].nan_to_num())


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("page", [0, 1, 3, 16])
def test_kvcache_layouts(device, dtype, page):
    check(Case(device, dtype, page=page, batch_idx=page == 0, leftpad=True, s_q=3, s_new=3), causal=True)


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("page", [0, 16])
def test_kvcache_head_major_caches(device, dtype, page):
    """Caches held head-major, passed as strided (slots, rows, h_k, d) views: appended in place there."""
    case = Case(device, dtype, page=page, leftpad=page == 0, s_q=2, s_new=1, rotary_dim=16, head_major=True, seed=3)
    assert not case.k_cache.is_contiguous() and case.k_cache.stride(2) == case.k_cache.shape[1] * case.k_cache.shape[3]
    check(case, causal=True)


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_rotary(device, dtype, interleaved, causal):
    check(Case(device, dtype, rotary_dim=16, interleaved=interleaved, page=3, s_q=4, s_new=4, seed=1), causal=causal)


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_kvcache_window_softcap_alibi_mqa(device, dtype):
    case = Case(device, dtype, h=4, h_k=1, s_q=5, s_new=1, rotary_dim=32, interleaved=False, seed=2)
    slopes = torch.rand(3, 4, dtype=torch.float32, device=device)
    check(case, window_size=(7, 1), softcap=4.0, alibi_slopes=slopes)


def test_kvcache_int_seqlens_and_no_append():
    case = Case("cpu", torch.float32, s_new=0, seed=3)
    n = int(case.seqlens.min())  # every sequence holds real rows below its own length
    case.seqlens = torch.full_like(case.seqlens, n)
    out, _, _, _ = case.run(causal=True)
    assert not out.isnan().any()
    kc = case.k_cache.clone()
    out_int = fa.flash_attn_with_kvcache(case.q, kc, case.v_cache.clone(), cache_seqlens=n, causal=True)
    assert torch.equal(out, out_int)
    full = fa.flash_attn_with_kvcache(case.q, torch.randn(3, 8, 2, 32), torch.randn(3, 8, 2, 32))
    assert full.shape == case.q.shape and not full.isnan().any()


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_kvcache_repeats_bit_for_bit_under_torch_deterministic_mode(device, dtype):
    """torch.use_deterministic_algorithms(True) sets Options::deterministic for the call: CUDA split-KV
    decoding then keeps its split blocks on fixed key ranges (over a long contiguous cache they
    otherwise take key tiles from a shared counter, and the order of a partial's sums varies)."""
    from flashmonoid import torch_ops
    # CUDA: b = 1, 8 KV heads, 128k keys: the heuristic's 33 splits of 62 key tiles would share.
    b, h, h_k, d, cap = (1, 32, 8, 128, 131072) if device == "cuda" else (2, 4, 2, 32, 64)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(b, 1, h, d, generator=g).to(device, dtype)
    k_cache = torch.randn(b, cap, h_k, d, generator=g).to(device, dtype)
    v_cache = torch.randn(b, cap, h_k, d, generator=g).to(device, dtype)
    seqlens = torch.full((b,), cap, dtype=torch.int32, device=device)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        on = torch.are_deterministic_algorithms_enabled()
        assert torch_ops._kvcache_options(0.125, True, -1, 0, 0.0, on).deterministic
        outs = [fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    assert not torch_ops._kvcache_options(0.125, True, -1, 0, 0.0, False).deterministic
    assert not outs[0].isnan().any()
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_kvcache_never_reads_device_values_on_the_host(monkeypatch):
    case = Case("cpu", torch.float32, page=3, leftpad=True, rotary_dim=16, seed=4)

    def boom(*args, **kwargs):
        raise AssertionError("a host read of a tensor value (a device synchronisation on CUDA)")

    for name in ("item", "tolist", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    case.run(causal=True)


def test_kvcache_compiles_without_graph_breaks():
    case = Case("cpu", torch.float32, page=16, rotary_dim=16, seed=5)

    def step(q, kc, vc, k, v, cos, sin, seqlens, table):
        return fa.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                          block_table=table, causal=True)

    args = (case.cos, case.sin, case.seqlens, case.block_table)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    want = step(case.q, kc, vc, case.k, case.v, *args)
    kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(case.q, kc2, vc2, case.k, case.v, *args)
    assert torch.equal(got, want)
    assert torch.equal(kc2.nan_to_num(), kc.nan_to_num()) and torch.equal(vc2.nan_to_num(), vc.nan_to_num())


def test_kvcache_opcheck():
    # Schema (k_cache, v_cache mutated), fake kernel, autograd registration, AOT dispatch.
    case = Case("cpu", torch.float32, page=3, rotary_dim=16, leftpad=True, seed=11)
    kc, vc = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()
    args = (case.q, kc, vc, case.k, case.v, case.cos, case.sin, case.seqlens, -1, None, case.leftpad,
            case.block_table, None, 32 ** -0.5, True, -1, -1, 0.0, True, 0)
    torch.library.opcheck(torch.ops.flashmonoid.fwd_kvcache.default, args)


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("page", [1, 5, 16])
def test_varlen_with_block_table(device, dtype, page):
    g = torch.Generator().manual_seed(6)
    lens_q, lens_k = [3, 1, 6], [3, 20, 9]
    h, h_k, d = 4, 2, 32
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = rnd(sum(lens_q), h, d), rnd(sum(lens_k), h_k, d), rnd(sum(lens_k), h_k, d)
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 3, 23, 32], dtype=torch.int32, device=device)
    max_pages = -(-20 // page)
    perm = torch.randperm(3 * max_pages + 1, generator=g).to(torch.int32)
    table = perm[: 3 * max_pages].reshape(3, max_pages).to(device)
    kp = torch.full((3 * max_pages + 1, page, h_k, d), float("nan"), dtype=dtype, device=device)
    vp = kp.clone()
    for i in range(3):
        rows = torch.arange(lens_k[i], device=device)
        kp[table[i].long()[rows // page], rows % page] = k[cu_k[i]:cu_k[i + 1]]
        vp[table[i].long()[rows // page], rows % page] = v[cu_k[i]:cu_k[i + 1]]
    out = fa.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 6, 20, causal=True, block_table=table)
    want = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 20, causal=True)
    if dtype == torch.float32:
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want)


INVALID = [
    ("rotary without k", dict(rotary_cos=torch.ones(8, 4), rotary_sin=torch.ones(8, 4)),
     "If rotary cos/sin are provided, new key / query must also be provided"),
    ("block_table dtype", dict(block_table=torch.zeros(1, 2)), "block_table must have dtype torch.int32"),
    ("block_table with batch idx", dict(block_table=torch.zeros(1, 2, dtype=torch.int32),
                                        cache_batch_idx=torch.zeros(1, dtype=torch.int32)),
     "Paged KVcache does not support cache_batch_idx"),
    ("leftpad dtype", dict(cache_leftpad=torch.zeros(1)), "leftpad_k must have dtype int32"),
    ("batch idx dtype", dict(cache_batch_idx=torch.zeros(1)), "cache_batch_idx must have dtype int32"),
]


@pytest.mark.parametrize("kw,message", [(c, m) for _, c, m in INVALID], ids=[n for n, _, _ in INVALID])
def test_kvcache_invalid_input_messages(kw, message):
    with pytest.raises(RuntimeError) as info:
        fa.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 8), torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8), **kw)
    assert str(info.value).startswith(message)


def test_kvcache_rotary_positions_checked():
    with pytest.raises(RuntimeError, match="cos/sin seqlen must be at least the seqlen of KV cache"):
        fa.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 8), torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8),
                                   torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), rotary_cos=torch.ones(7, 4),
                                   rotary_sin=torch.ones(7, 4), cache_seqlens=1)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
@pytest.mark.parametrize("d", [59, 111])
def test_head_dims_not_a_multiple_of_8_run_on_cuda(d):
    # Zero-padded to a multiple of 8 in torch_ops (exact), in every function, the cache included.
    check(Case("cuda", torch.bfloat16, d=d, page=16, rotary_dim=32, seed=7), causal=True)
    check(Case("cuda", torch.float16, d=d, batch_idx=True, seed=8), causal=False)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 37, 4, d, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True)
    ref = ref_attention(q, k, v, causal=True)
    low = ref_attention(q, k, v, causal=True, upcast=False)
    assert out.shape == q.shape
    assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert dq.shape == q.shape and not dq.isnan().any()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
def test_kvcache_cuda_graph_replays_with_new_seqlens_and_block_table():
    # One capture; before each replay cache_seqlens, leftpad and block_table get new values in place
    # (the same tensors) and the cache, q, k, v new data: nothing read at capture time may stick.
    shape = dict(b=3, s_q=2, s_new=1, h=8, h_k=2, d=64, capacity=80, page=16, leftpad=True, rotary_dim=32)
    first = Case("cuda", torch.bfloat16, seed=12, **shape)
    names = ("q", "k", "v", "k_cache", "v_cache", "cos", "sin", "seqlens", "leftpad", "block_table")
    static = {n: getattr(first, n).clone() for n in names}

    def step():
        return fa.flash_attn_with_kvcache(
            static["q"], static["k_cache"], static["v_cache"], static["k"], static["v"], rotary_cos=static["cos"],
            rotary_sin=static["sin"], cache_seqlens=static["seqlens"], cache_leftpad=static["leftpad"],
            block_table=static["block_table"], causal=True)

    side = torch.cuda.Stream()  # warm-up off the capturing stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (13, 14, 15):
        case = Case("cuda", torch.bfloat16, seed=seed, **shape)
        assert not torch.equal(case.seqlens, first.seqlens) and not torch.equal(case.block_table, first.block_table)
        for n in names:
            static[n].copy_(getattr(case, n))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_result(case, out, static["k_cache"], static["v_cache"], causal=True)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
@pytest.mark.parametrize("cpu_arg", ["q", "k_cache", "k", "cache_seqlens", "block_table", "rotary_cos"])
def test_kvcache_cpu_tensor_among_cuda_ones_is_an_error(cpu_arg):
    # The torch route trusts each tensor's declared device instead of asking the CUDA runtime about
    # every pointer: validation must still refuse a mix, naming the argument, before any launch.
    dev = "cuda"
    t = dict(q=torch.zeros(1, 1, 2, 8, device=dev, dtype=torch.float16),
             k_cache=torch.zeros(2, 4, 2, 8, device=dev, dtype=torch.float16),
             v_cache=torch.zeros(2, 4, 2, 8, device=dev, dtype=torch.float16),
             k=torch.zeros(1, 1, 2, 8, device=dev, dtype=torch.float16),
             v=torch.zeros(1, 1, 2, 8, device=dev, dtype=torch.float16),
             rotary_cos=torch.ones(8, 4, device=dev, dtype=torch.float16),
             rotary_sin=torch.zeros(8, 4, device=dev, dtype=torch.float16),
             cache_seqlens=torch.ones(1, device=dev, dtype=torch.int32),
             block_table=torch.tensor([[1, 0]], device=dev, dtype=torch.int32))
    t[cpu_arg] = t[cpu_arg].cpu()
    name = {"rotary_cos": "rotary.cos", "k": "k_new", "cache_seqlens": "seqlens"}.get(cpu_arg, cpu_arg)
    with pytest.raises(ValueError, match="all tensors must share a device") as info:
        fa.flash_attn_with_kvcache(**t, causal=True)
    assert name in str(info.value) or cpu_arg == "q"
    torch.cuda.synchronize()


def test_kvcache_library_errors_pass_through_the_fast_path():
    # A rule flash-attn lacks (page numbers are checked on the CPU) keeps the library's message.
    with pytest.raises(ValueError, match="block_table: entry"):
        fa.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                                   torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8),
                                   cache_seqlens=torch.tensor([4], dtype=torch.int32),
                                   block_table=torch.tensor([[0, 7]], dtype=torch.int32))


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_kvcache_eager_route_equals_the_dispatcher_route(device, dtype, monkeypatch):
    """flash_attn_with_kvcache's eager route (_C.kvcache_eager_torch: the checks, the outputs, torch's
    stream and the kept workspace in one call) gives the dispatcher route's bits (out, lse, caches),
    call after call on the kept workspace, for compact caches and for strided ones with a contiguous
    last dimension (head-major, wider rows); it declines (None) a q that needs grad and a cache whose
    last dimension is not contiguous, which then take the dispatcher route (and its error)."""
    from flashmonoid import _C, _backend

    if not _backend.kvcache_eager():
        pytest.skip("torch before 2.10 has no DLPack exchange table")
    real, results = _C.kvcache_eager_torch, []

    def spy(*args):
        results.append(real(*args))
        return results[-1]

    for page, rotary, splits, head_major in ((0, 16, 0, False), (16, 0, 3, False), (0, 32, 5, False),
                                             (0, 16, 0, True), (16, 0, 3, True)):
        case = Case(device, dtype, page=page, rotary_dim=rotary, leftpad=page == 0, seed=7 + page + splits,
                    head_major=head_major)
        monkeypatch.setattr(_C, "kvcache_eager_torch", spy)
        eager = case.run(causal=True, num_splits=splits)
        assert results[-1] is not None
        monkeypatch.setattr(_C, "kvcache_eager_torch", lambda *args: None)
        dispatched = case.run(causal=True, num_splits=splits)
        for a, b in zip(eager, dispatched):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
        check_result(case, eager[0], eager[2], eager[3], causal=True)
        # Without return_softmax_lse the route writes lse into its kept workspace's tail (no tensor of
        # its own): the same out and caches, call after call, and a call with lse after it unchanged.
        monkeypatch.setattr(_C, "kvcache_eager_torch", spy)
        for _ in range(2):
            kc, vc = case.k_cache.clone(), case.v_cache.clone()
            out = fa.flash_attn_with_kvcache(
                case.q, kc, vc, case.k, case.v, rotary_cos=case.cos, rotary_sin=case.sin, cache_seqlens=case.seqlens,
                cache_batch_idx=case.batch_idx, cache_leftpad=case.leftpad, block_table=case.block_table,
                rotary_interleaved=case.interleaved, causal=True, num_splits=splits)
            assert results[-1] is not None and results[-1][1] is None
            for a, b in zip((out, kc, vc), (eager[0], eager[2], eager[3])):
                assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
        again = case.run(causal=True, num_splits=splits)
        for a, b in zip(again, eager):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    monkeypatch.setattr(_C, "kvcache_eager_torch", spy)
    case = Case(device, dtype)
    q = case.q.clone().requires_grad_()
    fa.flash_attn_with_kvcache(q, case.k_cache.clone(), case.v_cache.clone(), cache_seqlens=case.seqlens)
    assert results[-1] is None
    wide = torch.cat([case.k_cache, case.k_cache], dim=-1)[..., : case.k_cache.shape[-1]]
    out = fa.flash_attn_with_kvcache(case.q, wide, case.v_cache.clone(), cache_seqlens=case.seqlens)
    assert results[-1] is not None
    assert torch.equal(out, fa.flash_attn_with_kvcache(case.q, wide.contiguous(), case.v_cache.clone(),
                                                       cache_seqlens=case.seqlens))
    across = case.k_cache.transpose(-1, -2).contiguous().transpose(-1, -2)  # the last dimension strided
    with pytest.raises(AssertionError, match="k_cache must have contiguous last dimension"):
        fa.flash_attn_with_kvcache(case.q, across, case.v_cache.clone(), cache_seqlens=case.seqlens)
    assert results[-1] is None


def test_kvcache_torch_route_refuses_other_arrays():
    from flashmonoid import _C

    q = torch.zeros(1, 1, 2, 8)
    kc = torch.zeros(1, 4, 2, 8)
    opts = _C.Options()
    with pytest.raises(TypeError, match="k_cache: expected a torch tensor"):
        _C.forward_kvcache_torch(q, kc.numpy(), kc, None, None, None, None, True, None, -1, None, None, None,
                                 torch.empty_like(q), torch.empty(1, 2, 1), opts, None, None, 0, 0,
                                 _C.CpuAlgorithm.flash, _C.CpuIsa.best)
