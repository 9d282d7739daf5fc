// Arch-neutral device vocabulary for 2-byte element types: type traits, shared addresses,
// conversions and the XOR swizzle of 16-byte chunks that both the sm80 ldmatrix tiles and the sm90
// TMA/wgmma 128-byte-swizzled tiles use (chunk c of row r lands at c ^ (r % 8)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashmonoid::cuda {

template <class T> struct is_bf16 { static constexpr bool value = false; };
template <> struct is_bf16<__nv_bfloat16> { static constexpr bool value = true; };

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
// A 4-byte store to a shared-memory address (32-bit: cheaper to keep live than a generic pointer).
__device__ __forceinline__ void st_shared_u32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// A 16-byte store of four floats to a 16-byte-aligned shared-memory address.
__device__ __forceinline__ void st_shared_v4(std::uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Two floats -> one register of two T (low half = x), round to nearest.
template <class T> __device__ __forceinline__ std::uint32_t pack2(float x, float y) {
  if constexpr (is_bf16<T>::value) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&h);
  }
}

template <class T> __device__ __forceinline__ float to_float(T x) {
  if constexpr (is_bf16<T>::value) return __bfloat162float(x); else return __half2float(x);
}
template <class T> __device__ __forceinline__ T from_float(float x) {
  if constexpr (is_bf16<T>::value) return __float2bfloat16_rn(x); else return __float2half_rn(x);
}

// XOR swizzle of 16-byte chunks inside 128-byte rows (8 chunks): row r's chunk c lands at
// c ^ (r % 8), so the 8 rows an ldmatrix phase reads hit 8 different bank groups.
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) { return chunk ^ (row & 7); }

// Element offset of (row, col) in a swizzled (rows, kCols) row-major tile (sm80 layout: each row's
// 128-byte groups swizzled in place).
template <int kCols>
__device__ __forceinline__ int swizzled(int row, int col) {
  static_assert(kCols % 64 == 0, "swizzled tiles need rows of whole 128-byte lines (64 2-byte elements)");
  int chunk = col >> 3;
  int phys = (chunk & ~7) | swizzle_chunk(row, chunk & 7);
  return row * kCols + (phys << 3) + (col & 7);
}

// 4 x 4 transpose of 32-bit words across the 4 lanes of a quad (two shuffle rounds: 2 x 2 blocks, then
// the words inside them): lane q's word k becomes lane k's word q.
__device__ __forceinline__ void quad_transpose(std::uint32_t (&w)[4], int lane) {
  const bool hi = lane & 2, odd = lane & 1;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const std::uint32_t r = __shfl_xor_sync(0xffffffffu, hi ? w[k] : w[k + 2], 2);
    if (hi) w[k] = r; else w[k + 2] = r;
  }
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const std::uint32_t r = __shfl_xor_sync(0xffffffffu, odd ? w[k] : w[k + 1], 1);
    if (odd) w[k] = r; else w[k + 1] = r;
  }
}

// One row of a thread's m16n8 accumulator tiles (acc[nt][2·half], acc[nt][2·half + 1] hold columns
// 8·nt + 2·(lane % 4) and the next), times mul, stored as T to dst[col0 + column]. A quad holds 8
// columns of the row per tile, 4 bytes a lane; a quad transpose of 4 tiles gives each lane 16
// contiguous bytes, so a warp writes whole 32-byte sectors with a quarter of the store instructions
// (the sm90 forward's hdim-256 epilogue: ~7800 -> ~3400 cycles per tile, H100). Columns at or past
// d_valid (a multiple of 8) and rows with !valid are not written; every lane of the warp must call it.
template <class T, int kDTiles>
__device__ __forceinline__ void store_row_vec16(T* dst, const float (&acc)[kDTiles][4], int half, float mul, int col0,
                                                int d_valid, bool valid, int lane) {
  static_assert(kDTiles % 4 == 0, "the quad transpose takes 4 column tiles of 8 at a time");
#pragma unroll
  for (int d0 = 0; d0 < kDTiles; d0 += 4) {
    std::uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = pack2<T>(acc[d0 + k][2 * half] * mul, acc[d0 + k][2 * half + 1] * mul);
    quad_transpose(w, lane);
    const int col = col0 + (d0 + (lane & 3)) * 8;  // this lane's 8 columns
    if (valid && col < d_valid) *reinterpret_cast<uint4*>(dst + col) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Σ a[e]·b[e] over 8 elements that start 16-byte aligned (one vector load each): a row chunk of
// the backward's D = rowsum(dO∘O).
template <class T>
__device__ __forceinline__ float dot8(const T* a, const T* b) {
  const uint4 av = *reinterpret_cast<const uint4*>(a);
  const uint4 bv = *reinterpret_cast<const uint4*>(b);
  const T* ae = reinterpret_cast<const T*>(&av);
  const T* be = reinterpret_cast<const T*>(&bv);
  float acc = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc += to_float(ae[e]) * to_float(be[e]);
  return acc;
}

}  // namespace flashmonoid::cuda
