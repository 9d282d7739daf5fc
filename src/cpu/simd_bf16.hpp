// bf16 pair arithmetic of the CPU flash path: the dot product of bf16 pairs (VDPBF16PS) and the
// conversion of fp32 rows to bf16 (VCVTNE2PS2BF16). Compiled with -mavx512bf16
// (src/cpu/kernels_avx512_bf16.cpp) these are the instructions; compiled without (the tests' build
// of the same file for AVX2) they are exact emulations of Intel's pseudo-code, so that the bf16
// kernels run, and are checked against float64, on any CPU.
//
// A pair is two bf16 in one 32-bit lane, the first element (even index along the summed dimension)
// in the low half: element (2j, 2j + 1) of a row is lane j, as VDPBF16PS and VCVTNE2PS2BF16 lay them.
//
// Internal linkage throughout, for the reason given in simd.hpp.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/numeric.hpp"
#include "cpu/simd.hpp"

namespace flashmonoid::cpu::simd {
namespace {

typedef std::uint32_t u32x8 __attribute__((vector_size(32)));
typedef std::uint32_t u32x16 __attribute__((vector_size(64)));

// The unsigned 32-bit vector of V's shape: pairs of bf16, and the bits of V's floats. (An alias
// template cannot carry vector_size: GCC drops the attribute on a dependent type.)
template <class V>
using u32_of = std::conditional_t<lanes<V> == 16, u32x16, u32x8>;

// lanes<V> pairs from p, unaligned.
template <class V>
inline u32_of<V> load_pairs(const void* p) {
  u32_of<V> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#ifndef __AVX512BF16__
// x with a zero or denormal value replaced by zero of its sign: the "denormals are zero" of
// VDPBF16PS's inputs and, applied to a result, its "flush to zero" (tininess after rounding, as x86
// detects it, differs from flushing the gradually-underflowed result only for exact results within
// half a denormal ulp below 2^-126).
template <class V>
inline V flush_denormal(V x) {
  const u32_of<V> u = (u32_of<V>)x;
  return (V)((u & 0x7F800000u) == 0 ? u & 0x80000000u : u);
}
#endif

// acc + a.hi·b.hi + a.lo·b.lo per lane, as VDPBF16PS computes it (Intel SDM): two fp32 FMAs, the
// high halves' product first, each rounded to nearest even, with denormal inputs (the bf16 values
// and the accumulator) read as zero and denormal results flushed to zero; MXCSR is not used.
// bf16·bf16 is exact in fp32 (8 + 8 significand bits), so each FMA is the exact sum rounded once.
// The emulation propagates NaN and infinity but not Intel's choice among several NaN payloads.
template <class V>
inline V dot_bf16_pairs(V acc, u32_of<V> a, u32_of<V> b) {
#ifdef __AVX512BF16__
  if constexpr (lanes<V> == 16)
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  else
    return _mm256_dpbf16_ps(acc, (__m256bh)a, (__m256bh)b);
#else
  const V a_hi = (V)(a & 0xFFFF0000u), b_hi = (V)(b & 0xFFFF0000u);
  const V a_lo = (V)(a << 16), b_lo = (V)(b << 16);
  // Contracted to one FMA each (-ffp-contract=fast), so a product that underflows is not rounded
  // on its own either.
  acc = flush_denormal(flush_denormal(a_hi) * flush_denormal(b_hi) + flush_denormal(acc));
  return flush_denormal(flush_denormal(a_lo) * flush_denormal(b_lo) + acc);
#endif
}

#ifndef __AVX512BF16__
// x rounded to bf16 as VCVTNE2PS2BF16 does (Intel SDM, convert_fp32_to_bfloat16): zero and
// denormals to zero of their sign, NaN quieted (its upper 16 bits with the quiet bit set),
// everything else rounded to nearest even. float_to_bf16 (numeric.hpp), the storage conversion,
// rounds denormals instead of flushing them; otherwise the two agree.
inline std::uint16_t bf16_flush_denormal(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7F800000u) == 0) return static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  return float_to_bf16(x);
}
#endif

// pairs[j] <- (bf16(x[2j]), bf16(x[2j + 1])) for 2j < n, n a multiple of 16, rounded as
// bf16_flush_denormal says.
inline void to_bf16_pairs(const float* x, int n, std::uint32_t* pairs) {
#ifdef __AVX512BF16__
  int c = 0;
  for (; c + 32 <= n; c += 32)
    _mm512_storeu_si512(pairs + c / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c)));
  if (c < n)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + c / 2),
                        (__m256i)_mm256_cvtne2ps_pbh(_mm256_loadu_ps(x + c + 8), _mm256_loadu_ps(x + c)));
#else
  for (int c = 0; c < n; c += 2)
    pairs[c / 2] = bf16_flush_denormal(x[c]) | static_cast<std::uint32_t>(bf16_flush_denormal(x[c + 1])) << 16;
#endif
}

}  // namespace
}  // namespace flashmonoid::cpu::simd
