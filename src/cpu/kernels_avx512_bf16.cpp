// The CPU kernels for AVX-512 with AVX512_BF16: kernels_avx512.cpp's table plus the products from
// bf16 pairs (VDPBF16PS) for bf16 inputs. CMakeLists.txt compiles this file alone with AVX-512 and
// AVX512_BF16 flags; nothing here may be called unless cpu_has(Isa::avx512_bf16).
//
// The tests also compile this file for AVX2 with FLASHMONOID_KERNELS_EMULATED defined: then
// simd_bf16.hpp emulates VDPBF16PS and VCVTNE2PS2BF16 exactly, and GCC lowers each 16-lane
// operation to two 8-lane ones, as kernels_avx512_bf16_emulated().
#include "cpu/kernels_impl.hpp"

namespace flashmonoid::cpu {

#ifdef FLASHMONOID_KERNELS_EMULATED
const Kernels& kernels_avx512_bf16_emulated() {
#else
const Kernels& kernels_avx512_bf16() {
#endif
  static constexpr Kernels k = kernels_impl::make_kernels<simd::f32x16, true>(Isa::avx512_bf16);
  return k;
}

}  // namespace flashmonoid::cpu
