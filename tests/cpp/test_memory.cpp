// Peak extra host memory of a forward call, measured with a counting global operator new/delete
// (this test is its own executable, so the replacement affects nothing else). Flash must grow
// linearly in the sequence length (packed K/V plus per-thread tiles), the reference quadratically
// (it materialises the (s, s) scores of a head).
#include <gtest/gtest.h>

#include "counting_allocator.hpp"
#include "test_util.hpp"

namespace {

using flashmonoid::CpuAlgorithm;
using flashmonoid::DType;
using fmtest::HostTensor;

constexpr int kHeads = 2, kHeadDim = 32;

// Peak bytes allocated during one forward at sequence length s (inputs and outputs excluded).
std::int64_t peak_extra(int s, CpuAlgorithm algo) {
  HostTensor q(DType::f32, {1, s, kHeads, kHeadDim}), k(DType::f32, {1, s, kHeads, kHeadDim}),
      v(DType::f32, {1, s, kHeads, kHeadDim}), o(DType::f32, {1, s, kHeads, kHeadDim}), lse(DType::f32, {1, kHeads, s});
  for (HostTensor* t : {&q, &k, &v})
    t->fill_normal();
  flashmonoid::Context ctx;
  ctx.cpu_algorithm = algo;
  ctx.num_threads = 2;
  const counting::PeakScope scope;
  flashmonoid::forward(q.view, k.view, v.view, o.view, lse.view, {}, ctx);
  return scope.extra();
}

TEST(Memory, FlashForwardGrowsLinearly) {
  const std::int64_t m1 = peak_extra(1024, CpuAlgorithm::flash);
  const std::int64_t m2 = peak_extra(2048, CpuAlgorithm::flash);
  EXPECT_GT(m1, 0);
  EXPECT_LT(static_cast<double>(m2) / static_cast<double>(m1), 2.5) << m1 << " -> " << m2 << " bytes";
  // O(s·h·d): a few fp32 copies of K and V (2 · 2048·2·32·4 B = 1 MiB) plus per-thread tiles.
  EXPECT_LT(m2, 4 << 20) << m2 << " bytes at s = 2048";
}

TEST(Memory, ReferenceForwardGrowsQuadratically) {
  const std::int64_t m1 = peak_extra(512, CpuAlgorithm::reference);
  const std::int64_t m2 = peak_extra(1024, CpuAlgorithm::reference);
  EXPECT_GT(static_cast<double>(m2) / static_cast<double>(m1), 3.0) << m1 << " -> " << m2 << " bytes";
}

TEST(Memory, FlashUsesFarLessThanReference) {
  EXPECT_LT(20 * peak_extra(1024, CpuAlgorithm::flash), peak_extra(1024, CpuAlgorithm::reference));
}

}  // namespace
