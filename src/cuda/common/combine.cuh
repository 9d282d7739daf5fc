// Split-KV combine: each (head, query row) merges its num_splits partial (out, lse) pairs at once
// (detail::lse_of_sum, the finished form of the monoid's merge over n parts): the largest lse m over
// the splits, then each split's weight exp(lse_j - m), their sum s, out = sum of weighted outputs / s,
// lse = m + ln s. Splits that saw no visible key carry lse = -inf, the identity: weight 0.
// Bracketed for latency: decoding has few rows (32 at b = 1), so the combine's dependent steps are
// its cost, not its bytes. A warp issues a batch of kCombineBatch splits' lse and outputs, then the
// lse of every split for m, before it uses any, so up to that many splits cost one round trip; the
// weights are independent exponentials. (Folded split by split with merge_lse, a chain of exp, log and
// two divisions per split, the b = 1 32k combine took 3.6 us after its wait: H100, block timeline.)
// - up to kCombineBatch splits (batched decoding, speculative tokens: many rows, few splits): a
//   warp per row, 8 rows per block (combine_rows_kernel). The block-per-row form below ran 1024
//   rows of 4 splits (b = 8, s_q = 4) in 20 us under ncu: 103 registers leave 2 blocks of 256
//   threads per SM, so 4 waves of mostly idle warps;
// - more splits (b = 1 decoding, 33 splits): a block per row (combine_splits_kernel), warp w takes
//   splits w, w + 8, ... and the 8 warps' sums are added through shared memory.
// Two kernels rather than one with both forms: b = 1 32k decoding without an append reads 0.822 of
// copy against 0.790 (H100).
#pragma once

#include <cstdint>

#include "api/params.hpp"
#include "common/epilogue.cuh"
#include "common/pdl.cuh"
#include "common/trace.cuh"
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

// kCombineBatch splits of row (head, grow), first + kStride · j for j < kCombineBatch (those at or
// past num_splits weigh 0): their lse and output columns, loaded together.
struct SplitBatch {
  float lse[kCombineBatch];
  float4 x[kCombineBatch][kCombineSteps];

  template <int kStride>
  __device__ __forceinline__ void load(const detail::FwdParams& p, int num_splits, const float* out_partial,
                                       const float* lse_partial, int head, std::int64_t grow, int first, int lane) {
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const int split = first + j * kStride;
      const bool ok = split < num_splits;
      const std::int64_t pr = partial_row(p, ok ? split : 0, head, grow);
      lse[j] = ok ? lse_partial[pr] : -INFINITY;  // weight 0 past the last split
#pragma unroll
      for (int k = 0; k < kCombineSteps; ++k) {
        const int col = (k * 32 + lane) * 4;
        x[j][k] = ok && col < p.d ? *reinterpret_cast<const float4*>(out_partial + pr * p.d + col)
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
  }
  // acc += the batch's outputs weighted by exp(lse_j - m), s += those weights.
  __device__ __forceinline__ void fold(float m, float& s, float4 (&acc)[kCombineSteps]) const {
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const float w = detail::rescale_factor(lse[j], m);
      s += w;
#pragma unroll
      for (int k = 0; k < kCombineSteps; ++k)
        acc[k] = make_float4(acc[k].x + x[j][k].x * w, acc[k].y + x[j][k].y * w, acc[k].z + x[j][k].z * w,
                             acc[k].w + x[j][k].w * w);
    }
  }
};

// Splits first, first + kStride, ... of row (head, grow) folded relative to the largest lse m over
// every split of the row, which comes back: the first batch's loads are issued before m's (lanes
// read splits lane, lane + 32, ..., then a butterfly), so both cost one round trip.
template <int kStride>
__device__ __forceinline__ float fold_splits(const detail::FwdParams& p, int num_splits, const float* out_partial,
                                             const float* lse_partial, int head, std::int64_t grow, int first,
                                             int lane, float& s, float4 (&acc)[kCombineSteps]) {
  SplitBatch batch;
  batch.load<kStride>(p, num_splits, out_partial, lse_partial, head, grow, first, lane);
  float m = -INFINITY;
#pragma unroll 4
  for (int split = lane; split < num_splits; split += 32)
    m = fmaxf(m, lse_partial[partial_row(p, split, head, grow)]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  batch.fold(m, s, acc);
  for (int s0 = first + kStride * kCombineBatch; s0 < num_splits; s0 += kStride * kCombineBatch) {
    batch.load<kStride>(p, num_splits, out_partial, lse_partial, head, grow, s0, lane);
    batch.fold(m, s, acc);
  }
  return m;
}

// out and lse of row (head, grow) from the sums over every split: acc (weighted outputs) and s
// (weights), relative to the largest lse m.
template <class T>
__device__ __forceinline__ void store_combined(const detail::FwdParams& p, int head, std::int64_t grow, float m,
                                               float s, const float4 (&acc)[kCombineSteps], int lane) {
  const float inv_s = s > 0.0f ? 1.0f / s : 0.0f;
  const float lse = detail::lse_of_sum(m, s);
  // Packed (varlen) rows are rows of the tensor; batched rows are (b, i) = divmod(grow, s_q).
  const bool packed = p.cu_seqlens_q != nullptr;
  const int b = packed ? 0 : static_cast<int>(grow / p.seqlen_q);
  const std::int64_t i = packed ? grow : grow % p.seqlen_q;
  T* out = static_cast<T*>(p.out) + detail::offset_of(p.o_stride, b, i, head);
#pragma unroll
  for (int k = 0; k < kCombineSteps; ++k) {
    const int col = (k * 32 + lane) * 4;
    if (col >= p.d) continue;
    *reinterpret_cast<uint2*>(out + col) =
        make_uint2(pack2<T>(acc[k].x * inv_s, acc[k].y * inv_s), pack2<T>(acc[k].z * inv_s, acc[k].w * inv_s));
  }
  if (lane == 0) p.lse[packed ? head * p.total_q + grow : (static_cast<std::int64_t>(b) * p.h + head) * p.seqlen_q + i] = lse;
}

// After the forward's grid (pdl_wait): its shared key tiles' counters back to 0, for the next launch
// that gets this workspace, a graph replay of this one among them (block_range.cuh: SharedKeyTiles).
__device__ __forceinline__ void reset_tile_counters(unsigned long long* tile_counters, int num_counters) {
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < num_counters;
       i += static_cast<int>(gridDim.x * blockDim.x))
    tile_counters[i] = 0;
}

