// The two products of the forward mainloop for one warp, on mma.sync m16n8k16 fragments.
// Fragment shapes: an accumulator acc[kMTiles][kNTiles][4] covers (16·kMTiles, 8·kNTiles) with
// the m16n8 layout of mma_sm80.cuh (c0,c1: row lane/4, c2,c3: row lane/4 + 8; columns
// 2·(lane%4) + {0,1}).
#pragma once

#include <cstdint>

#include "sm80/mma_sm80.cuh"
#include "sm80/smem_tile.cuh"

namespace flashmonoid::cuda {

// One lane's ldmatrix row address in a swizzled (rows, kCols) tile (smem_tile.cuh), in bytes of the
// shared window. Built once per operand; the address `rows` further down (a multiple of 8, so the
// swizzle key row % 8 is unchanged) and `step` 16-column steps further right is then the base XOR
// a constant plus a constant: within a 128-byte group the chunk moves by 2·step, and the swizzle is
// an XOR of those same three bits. Swizzling each address afresh left ~28 loop-invariant addresses
// live at 2 m tiles per warp (ptxas, hdim 128: 255 registers and 180 bytes of spills).
template <int kCols>
struct LdsmLane {
  static constexpr int kRowBytes = kCols * 2;
  static_assert(kRowBytes % 128 == 0, "the swizzle's chunk bits (4-6) must not carry into the row");
  std::uint32_t base;
  // tile: 128-byte aligned; row: the lane's row; chunk: 0 or 1, its 8-column half of the first step.
  __device__ __forceinline__ LdsmLane(const void* tile, int row, int chunk)
      : base(smem_addr(tile) + row * kRowBytes + (((chunk ^ row) & 7) << 4)) {}
  __device__ __forceinline__ LdsmLane(std::uint32_t base_) : base(base_) {}
  // The same lane in a tile `bytes` further on (a K/V ring stage; a multiple of 128).
  __device__ __forceinline__ LdsmLane plus(std::uint32_t bytes) const { return LdsmLane(base + bytes); }
  // = SwizzledOffset<kCols>::step(base, rows, 2·step) (smem_tile.cuh), written out as tuned.
  __device__ __forceinline__ std::uint32_t at(int rows, int step) const {
    return (base ^ ((step & 3) << 5)) + (step >> 2) * 128 + rows * kRowBytes;
  }
};

__device__ __forceinline__ void ldmatrix_x4_at(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans_at(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Lane addresses of the three operands. Q (A, 16x16 per m tile): matrices (rows 0-7 | 8-15) x
// (k 0-7 | 8-15) in lane order. K (B, two n8 tiles x k16): lanes 0-15 n rows 0-7, k halves; lanes
// 16-31 n rows 8-15. V (B via .trans from a (k, n) tile): like Q with keys as rows.
template <int kHeadDim>
__device__ __forceinline__ LdsmLane<kHeadDim> q_lane(const void* sQ, int q_row0, int lane) {
  return LdsmLane<kHeadDim>(sQ, q_row0 + (lane & 15), lane >> 4);
}
template <int kHeadDim>
__device__ __forceinline__ LdsmLane<kHeadDim> k_lane(const void* sK, int lane) {
  return LdsmLane<kHeadDim>(sK, (lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1);
}
template <int kHeadDim>
__device__ __forceinline__ LdsmLane<kHeadDim> v_lane(const void* sV, int lane) {
  return LdsmLane<kHeadDim>(sV, lane & 15, lane >> 4);
}

// The same patterns for any operand, as (row, 16-byte chunk) of the lane in its tile:
//   A (16 rows x k16) from a (row, k) tile, and B via .trans from a (k, n) tile (k as rows): q_lane.
//   B (two n8 tiles x k16) from an (n, k) tile, and A via .trans from a (k, m) tile: k_lane.
// (Written apart from q_lane/k_lane/v_lane: routing those through these moved the forward's
// score-mod kernels by +32-104 SASS instructions at hdim 64, ptxas sm_90.)
__device__ __forceinline__ int ldsm_a_row(int lane) { return lane & 15; }
__device__ __forceinline__ int ldsm_a_chunk(int lane) { return lane >> 4; }
__device__ __forceinline__ int ldsm_b_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
__device__ __forceinline__ int ldsm_b_chunk(int lane) { return (lane >> 3) & 1; }

// Q (16·kMTiles, kHeadDim) of one warp as A fragments: (16, 16) per m tile and k step.
template <int kHeadDim, int kMTiles>
using QFragments = std::uint32_t[kHeadDim / 16][kMTiles][4];

template <int kHeadDim, int kMTiles>
__device__ __forceinline__ void load_q_fragment(std::uint32_t (&a)[kMTiles][4], const LdsmLane<kHeadDim>& q, int kk) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) ldmatrix_x4_at(a[mi], q.at(mi * 16, kk));
}

template <int kHeadDim, int kMTiles>
__device__ __forceinline__ void load_q_fragments(QFragments<kHeadDim, kMTiles>& a, const LdsmLane<kHeadDim>& q) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) load_q_fragment<kHeadDim>(a[kk], q, kk);
}

