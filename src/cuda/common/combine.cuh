// Split-KV combine: each (head, query row) folds its num_splits partial (out, lse) pairs with
// detail::merge_lse, the finished form of the monoid's merge, then writes out (dtype T) and lse.
// Splits that saw no visible key carry lse = -inf, the identity, and drop out of the fold.
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
  float4 acc[kCombineSteps] = {};
  for (int s = 0; s < num_splits; ++s) {
    const std::int64_t pr = partial_row(p, s, head, grow);
    float wa, wb;
    lse = detail::merge_lse(lse, lse_partial[pr], &wa, &wb);
#pragma unroll
    for (int k = 0; k < kCombineSteps; ++k) {
      const int col = (k * 32 + lane) * 4;
      if (col >= p.d) continue;
      const float4 x = *reinterpret_cast<const float4*>(out_partial + pr * p.d + col);
      acc[k] = make_float4(acc[k].x * wa + x.x * wb, acc[k].y * wa + x.y * wb, acc[k].z * wa + x.z * wb,
                           acc[k].w * wa + x.w * wb);
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