// More than kCombineBatch splits. grid: h · total_q blocks, a block per row (head row / total_q,
// global query row row % total_q, as in dropout_row_id): warp w folds splits w, w + 8, ..., then
// warp 0 adds the warps' sums (all relative to the same largest lse).
template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32)
    combine_splits_kernel(const __grid_constant__ detail::FwdParams p, int num_splits, const float* out_partial,
                          const float* lse_partial, unsigned long long* tile_counters, int num_counters,
                          bool programmatic) {
  __shared__ float4 s_acc[kCombineWarps][kCombineSteps][32];
  __shared__ float s_sum[kCombineWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t row = blockIdx.x;
  const int head = static_cast<int>(row / p.total_q);
  const std::int64_t grow = row % p.total_q;
  trace_mark(p, TraceKernel::combine, 0);
  if (programmatic) {
    pdl_wait();               // launched under the forward that writes the partials (pdl.cuh)
    pdl_launch_dependents();  // the next call's first kernel may launch (it waits for this grid)
  }
  trace_mark(p, TraceKernel::combine, 1);
  reset_tile_counters(tile_counters, num_counters);
  float s = 0.0f;
  float4 acc[kCombineSteps] = {};
  const float m = fold_splits<kCombineWarps>(p, num_splits, out_partial, lse_partial, head, grow, warp, lane, s, acc);
  trace_mark(p, TraceKernel::combine, 2);  // warp 0's splits loaded and folded
#pragma unroll
  for (int k = 0; k < kCombineSteps; ++k) s_acc[warp][k][lane] = acc[k];
  if (lane == 0) s_sum[warp] = s;
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) {
    s += s_sum[w];
#pragma unroll
    for (int k = 0; k < kCombineSteps; ++k) {
      const float4 y = s_acc[w][k][lane];
      acc[k] = make_float4(acc[k].x + y.x, acc[k].y + y.y, acc[k].z + y.z, acc[k].w + y.w);
    }
  }
  store_combined<T>(p, head, grow, m, s, acc, lane);
  trace_mark(p, TraceKernel::combine, 3);
}

// At most kCombineBatch splits. grid: combine_blocks(h · total_q, num_splits), a warp per row
// (row blockIdx.x · 8 + warp), every split loaded in one batch.
template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32)
    combine_rows_kernel(const __grid_constant__ detail::FwdParams p, int num_splits, const float* out_partial,
                        const float* lse_partial, unsigned long long* tile_counters, int num_counters,
                        bool programmatic) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  trace_mark(p, TraceKernel::combine, 0);
  if (programmatic) {
    pdl_wait();               // launched under the forward that writes the partials (pdl.cuh)
    pdl_launch_dependents();  // the next call's first kernel may launch (it waits for this grid)
  }
  trace_mark(p, TraceKernel::combine, 1);
  reset_tile_counters(tile_counters, num_counters);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kCombineWarps + warp;
  if (row >= static_cast<std::int64_t>(p.h) * p.total_q) return;
  const int head = static_cast<int>(row / p.total_q);
  const std::int64_t grow = row % p.total_q;
  float s = 0.0f;
  float4 acc[kCombineSteps] = {};
  const float m = fold_splits<1>(p, num_splits, out_partial, lse_partial, head, grow, 0, lane, s, acc);
  trace_mark(p, TraceKernel::combine, 2);  // the row's splits loaded and folded
  store_combined<T>(p, head, grow, m, s, acc, lane);
  trace_mark(p, TraceKernel::combine, 3);
}

}  // namespace flashmonoid::cuda
