"""The NumPy / CPU path against the float64 NumPy reference. Needs no torch."""

import numpy as np
import pytest

import flashmonoid as fm
from flashmonoid import _philox

from reference import attention as ref_attention, rel_err

ALGORITHMS = ["flash", "reference"]


@pytest.fixture(params=ALGORITHMS)
def algorithm(request):
    before = fm.get_cpu_algorithm()
    fm.set_cpu_algorithm(request.param)
    yield request.param
    fm.set_cpu_algorithm(before)


def make(shape_q, shape_k, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k).astype(dtype)
    return q, k, v


CASES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 1)),
    dict(window=(2, -1), causal=False),
    dict(softcap=1.5),
    dict(softmax_scale=0.3, causal=True),
    dict(alibi=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("s_q,s_k", [(17, 17), (5, 23), (23, 5), (1, 9)])
def test_forward_fp32(algorithm, case, s_q, s_k):
    case = dict(case)
    q, k, v = make((2, s_q, 4, 16), (2, s_k, 2, 16))
    alibi = np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32) if case.pop("alibi", False) else None
    out, lse = fm.attention(q, k, v, alibi_slopes=alibi, return_lse=True, **case)
    ref_out, ref_lse = ref_attention(q, k, v, alibi_slopes=alibi, **case)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (2, 4, s_q)
    assert rel_err(out, ref_out) <= 1e-5
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert np.all(np.isneginf(lse[~finite]))
    if finite.any():
        assert rel_err(lse[finite], ref_lse[finite]) <= 1e-5


@pytest.mark.parametrize("case", [dict(causal=True), dict(window=(3, 0)), dict(softcap=1.5)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sinks(algorithm, case):
    """Attention sinks (one more score per head, value 0): out and lse against the float64 reference
    with the sink as one more softmax column; causal with s_q > s_k leaves rows without keys: out 0,
    lse = the sink."""
    q, k, v = make((2, 9, 4, 16), (2, 6, 2, 16))
    sinks = np.array([1.0, -0.5, 2.5, 0.0], dtype=np.float32)
    out, lse = fm.attention(q, k, v, return_lse=True, sinks=sinks, **case)
    ref_out, ref_lse = ref_attention(q, k, v, sinks=sinks, **case)
    assert out.dtype == np.float32 and lse.shape == (2, 4, 9)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5
    plain = fm.attention(q, k, v, **case)
    assert rel_err(plain, out) > 1e-3  # the sinks took weight
    with pytest.raises(ValueError, match=r"sinks: must have shape \(heads,\) = \(4,\), got \(3,\)"):
        fm.attention(q, k, v, sinks=sinks[:3], **case)


def test_varlen_sinks_match_per_sequence(algorithm):
    lens_q, lens_k = [5, 0, 7], [8, 3, 4]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((sum(lens_q), 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((sum(lens_k), 2, 16)).astype(np.float32) for _ in range(2))
    cu = lambda lens: np.array([0] + list(np.cumsum(lens)), dtype=np.int32)  # noqa: E731
    sinks = np.array([0.5, 1.5, -1.0, 3.0], dtype=np.float32)
    out, lse = fm.attention_varlen(q, k, v, cu(lens_q), cu(lens_k), 7, 8, causal=True, return_lse=True, sinks=sinks)
    for i in range(3):
        rq, rk = slice(cu(lens_q)[i], cu(lens_q)[i + 1]), slice(cu(lens_k)[i], cu(lens_k)[i + 1])
        if rq.stop == rq.start:
            continue
        ref_out, ref_lse = ref_attention(q[None, rq], k[None, rk], v[None, rk], causal=True, sinks=sinks)
        assert rel_err(out[rq], ref_out[0]) <= 1e-5 and rel_err(lse[:, rq], ref_lse[0]) <= 1e-5


def test_fully_masked_rows_are_zero_with_lse_minus_inf(algorithm):
    q, k, v = make((1, 6, 2, 8), (1, 3, 2, 8))
    out, lse = fm.attention(q, k, v, causal=True, return_lse=True)  # rows 0..2 see no key
    assert np.all(out[:, :3] == 0)
    assert np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))


def test_forward_fp16(algorithm):
    q, k, v = make((2, 33, 2, 32), (2, 40, 2, 32), np.float16)
    out = fm.attention(q, k, v, causal=True)
    ref_out, _ = ref_attention(q, k, v, causal=True)
    assert out.dtype == np.float16
    assert rel_err(out, ref_out) <= 2e-3


def test_non_contiguous_views(algorithm):
    q, k, v = make((2, 4, 9, 16), (2, 4, 11, 16))  # (b, h, s, d): SDPA's layout
    qt, kt, vt = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    assert not qt.flags.c_contiguous
    out = fm.attention(qt, kt, vt)
    assert rel_err(out, ref_attention(qt, kt, vt)[0]) <= 1e-5


def test_read_only_inputs(algorithm):
    q, k, v = make((1, 4, 1, 8), (1, 4, 1, 8))
    for x in (q, k, v):
        x.flags.writeable = False
    assert rel_err(fm.attention(q, k, v), ref_attention(q, k, v)[0]) <= 1e-5


def test_varlen_matches_per_sequence(algorithm):
    lens_q, lens_k = [3, 0, 7, 5], [4, 6, 2, 9]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = make((cu_q[-1], 4, 16), (cu_k[-1], 2, 16))
    out, lse = fm.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)
    assert lse.shape == (4, cu_q[-1])
    for b in range(4):
        if lens_q[b] == 0:
            continue
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ro, rl = ref_attention(q[None, sq], k[None, sk], v[None, sk], causal=True)
        assert rel_err(out[sq], ro[0]) <= 1e-5
        np.testing.assert_allclose(lse[:, sq], rl[0], rtol=1e-5, atol=1e-6)


