// The two products of the forward mainloop for one warp, on mma.sync m16n8k16 fragments.
// Fragment shapes: an accumulator acc[kMTiles][kNTiles][4] covers (16·kMTiles, 8·kNTiles) with
// the m16n8 layout of mma_sm80.cuh (c0,c1: row lane/4, c2,c3: row lane/4 + 8; columns
// 2·(lane%4) + {0,1}).
#pragma once

#include <cstdint>

#include "common/mma_sm80.cuh"
#include "common/smem_tile.cuh"

namespace flashmonoid::cuda {

// Q (16·kMTiles, kHeadDim) of one warp as A fragments: (16, 16) per m tile and k step.
template <int kHeadDim, int kMTiles>
using QFragments = std::uint32_t[kHeadDim / 16][kMTiles][4];

template <class T, int kHeadDim, int kMTiles>
__device__ __forceinline__ void load_q_fragment(std::uint32_t (&a)[kMTiles][4], const T* sQ, int q_row0, int kk,
                                                int lane) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
    ldmatrix_x4(a[mi], sQ + swizzled<kHeadDim>(q_row0 + mi * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
}

template <class T, int kHeadDim, int kMTiles>
__device__ __forceinline__ void load_q_fragments(QFragments<kHeadDim, kMTiles>& q, const T* sQ, int q_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) load_q_fragment<T, kHeadDim>(q[kk], sQ, q_row0, kk, lane);
}

// s (16·kMTiles, 8·kNTiles) += Q · K (rows k_row0.., kHeadDim)ᵀ for head-dim step kk: K read from
// swizzled shared memory with ldmatrix (K rows are the B operand's columns).
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk_step(float (&s)[kMTiles][kNTiles][4], const std::uint32_t (&a)[kMTiles][4],
                                             const T* sK, int k_row0, int kk, int lane) {
  static_assert(kNTiles % 2 == 0, "K fragments are loaded two n8 tiles at a time");
#pragma unroll
  for (int np = 0; np < kNTiles / 2; ++np) {
    std::uint32_t b[4];  // (16, 16) of Kᵀ: b[0..1] n tile 2np, b[2..3] n tile 2np+1
    ldmatrix_x4(b, sK + swizzled<kHeadDim>(k_row0 + np * 16 + (lane & 7) + (lane >> 4) * 8,
                                           kk * 16 + ((lane >> 3) & 1) * 8));
    const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      mma_16816<T>(s[mi][2 * np], a[mi], b0);
      mma_16816<T>(s[mi][2 * np + 1], a[mi], b1);
    }
  }
}

// S = Q·Kᵀ with Q already in registers (loaded once per block: hdim <= 128).
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kNTiles][4], const QFragments<kHeadDim, kMTiles>& q,
                                        const T* sK, int k_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) gemm_qk_step<T, kHeadDim>(s, q[kk], sK, k_row0, kk, lane);
}

// S = Q·Kᵀ with Q re-read from shared memory each step (hdim 256: Q in registers would be 64 more
// registers on top of a 128-register O).
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kNTiles][4], const T* sQ, int q_row0, const T* sK,
                                        int k_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    std::uint32_t a[kMTiles][4];
    load_q_fragment<T, kHeadDim>(a, sQ, q_row0, kk, lane);
    gemm_qk_step<T, kHeadDim>(s, a, sK, k_row0, kk, lane);
  }
}

// o (16·kMTiles, kHeadDim) += P (16·kMTiles, 8·kNTiles) · V (rows v_row0.., kHeadDim). P comes from
// the score accumulator itself: the m16n8 accumulator layout of two adjacent n tiles is exactly the
// m16k16 A-operand layout, so P never leaves the registers. V is read with ldmatrix.trans.
template <class T, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_pv(float (&o)[kMTiles][kHeadDim / 8][4], const float (&p)[kMTiles][kNTiles][4],
                                        const T* sV, int v_row0, int lane) {
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
      ldmatrix_x4_trans(b, sV + swizzled<kHeadDim>(v_row0 + kk * 16 + (lane & 15), dp * 16 + (lane >> 4) * 8));
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
