"""torch integration: autograd, gradcheck, torch.compile, CUDA. Skipped without torch."""

import math

import pytest

torch = pytest.importorskip("torch")

import flashmonoid as fm  # noqa: E402
from flashmonoid import torch_ops  # noqa: E402

from conftest import require_supported  # noqa: E402
from torch_reference import attention as ref_attention, lse as ref_lse, rel_err  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fm.cuda_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (sm80+) and a flashmonoid build with CUDA"))]

CASES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 2)),
    dict(softcap=3.0, causal=True),
    dict(alibi=True),
    dict(softmax_scale=0.2, window=(4, -1)),
]


def ids(c):
    return ",".join(f"{k}={v}" for k, v in c.items()) or "plain"


def inputs(b, s_q, s_k, h, h_k, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dtype=dtype, device=device).requires_grad_()
    return mk(b, s_q, h, d), mk(b, s_k, h_k, d), mk(b, s_k, h_k, d)


def with_alibi(case, h, device):
    case = dict(case)
    if case.pop("alibi", False):
        case["alibi_slopes"] = torch.tensor([2.0 ** -(i + 1) for i in range(h)], device=device)
    return case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("s_q,s_k", [(16, 16), (9, 21), (21, 9)])
def test_autograd_fp32_against_float64(device, case, s_q, s_k):
    h, h_k, d = 4, 2, 32
    case = with_alibi(case, h, device)
    q, k, v = inputs(2, s_q, s_k, h, h_k, d, torch.float32, device)
    require_supported(q, k)
    out = fm.attention(q, k, v, **case)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = ref_attention(q, k, v, **case)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    assert rel_err(out, ref) <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and g.dtype == torch.float32
        assert rel_err(g, r) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [dict(causal=True), dict(window=(5, 0), causal=True), dict(softcap=3.0)], ids=ids)
@pytest.mark.parametrize("traced", [False, True])
def test_sinks_autograd_against_float64(device, case, traced):
    """torch_ops.attention with sinks (s_aux): out, lse and the gradients of q, k, v and the sinks
    against float64 with the sink as one more softmax column (fp32: relative 1e-5 / 1e-4, as the
    other autograd tests); traced: the same under torch.compile(fullgraph=True)."""
    h, h_k, d = 4, 2, 32
    q, k, v = inputs(2, 13, 17, h, h_k, d, torch.float32, device)
    require_supported(q, k, **case)
    sinks = torch.tensor([1.5, -1.0, 0.0, 3.0], device=device, requires_grad=True)
    call = lambda q, k, v, sinks: torch_ops.attention(q, k, v, sinks=sinks, **case)  # noqa: E731
    if traced:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
    out, lse = call(q, k, v, sinks)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref = ref_attention(q, k, v, sinks=sinks, **case)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), dout.double())
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(lse, ref_lse(q, k, sinks=sinks, **case)) <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and g.dtype == torch.float32
        assert rel_err(g, r) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_autograd_against_float64(device):
    lens_q, lens_k = [5, 1, 8], [7, 3, 8]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    g = torch.Generator().manual_seed(0)
    mk = lambda n, h: torch.randn(n, h, 16, generator=g).to(device).requires_grad_()
    q, k, v = mk(sum(lens_q), 4), mk(sum(lens_k), 2), mk(sum(lens_k), 2)
    require_supported(q[None], k[None])
    out, lse = fm.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)
    assert lse.shape == (4, sum(lens_q))
    out.square().sum().backward()
    for b in range(3):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        qb, kb, vb = (x.detach()[None, s].clone().requires_grad_() for x, s in ((q, sq), (k, sk), (v, sk)))
        ref = ref_attention(qb, kb, vb, causal=True)
        ref.square().sum().backward()
        assert rel_err(out[sq], ref[0]) <= 1e-5
        for x, xb, s in ((q, qb, sq), (k, kb, sk), (v, vb, sk)):
            assert rel_err(x.grad[s], xb.grad[0]) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "compiled"])
