// Online softmax over register fragments: the device form of the monoid in
// flashmonoid/detail/monoid.hpp. Each thread holds 2·kMTiles rows (r = 2·mi + half, half 0 for
// accumulator entries 0,1 and 1 for entries 2,3); the 4 threads of a quad share a row, so row
// reductions are two xor-shuffles. Scores stay in the units the mainloop produced; `mul` maps them
// to log2 units (scale·log2(e) for raw q·k, 1 when score_mod.cuh already did), so each element
// costs one FFMA and one ex2. O is kept unnormalised until finish().
#pragma once

#include <cmath>

#include "flashmonoid/detail/monoid.hpp"

namespace flashmonoid::cuda {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // ex2(-inf) = +0, 2 ulp: below bf16/fp16 rounding
  return y;
}

// 1/x by rcp.approx (1 ulp, far below bf16/fp16 rounding). The sum l of a row with a visible key is
// >= 1, nowhere near the denormals that IEEE division's slow path (a subroutine call) exists for.
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kMTiles>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;
  float m[kRows];  // running max, score units
  float l[kRows];  // this thread's share of sum exp2((s - m)·mul); quad-reduced in finish()

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
    }
  }

  // Fold a tile of scores into the state, in three steps that a mainloop may interleave with its
  // products (the sm90 one rescales O only once the P·V product reading the old O has finished):
  // s (kMTiles, kNTiles) becomes P = exp2((s - m_new)·mul), l and o are rescaled by
  // factor = exp2((m_old - m_new)·mul). A row with no visible key so far keeps m = -inf;
  // subtracting 0 instead of -inf keeps its P at 0 rather than NaN.
  template <int kNTiles, int kDTiles>
  __device__ __forceinline__ void fold(float (&s)[kMTiles][kNTiles][4], float (&o)[kMTiles][kDTiles][4], float mul) {
    float factor[kRows];
    update_max(s, mul, factor);
    exp_and_sum(s, mul, factor);
    rescale(o, factor);
  }

  // The max of row r's 2·kNTiles entries of this thread, as a tree: the same FMNMX count as a running
  // max, a dependency chain of log2(2·kNTiles) instead of kNTiles + 1 (a running max is 21 dependent
  // FMNMX per row at 160 keys, at the head of every softmax step).
  template <int kNTiles>
  __device__ __forceinline__ static float thread_row_max(const float (&s)[kMTiles][kNTiles][4], int r) {
    const int mi = r / 2, half = r % 2;
    float t[kNTiles];
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) t[ni] = fmaxf(s[mi][ni][2 * half], s[mi][ni][2 * half + 1]);
#pragma unroll
    for (int width = 1; width < kNTiles; width *= 2)
