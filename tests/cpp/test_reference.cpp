// The oracle itself: its backward against finite differences; the merge monoid (associativity,
// identity); extreme scores; fully masked rows.
#include <algorithm>
#include <array>
#include <cmath>
#include <functional>

#include "attention_case.hpp"
#include "flashmonoid/detail/mask.hpp"
#include "flashmonoid/detail/monoid.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace fmtest {
namespace {

using flashmonoid::Context;
using flashmonoid::CpuAlgorithm;
using flashmonoid::cpu::Precision;

// L = sum(dout ∘ out), evaluated by the reference forward in float64 (stored as fp32).
double loss(const Problem& pb) {
  auto [o, l] = pb.reference(Precision::f64);
  auto ov = o.values();
  auto dv = pb.dout.values();
  double s = 0.0;
  for (std::size_t i = 0; i < ov.size(); ++i) s += ov[i] * dv[i];
  return s;
}

// The block ranges the kernels derive from detail::Band (the forward's key_begin/key_end, the
// backward's transpose query_begin/query_end) against Band::visible element by element.
TEST(Band, BlockRangesMatchVisibility) {
  for (int s_q : {1, 5, 17})
    for (int s_k : {1, 7, 17})
      for (int left : {-1, 0, 3})
        for (int right : {-1, 0, 2}) {
          const flashmonoid::detail::Band band{static_cast<std::int64_t>(s_k) - s_q, left, right};
          for (int i = 0; i < s_q; ++i) {
            int first = s_k, end = 0;
            for (int j = 0; j < s_k; ++j)
              if (band.visible(i, j)) first = std::min(first, j), end = j + 1;
            if (end > 0) {
              EXPECT_EQ(band.key_begin(i, s_k), first);
              EXPECT_EQ(band.key_end(i + 1, s_k), end);
            }
          }
          for (int kb = 0; kb < s_k; ++kb)
            for (int ke = kb + 1; ke <= s_k; ++ke) {
              int first = s_q, end = 0;
              for (int i = 0; i < s_q; ++i)
                for (int j = kb; j < ke; ++j)
                  if (band.visible(i, j)) first = std::min(first, i), end = i + 1;
              const std::int64_t qb = band.query_begin(kb), qe = band.query_end(ke, s_q);
              if (end == 0) {
                EXPECT_LE(qe, qb) << "keys [" << kb << ", " << ke << ")";
              } else {
                EXPECT_EQ(qb, first) << "keys [" << kb << ", " << ke << ")";
                EXPECT_EQ(qe, end) << "keys [" << kb << ", " << ke << ")";
              }
            }
        }
}

TEST(ReferenceBackward, MatchesFiniteDifferences) {
  for (int variant = 0; variant < 3; ++variant) {
    Shape s;
    s.b = 1;
    s.s_q = 3;
    s.s_k = 4;
    s.h = 2;
    s.h_k = 1;
    s.d = 5;
    s.padded_strides = false;
    s.causal = variant == 1;
    s.softcap = variant == 2 ? 1.5f : 0.0f;
    s.alibi = variant == 2;
    Problem pb(s);
    auto [o, l] = pb.reference(Precision::f64);
    auto g = pb.reference_backward(o, l, Precision::f64);
    const double h = 1e-2;
    auto check = [&](HostTensor& x, const HostTensor& grad, const char* name) {
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        const float x0 = x.get(i);
        x.set(i, x0 + static_cast<float>(h));
        const double up = loss(pb);
        x.set(i, x0 - static_cast<float>(h));
        const double down = loss(pb);
        x.set(i, x0);
        const double fd = (up - down) / (2 * h);
        // Central differences: O(h^2) truncation plus fp32 output rounding over 2h.
        EXPECT_NEAR(grad.get(i), fd, 2e-3 * std::max(1.0, std::abs(fd))) << name << "[" << i << "] variant " << variant;
      }
    };
    check(pb.q, g.dq, "dq");
    check(pb.k, g.dk, "dk");
    check(pb.v, g.dv, "dv");
  }
}

