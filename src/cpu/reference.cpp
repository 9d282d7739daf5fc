// The reference: standard attention, S = scale·QKᵀ materialised for one (batch, head) at a time,
// masked, softmaxed, O = PV; and its backward. Plain loops in float64, deliberately unoptimised:
// it is the oracle of every test and the "standard attention" of the benchmarks, so it must stay
// obviously right. With Precision::input it instead rounds what a framework doing the same math
// in the input dtype would round (the products' inputs, S, P, dP, dS and the outputs; fp32
// accumulation; the backward's D = rowsum(dO∘O) from the given output, as FlashAttention takes it),
// which sets the FlashAttention error budget.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/numeric.hpp"
#include "flashmonoid/detail/mask.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace flashmonoid::cpu {
namespace {

using detail::BwdParams;
using detail::FwdParams;
using detail::SeqInfo;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Rounding applied to intermediate values: none for the oracle, the input dtype otherwise.
struct Rounder {
  bool active;
  DType dtype;
  double operator()(double x) const { return active ? round_to(dtype, static_cast<float>(x)) : x; }
  // An fp32 accumulator when emulating, float64 otherwise.
  double acc(double x) const { return active ? static_cast<double>(static_cast<float>(x)) : x; }
  // sum_c a(c)·b(c): float64, or a plain fp32 running sum (a naive fp32 matrix product) when emulating.
  template <class A, class B> double dot(int n, A&& a, B&& b) const {
    if (active) {
      float sum = 0.0f;
      for (int c = 0; c < n; ++c) sum += a(c) * b(c);
      return sum;
    }
    double sum = 0.0;
    for (int c = 0; c < n; ++c) sum += static_cast<double>(a(c)) * b(c);
    return sum;
  }
};

// The scores, probabilities and keep-mask of one (batch, head): everything backward needs.
struct HeadForward {
  int len_q = 0, len_k = 0;
  std::vector<double> raw;   // (len_q, len_k) scale·q·k before softcap (for its derivative)
  std::vector<double> prob;  // (len_q, len_k) softmax, 0 where masked
  std::vector<double> keep;  // (len_q, len_k) dropout factor: 0 or 1/(1-p); 1 without dropout
  std::vector<double> lse;   // (len_q)
};

HeadForward head_forward(const FwdParams& p, int b, int hq, const SeqInfo& si, const Rounder& rnd) {
  HeadForward f;
  f.len_q = si.len_q;
  f.len_k = si.len_k;
  const int hk = hq / p.group();
  const detail::Band band = detail::band_of(p, si);
  const float slope = detail::alibi_slope(p, b, hq);
  const std::size_t n = static_cast<std::size_t>(si.len_q) * si.len_k;
  f.raw.assign(n, 0.0);
  f.prob.assign(n, 0.0);
  f.keep.assign(n, 1.0);
  f.lse.assign(si.len_q, kNegInf);
  std::vector<double> s(si.len_k);
  for (int i = 0; i < si.len_q; ++i) {
    const std::int64_t qo = detail::offset_of(p.q_stride, b, si.q_row0 + i, hq);
    double mx = kNegInf;
    for (int j = 0; j < si.len_k; ++j) {
      const std::int64_t ko = detail::kv_offset(p, p.k_stride, b, si.k_row0 + j, hk);
      double x = rnd(rnd.dot(p.d, [&](int c) { return load(p.q, p.dtype, qo + c); },
                             [&](int c) { return load(p.k, p.dtype, ko + c); }) *
                     p.scale);
      f.raw[static_cast<std::size_t>(i) * si.len_k + j] = x;
      if (p.softcap > 0.0f) x = rnd(p.softcap * std::tanh(x / p.softcap));
      if (p.alibi) x = rnd(x + detail::alibi_bias(slope, i, j, band.diag));
      if (!band.visible(i, j)) x = kNegInf;
      s[j] = x;
      mx = std::max(mx, x);
    }
    if (mx == kNegInf) continue;  // no visible key: P = 0, out = 0, lse = -inf
    double sum = 0.0;
    for (int j = 0; j < si.len_k; ++j) sum += std::exp(s[j] - mx);
    f.lse[i] = mx + std::log(sum);
    const std::uint32_t row_id = detail::dropout_row_id(p, hq, si, i);
    for (int j = 0; j < si.len_k; ++j) {
      const std::size_t ij = static_cast<std::size_t>(i) * si.len_k + j;
      f.prob[ij] = rnd(std::exp(s[j] - mx) / sum);
      if (p.dropout_p > 0.0f)
        f.keep[ij] = detail::dropout_keep(p.seed, p.offset, p.dropout_threshold, row_id, static_cast<std::uint32_t>(j))
                         ? 1.0 / (1.0 - static_cast<double>(p.dropout_p))
                         : 0.0;
    }
  }
  return f;
}

template <class Fn> void for_each_head(const FwdParams& p, Fn&& fn) {
  const int pairs = p.batch * p.h;
#pragma omp parallel for schedule(dynamic)
  for (int bh = 0; bh < pairs; ++bh) fn(bh / p.h, bh % p.h, detail::seq_info(p, bh / p.h));
}

}  // namespace