def test_varlen_sinks_on_a_padded_batch(device, traced):
    """torch_ops.attention_varlen with sinks over a padded batch in place (used lengths; a sequence
    with queries and no keys gives out 0 and lse = its sink): out, lse and the gradients of q, k, v
    and the sinks against float64 per sequence; rows past the used ones 0 with gradient 0."""
    s_q, s_k, used_q, used_k = 7, 9, [5, 3, 6], [7, 0, 9]
    g = torch.Generator().manual_seed(2)
    mk = lambda n, h: torch.randn(n, h, 16, generator=g).to(device).requires_grad_()  # noqa: E731
    q, k, v = mk(3 * s_q, 4), mk(3 * s_k, 2), mk(3 * s_k, 2)
    require_supported(q[None], k[None], causal=True)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cu_q, cu_k = i32([0, s_q, 2 * s_q, 3 * s_q]), i32([0, s_k, 2 * s_k, 3 * s_k])
    sinks = torch.tensor([0.5, 2.0, -1.0, 1.0], device=device, requires_grad=True)
    call = lambda q, k, v, sinks: torch_ops.attention_varlen(  # noqa: E731
        q, k, v, cu_q, cu_k, s_q, s_k, causal=True, seqused_q=i32(used_q), seqused_k=i32(used_k), sinks=sinks)
    if traced:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
    out, lse = call(q, k, v, sinks)
    dout = torch.randn(out.shape, generator=g).to(device)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref_out = torch.zeros(out.shape, dtype=torch.float64, device=device)
    loss = 0.0
    for e in range(3):
        rq, rk = slice(e * s_q, e * s_q + used_q[e]), slice(e * s_k, e * s_k + used_k[e])
        ref = ref_attention(q[None, rq], k[None, rk], v[None, rk], causal=True, sinks=sinks)[0]
        ref_out[rq] = ref.detach()
        loss = loss + (ref * dout[rq].double()).sum()
        want = ref_lse(q[None, rq], k[None, rk], causal=True, sinks=sinks)[0]
        assert rel_err(lse[:, rq], want) <= 1e-5
    assert rel_err(out, ref_out) <= 1e-5
    for g_, r in zip(grads, torch.autograd.grad(loss, (q, k, v, sinks))):
        assert rel_err(g_, r) <= 1e-4
    assert torch.equal(out[5:s_q], torch.zeros_like(out[5:s_q])) and not grads[0][5:s_q].any()
    with pytest.raises(ValueError, match=r"sinks: must be a float tensor of shape \(heads,\) = \(4,\)"):
        torch_ops.attention_varlen(q, k, v, cu_q, cu_k, s_q, s_k, sinks=sinks[:2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "op"])
def test_varlen_used_lengths_run_a_padded_batch_in_place(device, traced):
    # A padded batch (slots of s rows) with seqused: the packed call's values and gradients on the used
    # rows, 0 / -inf / zero gradient on the others; through the Function and through the ops.
    s_q, s_k, used_q, used_k = 9, 11, [5, 0, 9], [7, 3, 0]
    dtype = torch.float16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    mk = lambda n, h: torch.randn(n, h, 16, generator=g).to(dtype=dtype, device=device).requires_grad_()  # noqa: E731
    q, k, v = mk(3 * s_q, 4), mk(3 * s_k, 2), mk(3 * s_k, 2)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cu_q, cu_k, uq, uk = i32([0, s_q, 2 * s_q, 3 * s_q]), i32([0, s_k, 2 * s_k, 3 * s_k]), i32(used_q), i32(used_k)
    if traced:
        out, lse = torch.ops.flashmonoid.fwd_varlen(q, k, v, cu_q, cu_k, 9, 7, 0.25, True, -1, -1, 0.0, None, 0.0, None,
                                                    False, uq, uk)
    else:
        out, lse = torch_ops.attention_varlen(q, k, v, cu_q, cu_k, 9, 7, causal=True, softmax_scale=0.25,
                                              seqused_q=uq, seqused_k=uk)
    dout = torch.randn(out.shape, generator=g).to(dtype=dtype, device=device)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    rows = lambda s, used: [r for b, n in enumerate(used) for r in range(b * s, b * s + n)]  # noqa: E731
    rq, rk = rows(s_q, used_q), rows(s_k, used_k)
    cu = lambda lens: i32([0, *torch.tensor(lens).cumsum(0).tolist()])  # noqa: E731
    pq, pk, pv = (x.detach()[r].clone().requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk)))
    ref_out, ref_lse = torch_ops.attention_varlen(pq, pk, pv, cu(used_q), cu(used_k), 9, 7, causal=True,
                                                  softmax_scale=0.25)
    ref = torch.autograd.grad(ref_out, (pq, pk, pv), dout[rq])
    assert torch.equal(out[rq], ref_out) and torch.equal(lse[:, rq], ref_lse)
    for got, want, r in ((dq, ref[0], rq), (dk, ref[1], rk), (dv, ref[2], rk)):
        assert torch.equal(got[r], want)
    others = lambda n, r: [i for i in range(n) if i not in r]  # noqa: E731
    oq, ok = others(3 * s_q, rq), others(3 * s_k, rk)
    assert (out[oq] == 0).all() and (lse[:, oq] == -math.inf).all() and (dq[oq] == 0).all()
    assert (dk[ok] == 0).all() and (dv[ok] == 0).all()


