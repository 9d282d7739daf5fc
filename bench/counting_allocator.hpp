// A counting global operator new/delete: live and peak heap bytes, for measuring the extra memory
// of an attention call (flashmonoid-bench and tests/cpp/test_memory.cpp). It replaces the
// program's allocation functions, so include it in exactly one translation unit of a program.
#pragma once

#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace counting {
inline std::atomic<std::int64_t> g_live{0}, g_peak{0};

inline void* alloc(std::size_t n, std::size_t align) {
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

inline void release(void* ptr) {
  if (ptr == nullptr) return;
  g_live.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(ptr)));
  std::free(ptr);
}

// Peak bytes allocated above the level at construction.
struct PeakScope {
  std::int64_t base = g_live.load();
  PeakScope() { g_peak.store(base); }
  std::int64_t extra() const { return g_peak.load() - base; }
};
}  // namespace counting

void* operator new(std::size_t n) {
  if (void* p = counting::alloc(n, 0)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (void* p = counting::alloc(n, static_cast<std::size_t>(a))) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counting::alloc(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counting::alloc(n, 0); }
void operator delete(void* p) noexcept { counting::release(p); }
void operator delete[](void* p) noexcept { counting::release(p); }
void operator delete(void* p, std::size_t) noexcept { counting::release(p); }
void operator delete[](void* p, std::size_t) noexcept { counting::release(p); }
void operator delete(void* p, std::align_val_t) noexcept { counting::release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counting::release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counting::release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counting::release(p); }
