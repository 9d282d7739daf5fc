// Host conversions between fp32 and the 16-bit storage types, round-to-nearest-even, so that CPU
// code reads and writes fp16/bf16 tensors exactly as the GPU's cvt instructions do.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashmonoid/tensor.hpp"

namespace flashmonoid::cpu {

inline float bf16_to_float(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // keep NaN a (quiet) NaN
  u += 0x7FFFu + ((u >> 16) & 1u);                                          // round to nearest even
  return static_cast<std::uint16_t>(u >> 16);
}

inline float half_to_float(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  std::uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | static_cast<std::uint32_t>(127 - 15 - e) << 23 | (mant & 0x3FFu) << 13;
    }
  } else if (exp == 0x1F) {
    u = sign | 0x7F800000u | mant << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_half(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  std::uint32_t sign = (u >> 16) & 0x8000u;
  std::uint32_t abs = u & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0));
  if (abs >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds past 65504: inf
  if (abs < 0x38800000u) {                                                      // fp16 subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);          // below half the smallest
    std::uint32_t e = abs >> 23, m = (abs & 0x7FFFFFu) | 0x800000u;
    std::uint32_t shift = 126 - e;  // 113 - e + 13
    std::uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xFFFu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

inline float load(const void* base, DType t, std::int64_t i) {
  switch (t) {
    case DType::f16: return half_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

inline void store(void* base, DType t, std::int64_t i, float x) {
  switch (t) {
    case DType::f16: static_cast<std::uint16_t*>(base)[i] = float_to_half(x); break;
    case DType::bf16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(x); break;
    default: static_cast<float*>(base)[i] = x;
  }
}

// x rounded to the precision of dtype t (identity for fp32).
inline float round_to(DType t, float x) {
  switch (t) {
    case DType::f16: return half_to_float(float_to_half(x));
    case DType::bf16: return bf16_to_float(float_to_bf16(x));
    default: return x;
  }
}

}  // namespace flashmonoid::cpu