def test_varlen_used_lengths_float64_gradcheck():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 8, generator=g, dtype=torch.float64).requires_grad_() for n, h in
               ((10, 2), (12, 1), (12, 1)))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = (i32([0, 5, 10]), i32([0, 6, 12]), 4, 5)
    used = dict(seqused_q=i32([4, 2]), seqused_k=i32([5, 3]), causal=True)
    torch.autograd.gradcheck(lambda q, k, v: torch_ops.attention_varlen(q, k, v, *args, **used)[0], (q, k, v))


def test_lse_is_returned_but_not_differentiable():
    q, k, v = inputs(1, 4, 4, 2, 2, 8, torch.float32, "cpu")
    out, lse = fm.attention(q, k, v, return_lse=True)
    assert not lse.requires_grad and out.requires_grad


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window=(2, 1), softcap=2.0), dict(alibi=True),
                                  dict(dropout_p=0.25)], ids=ids)
def test_gradcheck_float64(case):
    case = with_alibi(case, 4, "cpu")
    q, k, v = inputs(2, 5, 6, 4, 2, 8, torch.float64, "cpu")
    rng = torch.tensor([7, 0]) if case.get("dropout_p") else None

    def f(q, k, v):
        return torch_ops.attention(q, k, v, rng=rng, **case)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_float64_varlen():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, h, 8, generator=g, dtype=torch.float64).requires_grad_() for h in (2, 1, 1))
    f = lambda q, k, v: torch_ops.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True)[0]
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_mask_matches_the_float64_path(device):
    """The C++ kernels (fp32) and the package's float64 path drop the same elements."""
    q, k, v = inputs(2, 7, 9, 2, 2, 16, torch.float32, device)
    require_supported(q, k, dropout_p=0.3)
    rng = torch.tensor([99, 3])
    out = torch_ops.attention(q, k, v, dropout_p=0.3, rng=rng)[0]
    ref = torch_ops.attention(q.double(), k.double(), v.double(), dropout_p=0.3, rng=rng)[0]
    assert rel_err(out, ref) <= 1e-5
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    for g_, r in zip(grads, ref_grads):
        assert rel_err(g_, r) <= 1e-4


