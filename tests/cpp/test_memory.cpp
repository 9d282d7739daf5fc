// Peak extra host memory of a forward call, measured with a counting global operator new/delete
// (this test is its own executable, so the replacement affects nothing else). Flash must grow
// linearly in the sequence length (packed K/V plus per-thread tiles), the reference quadratically
// (it materialises the (s, s) scores of a head).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <malloc.h>
#include <new>

#include "test_util.hpp"

namespace {
std::atomic<std::int64_t> g_live{0}, g_peak{0};

void* counted_alloc(std::size_t n, std::size_t align) {
  void* ptr = nullptr;
  if (align > alignof(std::max_align_t)) {
    if (posix_memalign(&ptr, align, n == 0 ? 1 : n) != 0) return nullptr;
  } else {
    ptr = std::malloc(n == 0 ? 1 : n);
    if (ptr == nullptr) return nullptr;
  }
  const auto size = static_cast<std::int64_t>(malloc_usable_size(ptr));
  const std::int64_t live = g_live.fetch_add(size) + size;
  std::int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return ptr;
}

void counted_free(void* ptr) {
  if (ptr == nullptr) return;
  g_live.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(ptr)));
  std::free(ptr);
}
}  // namespace

void* operator new(std::size_t n) {
  if (void* p = counted_alloc(n, 0)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (void* p = counted_alloc(n, static_cast<std::size_t>(a))) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n, 0); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }

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
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, std::sin(0.37f * static_cast<float>(i)));
  flashmonoid::Context ctx;
  ctx.cpu_algorithm = algo;
  ctx.num_threads = 2;
  const std::int64_t base = g_live.load();
  g_peak.store(base);
  flashmonoid::forward(q.view, k.view, v.view, o.view, lse.view, {}, ctx);
  return g_peak.load() - base;
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
