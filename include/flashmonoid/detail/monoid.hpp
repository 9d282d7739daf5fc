// The online-softmax monoid. A row's partial attention over some set of keys is the state
// (m, l, o): the running max of the scores, the sum of 2^(score - m), and the sum of
// 2^(score - m) · v (o unnormalised), scores in log2 units (scale·log2(e)·q·k, so that every
// exponential is one exp2 with no multiply). merge() is associative with identity (-inf, 0, 0);
// tiles in a kernel, KV splits across thread blocks and KV shards across GPUs are all folds of this
// merge. The finished form of a state is (out, lse) = (o / l, ln 2·(m + log2 l)), lse in natural
// units as the API returns it; the same merge in that form is merge_lse() below.
#pragma once

#include <cmath>

#include "flashmonoid/detail/host_device.hpp"

namespace flashmonoid::detail {

inline constexpr float kLn2 = 0.6931471805599453f;

// exp(a - b) that treats a = -inf as weight 0 even when b = -inf too (no NaN from -inf - -inf).
FM_HD float rescale_factor(float m_part, float m_new) {
  return m_part == -INFINITY ? 0.0f : ::expf(m_part - m_new);
}

// 2^(a - b), the same for a state's maxima (log2 units); exactly 1 without a call where the max
// did not move, as for most rows of most tiles.
FM_HD float rescale_factor_log2(float m_part, float m_new) {
  return m_part == -INFINITY ? 0.0f : m_part == m_new ? 1.0f : ::exp2f(m_part - m_new);
}

// Scalar part of the state; o travels alongside and is scaled by the factors this returns.
struct RowState {
  float m = -INFINITY;  // running max of scores, log2 units
  float l = 0.0f;       // sum of 2^(score - m)
};

// Merge b into a: a.o := a.o * fa + b.o * fb, with (fa, fb) returned through the pointers.
FM_HD RowState merge(RowState a, RowState b, float* fa, float* fb) {
  float m = a.m > b.m ? a.m : b.m;
  *fa = rescale_factor_log2(a.m, m);
  *fb = rescale_factor_log2(b.m, m);
  return RowState{m, a.l * *fa + b.l * *fb};
}

// lse of the union of two key sets given each one's lse; -inf is the identity.
// Weights of each part's normalised output in the union come back through wa, wb.
FM_HD float merge_lse(float lse_a, float lse_b, float* wa, float* wb) {
  float m = lse_a > lse_b ? lse_a : lse_b;
  if (m == -INFINITY) {
    *wa = 0.0f;
    *wb = 0.0f;
    return -INFINITY;
  }
  float ea = ::expf(lse_a - m), eb = ::expf(lse_b - m);  // exp(-inf) = 0 for an empty part
  float s = ea + eb;
  *wa = ea / s;
  *wb = eb / s;
  return m + ::logf(s);
}

// The finished merge of n parts at once (the split-KV combine): with m the largest part's lse, part
// j's weight in the union is rescale_factor(lse_j, m) / s, s the sum of those factors, and the
// union's lse is m + ln s (-inf, every weight 0, where every part is empty). The same result as a
// fold of merge_lse up to rounding, with independent weights instead of a chain of exp, log and
// division per part.
FM_HD float lse_of_sum(float m, float s) { return s > 0.0f ? m + ::logf(s) : -INFINITY; }

// Finish a state: lse = ln 2·(m + log2 l), natural units (or -inf for a row that saw no key),
// inverse normaliser 1/l (0 for an empty row, so its output is exactly 0).
FM_HD float finish_lse(RowState s) { return s.l > 0.0f ? kLn2 * (s.m + ::log2f(s.l)) : -INFINITY; }
FM_HD float finish_inv_l(RowState s) { return s.l > 0.0f ? 1.0f / s.l : 0.0f; }

}  // namespace flashmonoid::detail