def test_dropout_seed_follows_torch_manual_seed():
    q, k, v = inputs(1, 8, 8, 2, 2, 8, torch.float32, "cpu")
    torch.manual_seed(3)
    a = fm.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = fm.attention(q, k, v, dropout_p=0.5)
    c = fm.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_torch(device):
    q, k, v = inputs(1, 6, 10, 2, 2, 16, torch.float32, device)
    require_supported(q, k)
    parts = [fm.attention(q, k[:, a:z], v[:, a:z], return_lse=True) for a, z in ((0, 3), (3, 10))]
    out, lse = fm.merge([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = fm.attention(q, k, v, return_lse=True)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5
    out64, lse64 = fm.merge([p[0].double() for p in parts], [p[1] for p in parts])
    assert rel_err(out64, ref_out) <= 1e-5 and rel_err(lse64, ref_lse) <= 1e-5


class Block(torch.nn.Module):
    """A pre-norm transformer block whose attention is flashmonoid.attention."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, c // self.heads).unbind(2)
        x = x + self.proj(fm.attention(q, k, v, causal=True).reshape(b, s, c))
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 16, 32, requires_grad=True)
    eager = block(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for p, g in zip(block.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_calls_skip_the_dispatcher_only_when_nothing_is_traced_or_differentiated(device):
    # The CUDA backend computes in fp16/bf16 only; fp32 runs on the CPU.
    q, k, v = inputs(2, 7, 9, 2, 1, 16, torch.float16 if device == "cuda" else torch.float32, device)
    plain = [x.detach() for x in (q, k, v)]
    assert torch_ops._eager(*plain, None)
    assert not torch_ops._eager(q, *plain[1:])  # autograd must record the op
    with torch.no_grad():
        assert torch_ops._eager(q, k, v)
    fake = torch._subclasses.fake_tensor.FakeTensorMode().from_tensor(plain[0])
    assert not torch_ops._eager(fake, *plain[1:])  # traced tensors go through the op's fake kernel
    # The direct call and the op compute the same bits.
    out, lse = torch_ops.attention(*plain, causal=True)
    ref_out, ref_lse = torch.ops.flashmonoid.fwd(*plain, 16 ** -0.5, True, -1, -1, 0.0, None, 0.0, None, False)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_differentiated_eager_calls_skip_the_dispatcher_with_the_ops_bits(device, varlen):
    # Calls autograd records run an autograd.Function over the ops' implementations (host time);
    # outputs and gradients must be the ops' own bits, and a double backward must still raise.
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v = inputs(2, 7, 9, 4, 2, 16, dtype, device, seed=3)
    assert torch_ops._plain(q, k, v) and not torch_ops._eager(q, k, v)
    fake = torch._subclasses.fake_tensor.FakeTensorMode().from_tensor(q.detach())
    assert not torch_ops._plain(fake, k, v)
    rng = torch.tensor([1234, 0], dtype=torch.int64)
    options = (16 ** -0.5, True, -1, -1, 4.0, None, 0.25, rng, False)
    if varlen:
        q, k, v = (x.detach().flatten(0, 1).requires_grad_() for x in (q, k, v))
        cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32, device=device) for n in (7, 9))
        out, lse = torch_ops.attention_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True, softcap=4.0, dropout_p=0.25,
                                              rng=rng)
        ref_out, ref_lse = torch.ops.flashmonoid.fwd_varlen(q, k, v, cu_q, cu_k, 7, 9, *options)
        node = "_EagerFwdVarlen"
    else:
        out, lse = torch_ops.attention(q, k, v, causal=True, softcap=4.0, dropout_p=0.25, rng=rng)
        ref_out, ref_lse = torch.ops.flashmonoid.fwd(q, k, v, *options)
        node = "_EagerFwd"
    assert any(node + "Backward" == type(f).__name__ for f, _ in out.grad_fn.next_functions)
    assert not lse.requires_grad
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
    out, _ = (torch_ops.attention_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True) if varlen else
              torch_ops.attention(q, k, v, causal=True))
    dq, = torch.autograd.grad(out, q, dout, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dq.sum().backward()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_and_saved_tensor_hooks_keep_the_gradients(reentrant):
    # transformers' gradient checkpointing reruns the forward in the backward (with dropout: the same
    # rng), and offloading hooks move the saved tensors: the gradients must be the plain call's bits.
    q, k, v = inputs(2, 9, 11, 4, 2, 16, torch.float32, "cpu", seed=5)
    rng = torch.tensor([99, 0], dtype=torch.int64)
    f = lambda q, k, v: torch_ops.attention(q * 1.5, k, v, causal=True, dropout_p=0.2, rng=rng)[0]  # noqa: E731
    f(q, k, v).square().sum().backward()
    ref = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.utils.checkpoint.checkpoint(f, q, k, v, use_reentrant=reentrant).square().sum().backward()
    assert all(torch.equal(x.grad, r) for x, r in zip((q, k, v), ref))
    with torch.autograd.graph.save_on_cpu():
        grads = torch.autograd.grad(f(q, k, v).square().sum(), (q, k, v))
    assert all(torch.equal(g, r) for g, r in zip(grads, ref))


def test_opcheck():
    q, k, v = (x.detach() for x in inputs(1, 5, 6, 2, 1, 8, torch.float32, "cpu"))
    args = (q, k, v, 8 ** -0.5, True, -1, -1, 0.0, None, 0.0, None, False)
    torch.library.opcheck(torch.ops.flashmonoid.fwd.default, args)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm80+) and a flashmonoid build with CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_follows_flash_attention_rule(dtype):
    q, k, v = inputs(2, 128, 160, 4, 2, 64, dtype, "cuda")
    require_supported(q, k, causal=True)
    out = fm.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = ref_attention(q, k, v, causal=True)
    low = ref_attention(q, k, v, causal=True, upcast=False)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    low_grads = torch.autograd.grad(low, (q, k, v), dout)
    assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + 1e-5
    for g_, r, lg in zip(grads, ref_grads, low_grads):
        assert (g_.double() - r).abs().max() <= 2 * (lg.double() - r).abs().max() + 1e-5


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm80+) and a flashmonoid build with CUDA")
def test_cuda_runs_on_the_current_stream():
    q, k, v = (x.detach() for x in inputs(2, 256, 256, 4, 4, 64, torch.float16, "cuda"))
    expected = fm.attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fm.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, expected)
