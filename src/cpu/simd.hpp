// Width-generic fp32 vector operations of the CPU flash path, written with GCC vector extensions
// so that one source serves every ISA: f32x8 compiles to AVX2 ymm code under x86-64-v3 and f32x16
// to zmm code in the AVX-512 translation unit (src/cpu/kernels_avx512.cpp). __m256 and __m512 are
// the same GCC vector types, so intrinsics code can call these directly.
//
// Everything here has internal linkage (anonymous namespace): a translation unit compiled with
// AVX-512 flags must never share an inline function with the x86-64-v3 ones, or the linker could
// keep its AVX-512 copy for everybody and the library would fault on AVX2-only CPUs.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace flashmonoid::cpu::simd {
namespace {

typedef float f32x2 __attribute__((vector_size(8)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));

template <class V>
constexpr int lanes = static_cast<int>(sizeof(V) / sizeof(float));

// log2(e): natural-unit scores times this are the log2 units of the softmax state.
constexpr float kLog2e = 1.44269504088896341f;

// The int32 vector of V's shape: what comparisons return and what bit casts go through.
template <class V>
using int_of = decltype(V{} < V{});

template <class V>
inline V loadu(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <class V>
inline void storeu(float* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

// x - 0 is x for every x (-0 included), so GCC folds this to a plain broadcast.
template <class V>
inline V splat(float x) {
  return x - V{};
}

// a > b ? a : b per lane (b where either is NaN): x86's maxps, one instruction. GCC turns the
// expression into a compare and a blend (AVX-512: a compare into a mask and a masked move) in some
// contexts (simd::exp2's clamp), hence the intrinsics where the width has one; same results.
template <class V>
inline V vmax(V a, V b) {
#ifdef __AVX512F__
  // The all-lanes mask form: _mm512_max_ps passes an undefined source that GCC 12 warns about.
  if constexpr (lanes<V> == 16) return _mm512_mask_max_ps(a, static_cast<__mmask16>(0xFFFF), a, b);
#endif
#ifdef __AVX__
  if constexpr (lanes<V> == 8) return _mm256_max_ps(a, b);
#endif
  return a > b ? a : b;
}

// The lower (H = 0) or upper (H = 1) half of v, in registers (shuffles, no trip through memory).
template <int H, class V>
inline auto half(V v) {
  constexpr int o = H * lanes<V> / 2;
  if constexpr (lanes<V> == 16) return __builtin_shufflevector(v, v, o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7);
  else if constexpr (lanes<V> == 8) return __builtin_shufflevector(v, v, o, o + 1, o + 2, o + 3);
  else if constexpr (lanes<V> == 4) return __builtin_shufflevector(v, v, o, o + 1);
  else return v[o];
}

// Halving trees, lane i with lane i + lanes/2 at each level: a fixed order of operations for each
// width. (A scalar loop over the lanes, or a trip through memory, was a 15-deep chain of scalar
// maxima per row and store-forwarding stalls: the forward's rows spent as long reducing as in the
// exponential.)
template <class V>
inline float reduce_max(V v) {
  if constexpr (lanes<V> == 1) {
    return v;
  } else {
    const auto lo = half<0>(v), hi = half<1>(v);
    return reduce_max(hi > lo ? hi : lo);
  }
}

template <class V>
inline float reduce_sum(V v) {
  if constexpr (lanes<V> == 1) return v;
  else return reduce_sum(half<0>(v) + half<1>(v));
}

// exp(x) per lane, within 1 ulp of the exact value over [-87.3, 88.3] (every 97th float of that
// range checked against float64 by tests/cpp/test_cpu_kernels.cpp: 0.92 ulp at most); exactly 0 below
// -87.3 (so exp(-inf) = 0, which masked scores need; the true value there is < 1.2e-38).
// x = n·ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series to degree 7 (truncation error
// r^8/8! < 6e-9 relative), 2^n built in the exponent bits. The flash path's softmaxes use exp2
// below (scores in log2 units); this one serves tanh (tiles::tanh8) and the unfused baseline.
template <class V>
inline V exp(V x) {
  using I = int_of<V>;
  const I underflow = x < -87.3f;
  x = x < -87.3f ? splat<V>(-87.3f) : x;
  x = x > 88.3f ? splat<V>(88.3f) : x;
  // Adding 1.5·2^23 rounds x·log2(e) to the nearest integer, which lands in the low mantissa bits.
  const float shifter = 12582912.0f;
  const V t = x * kLog2e + shifter;
  const V n = t - shifter;
  // ln2 split in two floats so that n·ln2 is subtracted without losing r's low bits.
  V r = x - n * 0.693147182464599609375f;
  r = r - n * -1.904654323148236e-09f;
  V p = splat<V>(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I two_n = ((I)t - (I)splat<V>(shifter) + 127) << 23;
  return (V)((I)(p * (V)two_n) & ~underflow);
}

// 2^x per lane for x <= 8, the softmax's exponential (scores in log2 units, minus their running
// max, which lags the true max by up to 8 in the forward, or minus lse): within 0.95 ulp of the
// exact value wherever that is a normal float (every float of [-126, 8] checked against float64
// once, 0.948 ulp at most; every 97th by tests/cpp/test_cpu_kernels.cpp); exactly 0 at and below
// -126.5 (so 2^-inf = 0, which masked
// scores need), NaN stays NaN. x = n + f with n = round(x), f = x - n exact and |f| <= 1/2; 2^f by
// a degree-6 polynomial fitted to its relative error (1.9e-9 in float64); 2^n built in the exponent
// bits. Against exp() above: no multiply by log2(e), no two-part reduction, no upper clamp nor
// underflow mask (n = -127 gives the exponent field 0, i.e. the factor 0): 13 instructions per
// vector instead of 21.
template <class V>
inline V exp2(V x) {
  using I = int_of<V>;
  // vmax(-127, x): a NaN x compares false and passes through.
  x = vmax(splat<V>(-127.0f), x);
  // Adding 1.5·2^23 rounds x to the nearest integer n, which lands in the low mantissa bits; the
  // extra 127 biases it, so that t's bits shifted left by 23 are those of the float 2^n.
  const float shifter = 12582912.0f + 127.0f;
  const V t = x + shifter;
  const V f = x - (t - shifter);
  V p = splat<V>(1.53458110e-4f);
  p = p * f + 1.33999309e-3f;
  p = p * f + 9.61848907e-3f;
  p = p * f + 5.55032864e-2f;
  p = p * f + 2.40226462e-1f;
  p = p * f + 6.93147182e-1f;
  p = p * f + 1.0f;
  return p * (V)((I)t << 23);
}

}  // namespace
}  // namespace flashmonoid::cpu::simd