// Attention over keys [begin, end) of pb, unmasked: the pieces that merge must reassemble.
std::pair<HostTensor, HostTensor> forward_on_keys(const Problem& pb, int begin, int end) {
  const Shape& s = pb.shape;
  const std::int64_t row = pb.k.view.stride[1];
  TensorView k = pb.k.view, v = pb.v.view;
  k.shape[1] = v.shape[1] = end - begin;
  k.data = static_cast<std::uint8_t*>(k.data) + begin * row * flashmonoid::dtype_size(s.dtype);
  v.data = static_cast<std::uint8_t*>(v.data) + begin * row * flashmonoid::dtype_size(s.dtype);
  HostTensor o(DType::f32, {s.b, s.s_q, s.h, s.d}), l(DType::f32, {s.b, s.h, s.s_q});
  o.poison();
  l.poison();
  Context ctx;
  ctx.cpu_algorithm = CpuAlgorithm::reference;
  HostTensor q32(DType::f32, {s.b, s.s_q, s.h, s.d});
  for (std::int64_t i = 0; i < q32.numel(); ++i) q32.set(i, pb.q.get(i));
  flashmonoid::forward(q32.view, k, v, o.view, l.view, pb.opt, ctx);
  return {std::move(o), std::move(l)};
}

TEST(Merge, RandomSplitsAndBracketingsEqualTheWhole) {
  Shape s;
  s.b = 2;
  s.s_q = 9;
  s.s_k = 57;
  s.h = 3;
  s.h_k = 3;
  s.d = 16;
  s.padded_strides = true;
  for (int trial = 0; trial < 10; ++trial) {
    Problem pb(s);
    auto whole = forward_on_keys(pb, 0, s.s_k);
    // Random cut points, empty chunks allowed (their state is the identity: out 0, lse -inf).
    std::uniform_int_distribution<int> cut(0, s.s_k);
    std::vector<int> cuts{0, s.s_k};
    for (int i = 0; i < 4; ++i) cuts.push_back(cut(rng()));
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::pair<HostTensor, HostTensor>> parts;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) parts.push_back(forward_on_keys(pb, cuts[i], cuts[i + 1]));
    // Random bracketing: repeatedly merge a random adjacent pair (or a random run of up to 3).
    while (parts.size() > 1) {
      std::uniform_int_distribution<std::size_t> pick(0, parts.size() - 2);
      const std::size_t i = pick(rng());
      const std::size_t n = std::min<std::size_t>(parts.size() - i, 2 + (rng()() % 2));
      std::vector<TensorView> outs, lses;
      for (std::size_t j = i; j < i + n; ++j) {
        outs.push_back(parts[j].first.view);
        lses.push_back(parts[j].second.view);
      }
      HostTensor o(DType::f32, {s.b, s.s_q, s.h, s.d}), l(DType::f32, {s.b, s.h, s.s_q});
      o.poison();
      l.poison();
      flashmonoid::merge(outs, lses, o.view, l.view);
      parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(i), parts.begin() + static_cast<std::ptrdiff_t>(i + n));
      parts.insert(parts.begin() + static_cast<std::ptrdiff_t>(i), {std::move(o), std::move(l)});
    }
    const double scale = max_abs(whole.first.values());
    EXPECT_LE(max_abs_diff(parts[0].first.values(), whole.first.values()), 1e-6 * std::max(1.0, scale));
    EXPECT_LE(max_abs_diff(parts[0].second.values(), whole.second.values()), 1e-6 * std::max(1.0, max_abs(whole.second.values())));
  }
}

