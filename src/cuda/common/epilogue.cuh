// Forward epilogues: the finished rows (O·(1/l), lse) either as the output tensors, or as fp32
// split-KV partials for combine.cuh. Architecture independent: any mainloop that leaves O in the
// m16n8 accumulator layout (warp_gemm_sm80.cuh) and its rows in RowCoords can use them.
#pragma once

#include <cstdint>

#include "api/params.hpp"
#include "common/types.cuh"
#include "common/score_mod.cuh"

namespace flashmonoid::cuda {

// Where a block's rows live in the output: packed row R of the block's sequence is query R / pack
// of head head_base + R % pack.
struct BlockRows {
  int batch, head_base, pack, rows_total;
  detail::SeqInfo si;
  __device__ __forceinline__ int query(int R) const { return R / pack; }
  __device__ __forceinline__ int head(int R) const { return head_base + R % pack; }
};

// lse of the thread's rows, from one lane of each quad.
template <int kMTiles>
__device__ __forceinline__ void store_lse(const detail::FwdParams& p, const BlockRows& blk, const float (&lse)[2 * kMTiles],
                                          const RowCoords<kMTiles>& rows, int lane) {
  if ((lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r)
      if (rows.valid(r)) p.lse[detail::lse_index(p, blk.batch, rows.head(r), blk.si, rows.i(r))] = lse[r];
  }
}

// Normalised O through shared memory (sO: (kBlockM, kHeadDim) swizzled, the Q tile's space), so the
// global stores are whole 16-byte vectors along the head dim; then lse from one lane of each quad.
// All kThreads threads of the block take part (the sm80 forward; the sm90 one stores O by TMA or
// from registers).
template <class T, int kHeadDim, int kMTiles, int kBlockM, int kThreads>
__device__ __forceinline__ void store_output(const detail::FwdParams& p, const BlockRows& blk, int R0,
                                             const float (&o)[kMTiles][kHeadDim / 8][4],
                                             const float (&inv_l)[2 * kMTiles], const float (&lse)[2 * kMTiles],
                                             const RowCoords<kMTiles>& rows, T* sO, int warp_row0, int lane,
                                             bool holds_rows = true) {
  // Each warp writes only the rows it read Q from, so no block barrier is needed before these
  // stores; __syncwarp orders the warp's own last Q reads before them (racecheck flagged the
  // intra-warp pair once a divergent branch sat in the mainloop). holds_rows false: a warp whose
  // state another warp merged (the decode tile's warps 1-3) writes nothing but takes part in the
  // copy out.
  __syncwarp();
#pragma unroll
  for (int mi = 0; mi < kMTiles && holds_rows; ++mi)
#pragma unroll
    for (int di = 0; di < kHeadDim / 8; ++di)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        const int row = warp_row0 + mi * 16 + half * 8 + lane / 4;
        *reinterpret_cast<std::uint32_t*>(sO + swizzled<kHeadDim>(row, di * 8 + 2 * (lane & 3))) =
            pack2<T>(o[mi][di][2 * half] * inv_l[r], o[mi][di][2 * half + 1] * inv_l[r]);
      }
  __syncthreads();
  constexpr int kChunks = kHeadDim / 8;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int it = 0; it < kBlockM * kChunks / kThreads; ++it) {
    const int idx = it * kThreads + static_cast<int>(threadIdx.x);
    int r = idx / kChunks, c = idx % kChunks;
    int R = R0 + r;
    if (R < blk.rows_total && c * 8 < p.d) {
      T* g = out + detail::offset_of(p.o_stride, blk.batch, blk.si.q_row0 + blk.query(R), blk.head(R)) + c * 8;
      *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(sO + swizzled<kHeadDim>(r, c * 8));
    }
  }
  if (holds_rows) store_lse(p, blk, lse, rows, lane);
}

// O·(1/l) straight from the accumulators, without shared memory or a barrier, in 16-byte stores
// (store_row_vec16). The sm90 forward's store where shared memory has no room for an O buffer (hdim
// 256) and for varlen calls (tile_fwd_sm90.hpp: FwdStore).
// kHeadDim columns of O from column col0 on (the sm90 head-split kernel's consumers hold one half
// each), and lse unless with_lse is false (the other half's consumer stores it).
template <class T, int kHeadDim, int kMTiles>
__device__ __forceinline__ void store_output_regs(const detail::FwdParams& p, const BlockRows& blk,
                                                  const float (&o)[kMTiles][kHeadDim / 8][4],
                                                  const float (&inv_l)[2 * kMTiles], const float (&lse)[2 * kMTiles],
                                                  const RowCoords<kMTiles>& rows, int lane, int col0 = 0,
                                                  bool with_lse = true) {
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) {
    const bool valid = rows.valid(r);
    T* g = out + detail::offset_of(p.o_stride, blk.batch, blk.si.q_row0 + (valid ? rows.i(r) : 0), rows.head(r));
    store_row_vec16<T>(g, o[r / 2], r % 2, inv_l[r], col0, p.d, valid, lane);
  }
  if (with_lse) store_lse(p, blk, lse, rows, lane);
}

// Index of (split, head, global query row) in the partial buffers: (num_splits, h, total_q[, d]).
__device__ __forceinline__ std::int64_t partial_row(const detail::FwdParams& p, int split, int head, std::int64_t grow) {
  return (static_cast<std::int64_t>(split) * p.h + head) * p.total_q + grow;
}

// Normalised O and lse of this split in fp32 straight from the registers (8-byte stores; the
// partials are small next to the K/V they summarise).
template <int kHeadDim, int kMTiles>
__device__ __forceinline__ void store_partial(const detail::FwdParams& p, const BlockRows& blk, int split,
                                              float* out_partial, float* lse_partial,
                                              const float (&o)[kMTiles][kHeadDim / 8][4],
                                              const float (&inv_l)[2 * kMTiles], const float (&lse)[2 * kMTiles],
                                              const RowCoords<kMTiles>& rows, int lane) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * mi + half;
      if (!rows.valid(r)) continue;
      const std::int64_t pr = partial_row(p, split, rows.head(r), blk.si.global_q_row0 + rows.i(r));
#pragma unroll
      for (int di = 0; di < kHeadDim / 8; ++di) {
        const int col = di * 8 + 2 * (lane & 3);
        if (col < p.d)
          *reinterpret_cast<float2*>(out_partial + pr * p.d + col) =
              make_float2(o[mi][di][2 * half] * inv_l[r], o[mi][di][2 * half + 1] * inv_l[r]);
      }
      if ((lane & 3) == 0) lse_partial[pr] = lse[r];
    }
}

}  // namespace flashmonoid::cuda
