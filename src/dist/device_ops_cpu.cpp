#include <string>

#include "cpu/numeric.hpp"
#include "dist/device_ops.hpp"
#include "flashmonoid/error.hpp"

namespace flashmonoid::dist {

void check_copy(const TensorView& dst, const TensorView& src) {
  if (dst.ndim != src.ndim || dst.ndim < 1 || dst.ndim > 4)
    throw Error("dst", "copy needs views of equal rank 1..4, got " + std::to_string(dst.ndim) + " and " +
                           std::to_string(src.ndim));
  for (int i = 0; i < dst.ndim; ++i)
    if (dst.shape[i] != src.shape[i]) throw Error("dst", "copy needs equal shapes (dimension " + std::to_string(i) + ")");
  if (dst.dtype == DType::i32 || src.dtype == DType::i32) throw Error("dst", "copy is for float dtypes");
}

void CpuOps::copy(const TensorView& dst, const TensorView& src, bool accumulate) {
  check_copy(dst, src);
  const View4 d(dst), s(src);
  for (std::int64_t i = 0, n = d.numel(); i < n; ++i) {
    const std::int64_t od = d.offset(i);
    const float x = cpu::load(s.data, s.dtype, s.offset(i));
    cpu::store(d.data, d.dtype, od, accumulate ? cpu::load(d.data, d.dtype, od) + x : x);
  }
}

void CpuOps::fill(const TensorView& dst, float value) {
  const View4 d(dst);
  for (std::int64_t i = 0, n = d.numel(); i < n; ++i) cpu::store(d.data, d.dtype, d.offset(i), value);
}

}  // namespace flashmonoid::dist