// Attention sinks (one more score per query head with value 0, as gpt-oss's) are the merge of the
// result with the part (out 0, lse = the head's sink), the README's recipe for engines: against
// attention over one more key, first, whose score is the sink for every query (an extra feature: 1 in
// q, sink / scale in that key, 0 in the others) and whose value is 0. Plain and causal (s_k >= s_q:
// the first key is then visible to every row, as a sink is).
TEST(Merge, AttentionSinksAreAMergeWithAZeroPart) {
  const int b = 2, s_q = 5, s_k = 9, h = 3, d = 8;
  const std::array<float, 3> sinks{1.5f, -0.5f, 3.0f};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostTensor q(DType::f32, {b, s_q, h, d}), k(DType::f32, {b, s_k, h, d}), v(DType::f32, {b, s_k, h, d});
  HostTensor qa(DType::f32, {b, s_q, h, d + 1}), ka(DType::f32, {b, s_k + 1, h, d + 1});
  HostTensor va(DType::f32, {b, s_k + 1, h, d + 1});
  for (HostTensor* t : {&q, &k, &v})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, normal(rng()));
  for (HostTensor* t : {&qa, &ka, &va})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 0.0f);
  // Element c of row r, head hh, batch e of a (b, rows, h, width) tensor.
  auto at = [&](int e, int r, int rows, int hh, int width, int c) {
    return ((static_cast<std::int64_t>(e) * rows + r) * h + hh) * width + c;
  };
  for (int e = 0; e < b; ++e)
    for (int hh = 0; hh < h; ++hh) {
      for (int i = 0; i < s_q; ++i) {
        for (int c = 0; c < d; ++c) qa.set(at(e, i, s_q, hh, d + 1, c), q.get(at(e, i, s_q, hh, d, c)));
        qa.set(at(e, i, s_q, hh, d + 1, d), 1.0f);
      }
      ka.set(at(e, 0, s_k + 1, hh, d + 1, d), sinks[hh] / scale);  // key 0: the sink, value 0
      for (int j = 0; j < s_k; ++j)
        for (int c = 0; c < d; ++c) {
          ka.set(at(e, j + 1, s_k + 1, hh, d + 1, c), k.get(at(e, j, s_k, hh, d, c)));
          va.set(at(e, j + 1, s_k + 1, hh, d + 1, c), v.get(at(e, j, s_k, hh, d, c)));
        }
    }
  Context ctx;
  ctx.cpu_algorithm = CpuAlgorithm::reference;
  for (bool causal : {false, true}) {
    flashmonoid::Options opt;
    opt.softmax_scale = scale;
    opt.causal = causal;
    HostTensor o(DType::f32, {b, s_q, h, d}), l(DType::f32, {b, h, s_q});
    HostTensor oa(DType::f32, {b, s_q, h, d + 1}), la(DType::f32, {b, h, s_q});
    flashmonoid::forward(q.view, k.view, v.view, o.view, l.view, opt, ctx);
    flashmonoid::forward(qa.view, ka.view, va.view, oa.view, la.view, opt, ctx);
    HostTensor zero(DType::f32, {b, s_q, h, d}), sink(DType::f32, {b, h, s_q});
    for (std::int64_t i = 0; i < zero.numel(); ++i) zero.set(i, 0.0f);
    for (std::int64_t i = 0; i < sink.numel(); ++i) sink.set(i, sinks[(i / s_q) % h]);
    HostTensor om(DType::f32, {b, s_q, h, d}), lm(DType::f32, {b, h, s_q});
    om.poison();
    lm.poison();
    std::vector<TensorView> outs{o.view, zero.view}, lses{l.view, sink.view};
    flashmonoid::merge(outs, lses, om.view, lm.view);
    std::vector<double> want;
    for (std::int64_t i = 0; i < oa.numel(); ++i)
      if (i % (d + 1) != d) want.push_back(oa.get(i));
    SCOPED_TRACE(causal ? "causal" : "plain");
    EXPECT_LE(max_abs_diff(om.values(), want), 1e-6 * std::max(1.0, max_abs(want)));
    EXPECT_LE(max_abs_diff(lm.values(), la.values()), 1e-6 * std::max(1.0, max_abs(la.values())));
    EXPECT_GT(max_abs_diff(om.values(), o.values()), 1e-3);  // the sinks took weight
  }
}

TEST(Merge, IdentityChangesNothing) {
  Shape s;
  s.b = 1;
  s.s_q = 7;
  s.s_k = 20;
  s.h = 2;
  s.h_k = 2;
  s.d = 8;
  Problem pb(s);
  auto a = forward_on_keys(pb, 0, s.s_k);
  HostTensor id_o(DType::f32, {s.b, s.s_q, s.h, s.d}), id_l(DType::f32, {s.b, s.h, s.s_q});
  id_o.poison();  // the identity's output is never read: lse = -inf gives it weight 0
  for (std::int64_t i = 0; i < id_l.numel(); ++i) id_l.set(i, -INFINITY);
  for (int order = 0; order < 2; ++order) {
    HostTensor o(DType::f32, {s.b, s.s_q, s.h, s.d}), l(DType::f32, {s.b, s.h, s.s_q});
    std::vector<TensorView> outs{a.first.view, id_o.view}, lses{a.second.view, id_l.view};
    if (order) {
      std::swap(outs[0], outs[1]);
      std::swap(lses[0], lses[1]);
    }
    flashmonoid::merge(outs, lses, o.view, l.view);
    EXPECT_EQ(o.values(), a.first.values());
    EXPECT_EQ(l.values(), a.second.values());
  }
}

