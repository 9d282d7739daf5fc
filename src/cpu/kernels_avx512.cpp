// The CPU kernels for AVX-512 (F, BW, VL, DQ): the generic source at 16 lanes. CMakeLists.txt
// compiles this file alone with AVX-512 flags; nothing here may be called unless
// cpu_has(Isa::avx512).
//
// The tests also compile this file for AVX2 with FLASHMONOID_KERNELS_EMULATED defined, where
// GCC lowers each 16-lane operation to two 8-lane ones: the same source then runs (and is checked
// against the float64 reference) on CPUs without AVX-512, as kernels_avx512_emulated().
#include "cpu/kernels_impl.hpp"

namespace flashmonoid::cpu {

#ifdef FLASHMONOID_KERNELS_EMULATED
const Kernels& kernels_avx512_emulated() {
#else
const Kernels& kernels_avx512() {
#endif
  static constexpr Kernels k = kernels_impl::make_kernels<simd::f32x16>(Isa::avx512);
  return k;
}

}  // namespace flashmonoid::cpu