def test_varlen_used_lengths_run_padded_slots_in_place(algorithm):
    # seqused_q / seqused_k: the first rows of each slot, as the same rows packed give them, bit for
    # bit; the other rows 0 (out, gradients) and -inf (lse).
    s_q, s_k, used_q, used_k = 9, 11, [5, 0, 9], [7, 3, 0]
    q, k, v = make((3 * s_q, 4, 16), (3 * s_k, 2, 16))
    i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    slots = (i32([0, s_q, 2 * s_q, 3 * s_q]), i32([0, s_k, 2 * s_k, 3 * s_k]), 9, 7)
    used = dict(seqused_q=i32(used_q), seqused_k=i32(used_k))
    out, lse = fm.attention_varlen(q, k, v, *slots, causal=True, return_lse=True, **used)
    rq = [r for b, n in enumerate(used_q) for r in range(b * s_q, b * s_q + n)]
    rk = [r for b, n in enumerate(used_k) for r in range(b * s_k, b * s_k + n)]
    packed = (i32(np.cumsum([0] + used_q)), i32(np.cumsum([0] + used_k)), 9, 7)
    po, pl = fm.attention_varlen(q[rq], k[rk], v[rk], *packed, causal=True, return_lse=True)
    assert np.array_equal(out[rq], po) and np.array_equal(lse[:, rq], pl)
    assert (np.delete(out, rq, 0) == 0).all() and np.isneginf(np.delete(lse, rq, 1)).all()
    dout = make((3 * s_q, 4, 16), (1, 1, 16), seed=1)[0]
    grads = fm.attention_varlen_backward(dout, q, k, v, *slots, out, lse, causal=True, **used)
    packed_grads = fm.attention_varlen_backward(dout[rq], q[rq], k[rk], v[rk], *packed, po, pl, causal=True)
    for g, pg, rows in zip(grads, packed_grads, (rq, rk, rk)):
        assert np.array_equal(g[rows], pg) and (np.delete(g, rows, 0) == 0).all()


def numeric_grad(f, x, eps=1e-3):
    g = np.zeros_like(x, dtype=np.float64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        hi = f()
        x[i] = old - eps
        lo = f()
        x[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(softcap=2.0, window=(2, 1))])
