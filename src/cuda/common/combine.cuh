// Split-KV combine: each (head, query row) folds its num_splits partial (out, lse) pairs with
// detail::merge_lse, the finished form of the monoid's merge, then writes out (dtype T) and lse.
// Splits that saw no visible key carry lse = -inf, the identity, and drop out of the fold.
// The fold is bracketed for latency (one warp per row, decoding has few rows: 32 at b = 1): each
// lane folds the lse of splits lane, lane + 32, ..., a butterfly of merge_lse joins the lanes, and
// then split s's output enters with its weight in the whole, exp(lse_s - lse), the product of the
// merge weights along any bracketing. The outputs' loads no longer wait on the previous split's
// merge, so they go out in batches (a split-by-split fold was 33 dependent L2 round trips at b = 1,
// 32k).
#pragma once

#include <cstdint>

#include "api/params.hpp"
#include "common/epilogue.cuh"
#include "common/mma_sm80.cuh"
#include "flashmonoid/detail/monoid.hpp"

namespace flashmonoid::cuda {

inline constexpr int kCombineWarps = 4;
// One warp per row, 4 fp32 per lane per step: 2 steps cover head dims up to 256.
inline constexpr int kCombineSteps = 2;
// Splits whose partials are loaded together (8 · (2 float4 + 1 float) = 72 registers in flight).
inline constexpr int kCombineBatch = 8;

template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32)
    combine_splits_kernel(const __grid_constant__ detail::FwdParams p, int num_splits, const float* out_partial,
                          const float* lse_partial) {
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (row >= p.h * p.total_q) return;
  const int head = static_cast<int>(row / p.total_q);
  const std::int64_t grow = row % p.total_q;  // global query row, as in dropout_row_id

  float lse = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) {
    float wa, wb;
    lse = detail::merge_lse(lse, lse_partial[partial_row(p, s, head, grow)], &wa, &wb);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    float wa, wb;
    lse = detail::merge_lse(lse, __shfl_xor_sync(0xffffffffu, lse, offset), &wa, &wb);
  }

  // Splits in batches of kCombineBatch, all loads of a batch issued before any of them is used.
  float4 acc[kCombineSteps] = {};
  for (int s0 = 0; s0 < num_splits; s0 += kCombineBatch) {
    float lse_s[kCombineBatch];
    float4 x[kCombineBatch][kCombineSteps];
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const bool ok = s0 + j < num_splits;
      const std::int64_t pr = partial_row(p, ok ? s0 + j : 0, head, grow);
      lse_s[j] = ok ? lse_partial[pr] : -INFINITY;  // weight 0 past the last split
#pragma unroll
      for (int k = 0; k < kCombineSteps; ++k) {
        const int col = (k * 32 + lane) * 4;
        x[j][k] = ok && col < p.d ? *reinterpret_cast<const float4*>(out_partial + pr * p.d + col)
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const float w = detail::rescale_factor(lse_s[j], lse);
#pragma unroll
      for (int k = 0; k < kCombineSteps; ++k)
        acc[k] = make_float4(acc[k].x + x[j][k].x * w, acc[k].y + x[j][k].y * w, acc[k].z + x[j][k].z * w,
                             acc[k].w + x[j][k].w * w);
    }
  }

  // Packed (varlen) rows are rows of the tensor; batched rows are (b, i) = divmod(grow, s_q).
  const bool packed = p.cu_seqlens_q != nullptr;
  const int b = packed ? 0 : static_cast<int>(grow / p.seqlen_q);
  const std::int64_t i = packed ? grow : grow % p.seqlen_q;
  T* out = static_cast<T*>(p.out) + detail::offset_of(p.o_stride, b, i, head);
#pragma unroll
  for (int k = 0; k < kCombineSteps; ++k) {
    const int col = (k * 32 + lane) * 4;
    if (col >= p.d) continue;
    *reinterpret_cast<uint2*>(out + col) = make_uint2(pack2<T>(acc[k].x, acc[k].y), pack2<T>(acc[k].z, acc[k].w));
  }
  if (lane == 0) p.lse[packed ? head * p.total_q + grow : (static_cast<std::int64_t>(b) * p.h + head) * p.seqlen_q + i] = lse;
}

}  // namespace flashmonoid::cuda
