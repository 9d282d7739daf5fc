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
