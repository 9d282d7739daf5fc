// Split-KV combine: each (head, query row) folds its num_splits partial (out, lse) pairs with
// detail::merge_lse, the finished form of the monoid's merge, then writes out (dtype T) and lse.
// Splits that saw no visible key carry lse = -inf, the identity, and drop out of the fold.
// Bracketed for latency: decoding has few rows (32 at b = 1), so the fold's dependent round trips
// to L2 are its cost, not its bytes. A warp loads kCombineBatch splits' lse and outputs before it
// uses any and folds them in registers, so up to that many splits cost one round trip of loads:
// - up to kCombineBatch splits (batched decoding, speculative tokens: many rows, few splits): a
//   warp per row, 8 rows per block (combine_rows_kernel). The block-per-row form below ran 1024
//   rows of 4 splits (b = 8, s_q = 4) in 20 us under ncu: 103 registers leave 2 blocks of 256
//   threads per SM, so 4 waves of mostly idle warps;
// - more splits (b = 1 decoding, 33 splits): a block per row (combine_splits_kernel), warp w takes
//   splits w, w + 8, ... and the 8 warps' states are merged through shared memory (one warp per row
//   over every split made 5 dependent round trips at 33 splits, ~10 us under ncu).
// Two kernels rather than one with both forms: b = 1 32k decoding without an append reads 0.822 of
// copy against 0.790 (H100).
#pragma once

#include <cstdint>

#include "api/params.hpp"
#include "common/epilogue.cuh"
#include "common/pdl.cuh"
#include "common/types.cuh"
#include "flashmonoid/detail/monoid.hpp"

namespace flashmonoid::cuda {

inline constexpr int kCombineWarps = 8;  // per block
// 4 fp32 per lane per step: 2 steps cover head dims up to 256.
inline constexpr int kCombineSteps = 2;
// Splits a warp loads together (8 · (2 float4 + 1 float) = 72 registers in flight).
inline constexpr int kCombineBatch = 8;

// Blocks of the combine (combine_rows_kernel up to kCombineBatch splits, else combine_splits_kernel)
// for `rows` = h · total_q rows.
inline unsigned combine_blocks(std::int64_t rows, int num_splits) {
  return static_cast<unsigned>(num_splits <= kCombineBatch ? (rows + kCombineWarps - 1) / kCombineWarps : rows);
}

// Fold splits first, first + kStride, ... (below num_splits) of row (head, grow) into this warp's
// state (lse, acc: normalised over the splits folded so far), kCombineBatch splits per round trip.
template <int kStride>
__device__ __forceinline__ void fold_splits(const detail::FwdParams& p, int num_splits, const float* out_partial,
                                            const float* lse_partial, int head, std::int64_t grow, int first, int lane,
                                            float& lse, float4 (&acc)[kCombineSteps]) {
  for (int s0 = first; s0 < num_splits; s0 += kStride * kCombineBatch) {
    float lse_s[kCombineBatch];
    float4 x[kCombineBatch][kCombineSteps];
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const int split = s0 + j * kStride;
      const bool ok = split < num_splits;
      const std::int64_t pr = partial_row(p, ok ? split : 0, head, grow);
      lse_s[j] = ok ? lse_partial[pr] : -INFINITY;  // weight 0 past the last split
#pragma unroll
      for (int k = 0; k < kCombineSteps; ++k) {
        const int col = (k * 32 + lane) * 4;
        x[j][k] = ok && col < p.d ? *reinterpret_cast<const float4*>(out_partial + pr * p.d + col)
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    // Fold the batch in registers, then into the warp's state.
    float lse_b = -INFINITY;
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      float wa, wb;
      lse_b = detail::merge_lse(lse_b, lse_s[j], &wa, &wb);
    }
    float wa, wb;
    const float merged = detail::merge_lse(lse, lse_b, &wa, &wb);
#pragma unroll
    for (int k = 0; k < kCombineSteps; ++k)
      acc[k] = make_float4(acc[k].x * wa, acc[k].y * wa, acc[k].z * wa, acc[k].w * wa);
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      // Split j's weight in the merged whole: exp(lse_j - lse_b) · wb = exp(lse_j - merged).
      const float w = detail::rescale_factor(lse_s[j], merged);
#pragma unroll
      for (int k = 0; k < kCombineSteps; ++k)
        acc[k] = make_float4(acc[k].x + x[j][k].x * w, acc[k].y + x[j][k].y * w, acc[k].z + x[j][k].z * w,
                             acc[k].w + x[j][k].w * w);
    }
    lse = merged;
  }
}

// out and lse of row (head, grow) from a warp's finished state.
template <class T>
__device__ __forceinline__ void store_combined(const detail::FwdParams& p, int head, std::int64_t grow, float lse,
                                               const float4 (&acc)[kCombineSteps], int lane) {
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

// More than kCombineBatch splits. grid: h · total_q blocks, a block per row (head row / total_q,
// global query row row % total_q, as in dropout_row_id): warp w folds splits w, w + 8, ..., then
// warp 0 merges the warps in order.
template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32)
    combine_splits_kernel(const __grid_constant__ detail::FwdParams p, int num_splits, const float* out_partial,
                          const float* lse_partial, bool programmatic) {
  __shared__ float4 s_acc[kCombineWarps][kCombineSteps][32];
  __shared__ float s_lse[kCombineWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t row = blockIdx.x;
  const int head = static_cast<int>(row / p.total_q);
  const std::int64_t grow = row % p.total_q;
  if (programmatic) pdl_wait();  // launched under the forward that writes the partials (pdl.cuh)
  float lse = -INFINITY;
  float4 acc[kCombineSteps] = {};
  fold_splits<kCombineWarps>(p, num_splits, out_partial, lse_partial, head, grow, warp, lane, lse, acc);
#pragma unroll
  for (int k = 0; k < kCombineSteps; ++k) s_acc[warp][k][lane] = acc[k];
  if (lane == 0) s_lse[warp] = lse;
  __syncthreads();
  if (warp != 0) return;
  lse = s_lse[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) {
    float wa, wb;
    lse = detail::merge_lse(lse, s_lse[w], &wa, &wb);
#pragma unroll
    for (int k = 0; k < kCombineSteps; ++k) {
      const float4 y = s_acc[w][k][lane];
      acc[k] = make_float4(acc[k].x * wa + y.x * wb, acc[k].y * wa + y.y * wb, acc[k].z * wa + y.z * wb,
                           acc[k].w * wa + y.w * wb);
    }
  }
  store_combined<T>(p, head, grow, lse, acc, lane);
}

// At most kCombineBatch splits. grid: combine_blocks(h · total_q, num_splits), a warp per row
// (row blockIdx.x · 8 + warp), every split loaded in one batch.
template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32)
    combine_rows_kernel(const __grid_constant__ detail::FwdParams p, int num_splits, const float* out_partial,
                        const float* lse_partial, bool programmatic) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (programmatic) pdl_wait();  // launched under the forward that writes the partials (pdl.cuh)
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kCombineWarps + warp;
  if (row >= static_cast<std::int64_t>(p.h) * p.total_q) return;
  const int head = static_cast<int>(row / p.total_q);
  const std::int64_t grow = row % p.total_q;
  float lse = -INFINITY;
  float4 acc[kCombineSteps] = {};
  fold_splits<1>(p, num_splits, out_partial, lse_partial, head, grow, 0, lane, lse, acc);
  store_combined<T>(p, head, grow, lse, acc, lane);
}

}  // namespace flashmonoid::cuda