#pragma unroll
      for (int ni = 0; ni + width < kNTiles; ni += 2 * width) t[ni] = fmaxf(t[ni], t[ni + width]);
    return t[0];
  }

  // Each row's max over its running m and this tile's scores (quad-reduced).
  template <int kNTiles>
  __device__ __forceinline__ void tile_max(const float (&s)[kMTiles][kNTiles][4], float (&mx)[kRows]) const {
#pragma unroll
    for (int r = 0; r < kRows; ++r) mx[r] = quad_max(fmaxf(m[r], thread_row_max(s, r)));
  }

  // factor[r] = exp2((m_old - m_new)·mul) for the new max mx, which becomes m.
  __device__ __forceinline__ void move_max(const float (&mx)[kRows], float mul, float (&factor)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      factor[r] = fast_exp2(m[r] * mul - (mx[r] == -INFINITY ? 0.0f : mx[r] * mul));
      m[r] = mx[r];
    }
  }

  // Step 1: the new row max; factor[r] = exp2((m_old - m_new)·mul).
  template <int kNTiles>
  __device__ __forceinline__ void update_max(const float (&s)[kMTiles][kNTiles][4], float mul, float (&factor)[kRows]) {
    float mx[kRows];
    tile_max(s, mx);
    move_max(mx, mul, factor);
  }

  // Step 1 keeping a stale max (FlashAttention-4's rule): while no row of the warp has a score more
  // than kStaleLog2 (log2 units) above its running m, m stays, every factor is 1 and the result is
  // false, so the caller skips O's rescale (warp-uniform). P = exp2((s - m)·mul) is then at most
  // 2^kStaleLog2, which bf16 / fp16 P and the fp32 sums hold as well as values <= 1, and finish()'s lse
  // and 1/l use the same m: the same attention up to rounding. Else update_max's update, and true.
  // sm90 forward, H100: +1-9% (hdim 128 512 keys 455 -> 493 TFLOP/s, 16k 659 -> 695; hdim 256 16k
  // 728 -> 779); the exact form (skip only where every factor is 1) lost 1-6%: it rarely skips.
  static constexpr float kStaleLog2 = 8.0f;
  template <int kNTiles>
  __device__ __forceinline__ bool update_max_lazy(const float (&s)[kMTiles][kNTiles][4], float mul,
                                                  float (&factor)[kRows]) {
    float mx[kRows];
    tile_max(s, mx);
    bool grow = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      grow = grow || !(m[r] * mul >= mx[r] * mul - kStaleLog2);  // m = -inf under a visible key: grow
    if (!__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) factor[r] = 1.0f;
      return false;
    }
    move_max(mx, mul, factor);
    return true;
  }

  // Step 2: P = exp2((s - m)·mul) in place, l = l·factor + rowsum(P) (this thread's share).
  template <int kNTiles>
  __device__ __forceinline__ void exp_and_sum(float (&s)[kMTiles][kNTiles][4], float mul, const float (&factor)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int mi = r / 2, half = r % 2;
      const float m_scaled = m[r] == -INFINITY ? 0.0f : m[r] * mul;
      float sum = 0.0f;
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[mi][ni][e] = fast_exp2(fmaf(s[mi][ni][e], mul, -m_scaled));
          sum += s[mi][ni][e];
        }
      }
      l[r] = l[r] * factor[r] + sum;
    }
  }

  // Step 3: o *= factor, row by row.
  template <int kDTiles>
  __device__ __forceinline__ static void rescale(float (&o)[kMTiles][kDTiles][4], const float (&factor)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int mi = r / 2, half = r % 2;
#pragma unroll
      for (int di = 0; di < kDTiles; ++di) {
        o[mi][di][2 * half] *= factor[r];
        o[mi][di][2 * half + 1] *= factor[r];
      }
    }
  }

  // Merge another unfinished state of the same rows (another warp's, over other keys: its running
  // max m_b and this lane's share of its sums l_b) into this one, the monoid's merge before
  // finish(). factor_a and factor_b rescale this state's O and the other's before they are added
  // (0 for a state without keys, m = -inf).
  __device__ __forceinline__ void merge(const float (&m_b)[kRows], const float (&l_b)[kRows], float mul,
                                        float (&factor_a)[kRows], float (&factor_b)[kRows]) {
    float mx[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      mx[r] = fmaxf(m[r], m_b[r]);
      factor_b[r] = fast_exp2(m_b[r] * mul - (mx[r] == -INFINITY ? 0.0f : mx[r] * mul));
    }
    move_max(mx, mul, factor_a);
#pragma unroll
    for (int r = 0; r < kRows; ++r) l[r] = l[r] * factor_a[r] + l_b[r] * factor_b[r];
  }
  // Merge a finished part of the same rows (another key range's normalised output y and natural-log
  // lse_part) into the state, the monoid's merge in the state's form: the part weighs as one more key
  // of score lse_part / (mul · ln 2) whose value row is y. The caller then sets
  // o = o·factor + y·weight; the part's share of l goes to each quad's first lane. A part without
  // keys (lse -inf) adds nothing.
  __device__ __forceinline__ void absorb(const float (&lse_part)[kRows], float mul, int lane, float (&factor)[kRows],
                                         float (&weight)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float part = lse_part[r] * (1.0f / detail::kLn2);  // log2 units; -inf stays
      const float m_old = m[r] == -INFINITY ? -INFINITY : m[r] * mul;
      const float m_new = fmaxf(m_old, part);
      factor[r] = m_old == -INFINITY ? 0.0f : fast_exp2(m_old - m_new);
      weight[r] = part == -INFINITY ? 0.0f : fast_exp2(part - m_new);
      l[r] = l[r] * factor[r] + (lane % 4 == 0 ? weight[r] : 0.0f);
      m[r] = m_new == -INFINITY ? -INFINITY : m_new / mul;
    }
  }

  // Finished form of row r: (1/l or 0, lse in natural log or -inf), through detail::RowState
  // (whose m is in log2 units). kApproxRcp takes 1/l from fast_rcp instead of the IEEE division: the
  // sm90 forward's epilogue, +0.4-0.6% geomean in two A/B calls (16 and 19 shapes, H100); the sm80 kernels
  // keep the division (with rcp.approx their hdim-64 score-modifier forward spilled 8 bytes).
  template <bool kApproxRcp = false>
  __device__ __forceinline__ void finish(float mul, float (&inv_l)[kRows], float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      detail::RowState st{m[r] == -INFINITY ? -INFINITY : m[r] * mul, quad_sum(l[r])};
      if constexpr (kApproxRcp) {
        inv_l[r] = st.l > 0.0f ? fast_rcp(st.l) : 0.0f;  // detail::finish_inv_l's rule
      } else {
        inv_l[r] = detail::finish_inv_l(st);
      }
      lse[r] = detail::finish_lse(st);
    }
  }
};

}  // namespace flashmonoid::cuda
