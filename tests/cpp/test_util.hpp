// Shared test helpers: host tensors with fresh random data, NaN-poisoned outputs, comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <limits>
#include <random>
#include <vector>

#include "cpu/numeric.hpp"
#include "flashmonoid/flashmonoid.hpp"

namespace fmtest {

using flashmonoid::DType;
using flashmonoid::TensorView;

// Fresh random inputs in every process, from a seed printed once to stderr; FM_TEST_SEED=<seed> with
// the same test filter draws the same inputs again (to tell an input that the tolerance rule is
// unlucky on from a fault that depends on timing, e.g. under compute-sanitizer).
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    const char* env = std::getenv("FM_TEST_SEED");
    std::random_device rd;
    const std::uint64_t s = env ? std::strtoull(env, nullptr, 10) : (std::uint64_t{rd()} << 32) ^ rd();
    std::fprintf(stderr, "fmtest: random inputs from seed %llu (FM_TEST_SEED=%llu draws them again)\n",
                 static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

inline std::mt19937_64& rng() {
  static std::mt19937_64 g(test_seed());
  return g;
}

// Owns host memory and a (possibly strided) view over it.
struct HostTensor {
  std::vector<std::uint8_t> buf;
  TensorView view;

  HostTensor() = default;
  HostTensor(DType t, std::vector<std::int64_t> dims, std::vector<std::int64_t> strides = {}) {
    view.dtype = t;
    view.device = flashmonoid::Device::cpu();
    view.ndim = static_cast<int>(dims.size());
    std::int64_t st = 1, span = 1;
    for (int i = view.ndim - 1; i >= 0; --i) {
      view.shape[i] = dims[i];
      view.stride[i] = strides.empty() ? st : strides[i];
      st *= dims[i];
    }
    for (int i = 0; i < view.ndim; ++i) span += (dims[i] - 1) * view.stride[i];
    buf.assign(static_cast<std::size_t>(std::max<std::int64_t>(span, 1)) * flashmonoid::dtype_size(t), 0);
    view.data = buf.data();
  }
  // Byte offset of a logical index into buf.
  std::int64_t offset(std::int64_t linear) const {
    std::int64_t off = 0;
    for (int i = view.ndim - 1; i >= 0; --i) {
      off += (linear % view.shape[i]) * view.stride[i];
      linear /= view.shape[i];
    }
    return off;
  }
  float get(std::int64_t linear) const { return flashmonoid::cpu::load(view.data, view.dtype, offset(linear)); }
  void set(std::int64_t linear, float x) { flashmonoid::cpu::store(view.data, view.dtype, offset(linear), x); }
  std::int64_t numel() const { return view.numel(); }
  std::vector<double> values() const {
    std::vector<double> v(numel());
    for (std::int64_t i = 0; i < numel(); ++i) v[i] = get(i);
    return v;
  }
  void fill_normal(double stddev = 1.0) {
    std::normal_distribution<float> n(0.0f, static_cast<float>(stddev));
    for (std::int64_t i = 0; i < numel(); ++i) set(i, n(rng()));
  }
  void poison() {
    for (std::int64_t i = 0; i < numel(); ++i) set(i, std::numeric_limits<float>::quiet_NaN());
  }
};

// Max |a - b| over elements, treating equal infinities as 0 and any NaN as infinite error.
inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    m = std::max(m, std::abs(a[i] - b[i]));
  }
  return m;
}

inline double max_abs(const std::vector<double>& a) {
  double m = 0.0;
  for (double x : a)
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

// Rounding unit of a storage dtype: the error of merely storing an exact result.
inline double unit_roundoff(DType t) {
  return t == DType::f16 ? 0x1p-11 : t == DType::bf16 ? 0x1p-8 : 0x1p-24;
}

// The FlashAttention rule: fp32 within rel_fp32 of the float64 reference; fp16/bf16 within 2x the
// error of the same math done in that dtype. Errors are measured against the larger of the
// reference's magnitude and 1 (the inputs are O(1)), so that an exactly-zero reference (a single
// key, a fully masked row) still admits the rounding of the fp32 accumulation. The 16-bit budget
// also admits two rounding units of the output at that magnitude, since the same-dtype math can
// be exact by luck (e.g. one key: P = 1) while storing the result costs a rounding.
inline void expect_close(const char* what, DType dtype, const std::vector<double>& got, const std::vector<double>& ref,
                         const std::vector<double>& lowp, double rel_fp32 = 1e-5) {
  const double err = max_abs_diff(got, ref);
  const double scale = std::max(max_abs(ref), 1.0);
  if (dtype == DType::f32) {
    EXPECT_LE(err, rel_fp32 * scale) << what << ": fp32 max error " << err << " vs reference magnitude " << scale;
  } else {
    const double budget = 2.0 * max_abs_diff(lowp, ref) + 2.0 * unit_roundoff(dtype) * scale;
    EXPECT_LE(err, budget) << what << ": max error " << err << " > 2x the " << flashmonoid::to_string(dtype)
                           << " reference's error (" << max_abs_diff(lowp, ref) << ") + storage rounding";
  }
}

// fn must throw flashmonoid::Error naming `argument`, with `rule` in its message.
inline void expect_error(const std::function<void()>& fn, const std::string& argument, const std::string& rule) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << argument << " (" << rule << ")";
  } catch (const flashmonoid::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(rule), std::string::npos) << "message '" << e.what() << "' lacks '" << rule << "'";
  }
}

}  // namespace fmtest