// The split-KV combine merges all of a row's parts at once (common/combine.cuh): weights
// exp(lse_j - m) from the largest lse m, their sum s, lse = m + ln s (detail::lse_of_sum). It and the
// fold of detail::merge_lse, part by part, against the same merge in float64: random lse of scale 1
// and 1e4, empty parts (-inf, the identity) among them, and every part empty. The at-once form
// rounds each weight's exponent once, so it holds 1e-5 (out) and 1e-6 relative (lse) at either
// scale. The fold rounds its running lse at every merge, by up to half an ulp of its magnitude, and
// each rounding moves that lse and scales the running output by up to that much: its bounds add
// those half-ulps (at lse ~ 1e4 an ulp is ~1e-3, and close top parts then differ from float64 by
// ~1e-4, seen once in CI).
TEST(Merge, AllPartsAtOnceEqualTheFold) {
  namespace d = flashmonoid::detail;
  constexpr int kCols = 8;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    const int parts = 1 + trial % 40;
    const float spread = trial % 2 ? 1e4f : 1.0f;
    const bool all_empty = trial % 50 == 7;
    std::vector<float> lse(parts);
    std::vector<std::array<float, kCols>> out(parts);
    for (int j = 0; j < parts; ++j) {
      lse[j] = all_empty || rng()() % 5 == 0 ? -INFINITY : spread * u(rng());
      for (float& x : out[j]) x = u(rng());
    }
    float fold_lse = -INFINITY;
    std::array<float, kCols> fold{};
    double fold_rounding = 0.0;  // the half-ulps of the running lse's roundings
    for (int j = 0; j < parts; ++j) {
      float wa, wb;
      fold_lse = d::merge_lse(fold_lse, lse[j], &wa, &wb);
      for (int c = 0; c < kCols; ++c) fold[c] = fold[c] * wa + out[j][c] * wb;
      if (std::isfinite(fold_lse))
        fold_rounding += 0.5 * (std::nextafter(std::fabs(fold_lse), INFINITY) - std::fabs(fold_lse));
    }
    float m = -INFINITY, sum = 0.0f;
    for (float l : lse) m = std::max(m, l);
    std::array<float, kCols> acc{};
    for (int j = 0; j < parts; ++j) {
      const float w = d::rescale_factor(lse[j], m);
      sum += w;
      for (int c = 0; c < kCols; ++c) acc[c] += out[j][c] * w;
    }
    const float at_once = d::lse_of_sum(m, sum);
    const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;  // as the combine's store: 0 for an empty row
    SCOPED_TRACE("trial " + std::to_string(trial) + ", " + std::to_string(parts) + " parts");
    if (m == -INFINITY) {  // every part empty (also by chance): the identity, out 0
      EXPECT_EQ(fold_lse, -INFINITY);
      EXPECT_EQ(at_once, -INFINITY);
      for (int c = 0; c < kCols; ++c) EXPECT_EQ(acc[c] * inv_sum, 0.0f);
      continue;
    }
    // The same merge in float64 from the same fp32 inputs.
    double sum64 = 0.0;
    std::array<double, kCols> acc64{};
    for (int j = 0; j < parts; ++j) {
      const double w = lse[j] == -INFINITY ? 0.0 : std::exp(static_cast<double>(lse[j]) - m);
      sum64 += w;
      for (int c = 0; c < kCols; ++c) acc64[c] += out[j][c] * w;
    }
    const double lse64 = m + std::log(sum64);
    const double lse_tol = 1e-6 * std::max(1.0, std::fabs(lse64));
    EXPECT_NEAR(at_once, lse64, lse_tol);
    EXPECT_NEAR(fold_lse, lse64, lse_tol + fold_rounding);
    for (int c = 0; c < kCols; ++c) {
      EXPECT_NEAR(acc[c] * inv_sum, acc64[c] / sum64, 1e-5);
      EXPECT_NEAR(fold[c], acc64[c] / sum64, 1e-5 + fold_rounding);
    }
  }
}