void reference_forward(const FwdParams& p, Precision prec) {
  const Rounder rnd{prec == Precision::input, p.dtype};
  for_each_head(p, [&](int b, int hq, const SeqInfo& si) {
    const HeadForward f = head_forward(p, b, hq, si, rnd);
    const int hk = hq / p.group();
    for (int i = 0; i < si.len_q; ++i) {
      const std::int64_t oo = detail::offset_of(p.o_stride, b, si.q_row0 + i, hq);
      for (int c = 0; c < p.d; ++c) {
        double acc = 0.0;
        for (int j = 0; j < si.len_k; ++j) {
          const std::size_t ij = static_cast<std::size_t>(i) * si.len_k + j;
          const double pij = rnd(f.prob[ij] * f.keep[ij]);
          acc += pij * load(p.v, p.dtype, detail::kv_offset(p, p.v_stride, b, si.k_row0 + j, hk) + c);
        }
        store(p.out, p.dtype, oo + c, static_cast<float>(acc));
      }
      p.lse[detail::lse_index(p, b, hq, si, i)] = static_cast<float>(f.lse[i]);
    }
  });
}

// dV = (P∘keep)ᵀ dO;  dP = dO Vᵀ ∘ keep;  dS = P∘(dP − rowsum(P∘dP));  through softcap dS ·= 1 − tanh²;
// dQ = scale·dS K;  dK = scale·dSᵀ Q. dK and dV are summed over the query heads of a KV group, so
// the loop runs over (batch, KV head) and visits the group's query heads in order.
void reference_backward(const BwdParams& p, Precision prec) {
  const Rounder rnd{prec == Precision::input, p.dtype};
  const int pairs = p.batch * p.h_k;
#pragma omp parallel for schedule(dynamic)
  for (int bk = 0; bk < pairs; ++bk) {
    const int b = bk / p.h_k, hk = bk % p.h_k;
    const SeqInfo si = detail::seq_info(p, b);
    const std::size_t kd = static_cast<std::size_t>(si.len_k) * p.d;
    std::vector<double> dk(kd, 0.0), dv(kd, 0.0);
    for (int g = 0; g < p.group(); ++g) {
      const int hq = hk * p.group() + g;
      const HeadForward f = head_forward(p, b, hq, si, rnd);
      auto qv = [&](int i, int c) { return static_cast<double>(load(p.q, p.dtype, detail::offset_of(p.q_stride, b, si.q_row0 + i, hq) + c)); };
      auto kv = [&](int j, int c) { return static_cast<double>(load(p.k, p.dtype, detail::offset_of(p.k_stride, b, si.k_row0 + j, hk) + c)); };
      auto vv = [&](int j, int c) { return static_cast<double>(load(p.v, p.dtype, detail::offset_of(p.v_stride, b, si.k_row0 + j, hk) + c)); };
      auto dov = [&](int i, int c) { return static_cast<double>(load(p.dout, p.dtype, detail::offset_of(p.do_stride, b, si.q_row0 + i, hq) + c)); };
      auto ov = [&](int i, int c) { return static_cast<double>(load(p.out, p.dtype, detail::offset_of(p.o_stride, b, si.q_row0 + i, hq) + c)); };
      std::vector<double> ds(static_cast<std::size_t>(si.len_q) * si.len_k, 0.0);
      for (int i = 0; i < si.len_q; ++i) {
        std::vector<double> dp(si.len_k, 0.0);
        for (int j = 0; j < si.len_k; ++j) {
          const std::size_t ij = static_cast<std::size_t>(i) * si.len_k + j;
          if (f.prob[ij] == 0.0) continue;  // masked (or underflowed): contributes nothing
          double acc = 0.0;
          for (int c = 0; c < p.d; ++c) acc += dov(i, c) * vv(j, c);
          dp[j] = rnd(rnd.acc(acc) * f.keep[ij]);
        }
        // D: the oracle's Σ P∘dP; emulating, or with f64_given_out, rowsum(dO∘O) from the given
        // output, as FlashAttention's backward takes it, O's rounding included (under dropout a row
        // seeing one key has O = round(V/(1-p)), and dS = dP - D is that residue where Σ P∘dP is
        // exactly 0; bench/NOTES.md, 2026-11-27).
        double rowsum = 0.0;
        if (rnd.active || prec == Precision::f64_given_out)  // the values are floats: exact either way
          rowsum = rnd.dot(p.d, [&](int c) { return static_cast<float>(dov(i, c)); },
                           [&](int c) { return static_cast<float>(ov(i, c)); });
        else
          for (int j = 0; j < si.len_k; ++j) rowsum += f.prob[static_cast<std::size_t>(i) * si.len_k + j] * dp[j];
        for (int j = 0; j < si.len_k; ++j) {
          const std::size_t ij = static_cast<std::size_t>(i) * si.len_k + j;
          if (f.prob[ij] == 0.0) continue;
          double d = f.prob[ij] * (dp[j] - rnd.acc(rowsum));
          if (p.softcap > 0.0f) {
            const double t = std::tanh(f.raw[ij] / p.softcap);
            d *= 1.0 - t * t;
          }
          ds[ij] = rnd(d);
        }
      }
      for (int i = 0; i < si.len_q; ++i) {
        const std::int64_t o = detail::offset_of(p.dq_stride, b, si.q_row0 + i, hq);
        for (int c = 0; c < p.d; ++c) {
          double acc = 0.0;
          for (int j = 0; j < si.len_k; ++j) acc += ds[static_cast<std::size_t>(i) * si.len_k + j] * kv(j, c);
          store(p.dq, p.dtype, o + c, static_cast<float>(rnd.acc(acc) * p.scale));
        }
      }
      for (int j = 0; j < si.len_k; ++j)
        for (int c = 0; c < p.d; ++c) {
          double acck = 0.0, accv = 0.0;
          for (int i = 0; i < si.len_q; ++i) {
            const std::size_t ij = static_cast<std::size_t>(i) * si.len_k + j;
            acck += ds[ij] * qv(i, c);
            accv += rnd(f.prob[ij] * f.keep[ij]) * dov(i, c);
          }
          dk[static_cast<std::size_t>(j) * p.d + c] += rnd.acc(acck) * p.scale;
          dv[static_cast<std::size_t>(j) * p.d + c] += rnd.acc(accv);
        }
    }
    for (int j = 0; j < si.len_k; ++j)
      for (int c = 0; c < p.d; ++c) {
        store(p.dk, p.dtype, detail::offset_of(p.dk_stride, b, si.k_row0 + j, hk) + c,
              static_cast<float>(dk[static_cast<std::size_t>(j) * p.d + c]));
        store(p.dv, p.dtype, detail::offset_of(p.dv_stride, b, si.k_row0 + j, hk) + c,
              static_cast<float>(dv[static_cast<std::size_t>(j) * p.d + c]));
      }
  }
}

}  // namespace flashmonoid::cpu