def test_backward_against_finite_differences(algorithm, case):
    q, k, v = make((1, 5, 2, 8), (1, 6, 1, 8))
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    dout = np.random.default_rng(1).standard_normal(q.shape)
    loss = lambda: float((ref_attention(q, k, v, **case)[0] * dout).sum())
    out, lse = fm.attention(*(x.astype(np.float32) for x in (q, k, v)), return_lse=True, **case)
    dq, dk, dv = fm.attention_backward(dout.astype(np.float32), *(x.astype(np.float32) for x in (q, k, v)), out,
                                       lse, **case)
    for got, x in ((dq, q), (dk, k), (dv, v)):
        assert got.shape == x.shape
        assert rel_err(got, numeric_grad(loss, x)) <= 1e-4


def test_dropout_uses_the_documented_philox_mask(algorithm):
    q, k, v = make((2, 7, 2, 8), (2, 9, 2, 8))
    p, seed, offset = 0.3, 1234, 5
    out = fm.attention(q, k, v, dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    b, s_q, h = 2, 7, 2
    rows = np.array([[[hd * b * s_q + bi * s_q + i for i in range(s_q)] for hd in range(h)] for bi in range(b)])
    keep = _philox.keep_mask(seed, offset, p, rows.reshape(-1), 9).reshape(b, h, s_q, 9)
    assert 0.5 < keep.mean() < 0.9
    ref_out, _ = ref_attention(q, k, v, keep=keep, dropout_p=p)
    assert rel_err(out, ref_out) <= 1e-5


def test_merge_of_disjoint_key_sets(algorithm):
    q, k, v = make((1, 5, 2, 8), (1, 12, 2, 8))
    parts = [fm.attention(q, k[:, a:z], v[:, a:z], return_lse=True) for a, z in ((0, 4), (4, 12))]
    out, lse = fm.merge([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = ref_attention(q, k, v)
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(lse, ref_lse) <= 1e-5


def test_supports_and_cuda_available():
    q, k, _ = make((1, 4, 2, 8), (1, 4, 2, 8))
    assert fm.supports(q, k) == (True, "")
    assert isinstance(fm.cuda_available(), bool)


# Invalid input: ValueError whose message names the argument.
@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q, k.astype(np.float16), v), "k: dtype"),
    (lambda q, k, v: (q, k, v[:, :3]), "v: shape"),
    (lambda q, k, v: (q, k[:, :, :, :4], v), "k"),
    (lambda q, k, v: (q[0], k, v), "q: must have 4 dimensions"),
    (lambda q, k, v: (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), "q: dtype"),
])
def test_invalid_input_messages(mutate, match):
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 8))
    with pytest.raises(ValueError, match=match) as info:
        fm.attention(*mutate(q, k, v))
    assert str(info.value).startswith("flashmonoid: ")


def test_invalid_option_messages():
    q, k, v = make((1, 4, 4, 8), (1, 4, 2, 8))
    with pytest.raises(ValueError, match="dropout"):
        fm.attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="alibi_slopes"):
        fm.attention(q, k, v, alibi_slopes=np.ones(3, dtype=np.float32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fm.attention_varlen(q[0], k[0], v[0], np.array([0, 4], dtype=np.int64), np.array([0, 4], dtype=np.int32), 4, 4)
    with pytest.raises(TypeError, match="expected a NumPy array"):
        fm.attention([[1.0]], k, v)


def test_not_supported_error_is_both_not_implemented_and_value_error():
    assert issubclass(fm.NotSupportedError, NotImplementedError)
    assert issubclass(fm.NotSupportedError, ValueError)


def test_cpu_isa_choice():
    """set_cpu_isa("avx2") reaches the C++ Context; both ISAs agree with the float64 reference, and an
    unknown name is refused."""
    q, k, v = make((1, 300, 4, 40), (1, 333, 2, 40), seed=3)
    ref_out, _ = ref_attention(q, k, v, causal=True)
    before = fm.get_cpu_isa()
    try:
        outs = {}
        for isa in ("best", "avx2"):
            fm.set_cpu_isa(isa)
            assert fm.get_cpu_isa() == isa
            outs[isa] = fm.attention(q, k, v, causal=True)
            assert rel_err(outs[isa], ref_out) <= 1e-5
        with pytest.raises(KeyError):
            fm.set_cpu_isa("sse2")
    finally:
        fm.set_cpu_isa(before)