TEST(Numerics, HugeScoresStayFiniteAndExact) {
  Shape s;
  s.b = 1;
  s.s_q = 33;
  s.s_k = 70;
  s.h = 2;
  s.h_k = 2;
  s.d = 32;
  Problem pb(s);
  // Scores of magnitude ~1e4: scale·q·k with |q·k| up to ~1e4·sqrt(d).
  pb.opt.softmax_scale = 1.0f;
  for (std::int64_t i = 0; i < pb.q.numel(); ++i) pb.q.set(i, pb.q.get(i) * 30.0f);
  for (std::int64_t i = 0; i < pb.k.numel(); ++i) pb.k.set(i, pb.k.get(i) * 60.0f);
  auto [o, l] = pb.forward(Context{});
  auto [ro, rl] = pb.reference(Precision::f64);
  auto [fo, fl] = pb.reference(Precision::input);  // standard attention done in fp32
  EXPECT_GT(max_abs(rl.values()), 5e3);
  for (double x : o.values()) ASSERT_TRUE(std::isfinite(x));
  // A score near 1e4 carries only ~1e-3 absolute precision in fp32 (ulp 2^-10), and exp turns that
  // into ~1e-3 relative error of P: no fp32 implementation meets 1e-5 against float64 here. The
  // FlashAttention rule applies instead: at most 2x the error of the same math done in fp32.
  const double scale = std::max(max_abs(ro.values()), 1.0);
  EXPECT_LE(max_abs_diff(o.values(), ro.values()), 2.0 * max_abs_diff(fo.values(), ro.values()) + 1e-5 * scale);
  EXPECT_LE(max_abs_diff(l.values(), rl.values()), 1e-6 * max_abs(rl.values()));
  auto g = pb.backward(o, l, Context{});
  for (auto* t : {&g.dq, &g.dk, &g.dv})
    for (double x : t->values()) ASSERT_TRUE(std::isfinite(x));
}

TEST(Numerics, FullyMaskedRowsAreZeroWithoutNaN) {
  for (int algo = 0; algo < 2; ++algo) {
    Shape s;
    s.b = 2;
    s.s_q = 40;
    s.s_k = 16;  // causal, bottom-right: rows 0..23 see no key
    s.h = 2;
    s.h_k = 1;
    s.d = 24;
    s.causal = true;
    Problem pb(s);
    Context ctx;
    ctx.cpu_algorithm = algo ? CpuAlgorithm::reference : CpuAlgorithm::flash;
    auto [o, l] = pb.forward(ctx);
    auto g = pb.backward(o, l, ctx);
    for (int b = 0; b < s.b; ++b)
      for (int i = 0; i < s.s_q; ++i)
        for (int hq = 0; hq < s.h; ++hq) {
          const bool empty = i < s.s_q - s.s_k;
          const float lse = l.get((static_cast<std::int64_t>(b) * s.h + hq) * s.s_q + i);
          if (empty) {
            EXPECT_EQ(lse, -INFINITY);
          } else {
            EXPECT_TRUE(std::isfinite(lse));
          }
          for (int c = 0; c < s.d; ++c) {
            const std::int64_t idx = ((static_cast<std::int64_t>(b) * s.s_q + i) * s.h + hq) * s.d + c;
            if (empty) {
              EXPECT_EQ(o.get(idx), 0.0f);
              EXPECT_EQ(g.dq.get(idx), 0.0f);
            }
            EXPECT_FALSE(std::isnan(o.get(idx)));
            EXPECT_FALSE(std::isnan(g.dq.get(idx)));
          }
        }
    for (auto* t : {&g.dk, &g.dv})
      for (double x : t->values()) EXPECT_FALSE(std::isnan(x));
  }
}

TEST(Dropout, KeepRateAndDeterminism) {
  // The keep-mask is a pure function of (seed, offset, row, column) with P(keep) = 1 - p.
  const float p = 0.3f;
  const std::uint32_t t = flashmonoid::detail::dropout_threshold(p);
  int kept = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) kept += flashmonoid::detail::dropout_keep(42, 7, t, static_cast<std::uint32_t>(i / 1000), i % 1000);
  EXPECT_NEAR(kept / static_cast<double>(n), 1.0 - p, 0.005);
  EXPECT_EQ(flashmonoid::detail::dropout_keep(1, 2, t, 3, 4), flashmonoid::detail::dropout_keep(1, 2, t, 3, 4));
  // Philox-4x32-10 known-answer test (Random123 kat_vectors: zero counter and key).
  auto r = flashmonoid::detail::philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.x[0], 0x6627e8d5u);
  EXPECT_EQ(r.x[1], 0xe169c58du);
  EXPECT_EQ(r.x[2], 0xbc57ac4cu);
  EXPECT_EQ(r.x[3], 0x9b00dbd8u);
  auto pi = flashmonoid::detail::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(pi.x[0], 0xd16cfe09u);
  EXPECT_EQ(pi.x[1], 0x94fdccebu);
  EXPECT_EQ(pi.x[2], 0x5001e420u);
  EXPECT_EQ(pi.x[3], 0x24126ea1u);
}

}  // namespace
}  // namespace fmtest