// s (16·kMTiles, 8·kNTiles) += Q · Kᵀ for head-dim step kk. Each K fragment feeds kMTiles MMAs.
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk_step(float (&s)[kMTiles][kNTiles][4], const std::uint32_t (&a)[kMTiles][4],
                                             const LdsmLane<kHeadDim>& k, int kk) {
  static_assert(kNTiles % 2 == 0, "K fragments are loaded two n8 tiles at a time");
#pragma unroll
  for (int np = 0; np < kNTiles / 2; ++np) {
    std::uint32_t b[4];  // (16, 16) of Kᵀ: b[0..1] n tile 2np, b[2..3] n tile 2np+1
    ldmatrix_x4_at(b, k.at(np * 16, kk));
    const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      mma_16816<T>(s[mi][2 * np], a[mi], b0);
      mma_16816<T>(s[mi][2 * np + 1], a[mi], b1);
    }
  }
}

// S = Q·Kᵀ with Q already in registers (loaded once per block).
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kNTiles][4], const QFragments<kHeadDim, kMTiles>& q,
                                        const LdsmLane<kHeadDim>& k) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) gemm_qk_step<T, kHeadDim>(s, q[kk], k, kk);
}

// S = Q·Kᵀ with Q re-read from shared memory each step: at 2 m tiles per warp Q in registers would
// be kHeadDim / 2 registers next to O's kHeadDim (hdim 128: 64 + 128 + S), more than 255.
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kNTiles][4], const LdsmLane<kHeadDim>& q,
                                        const LdsmLane<kHeadDim>& k) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    std::uint32_t a[kMTiles][4];
    load_q_fragment<kHeadDim>(a, q, kk);
    gemm_qk_step<T, kHeadDim>(s, a, k, kk);
  }
}

// o (16·kMTiles, kHeadDim) += P (16·kMTiles, 8·kNTiles) · V (kBlockN, kHeadDim). P comes from the
// score accumulator itself: the m16n8 accumulator layout of two adjacent n tiles is exactly the
// m16k16 A-operand layout, so P never leaves the registers. V is read with ldmatrix.trans.
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_pv(float (&o)[kMTiles][kHeadDim / 8][4], const float (&p)[kMTiles][kNTiles][4],
                                        const LdsmLane<kHeadDim>& v) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    std::uint32_t a[kMTiles][4];  // (16, 16) of P per m tile
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      a[mi][0] = pack2<T>(p[mi][2 * kk][0], p[mi][2 * kk][1]);
      a[mi][1] = pack2<T>(p[mi][2 * kk][2], p[mi][2 * kk][3]);
      a[mi][2] = pack2<T>(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
      a[mi][3] = pack2<T>(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < kHeadDim / 16; ++dp) {
      std::uint32_t b[4];  // (16 keys, 16 dims) of V: b[0..1] d tile 2dp, b[2..3] d tile 2dp+1
      ldmatrix_x4_trans_at(b, v.at(kk * 16, dp));
      const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        mma_16816<T>(o[mi][2 * dp], a[mi], b0);
        mma_16816<T>(o[mi][2 * dp + 1], a[mi], b1);
      }
    }
  }
}

}  // namespace flashmonoid::cuda
