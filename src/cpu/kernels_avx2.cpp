// The CPU kernels for AVX2 + FMA (x86-64-v3): the generic source at 8 lanes.
#include "cpu/kernels_impl.hpp"

namespace flashmonoid::cpu {

const Kernels& kernels_avx2() {
  static constexpr Kernels k = kernels_impl::make_kernels<simd::f32x8>(Isa::avx2);
  return k;
}

}  // namespace flashmonoid::cpu
