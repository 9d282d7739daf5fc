// K/V tile loads of the sm80 forward for caches addressed through FwdParams::kv (forward_kvcache,
// paged varlen). A contiguous cache (with or without a batch index) keeps load_rows_async's one
// pointer and stride per thread. A paged cache is gathered one 16-byte cp.async per (row, chunk),
// so any page size >= 1 works and loads stay 16 bytes wide, with the block table read once per
// page per tile instead of once per row:
// - page_window: lane j of every warp reads the entries of the tile's j-th and (pages of 1 or 2
//   rows) (j + 32)-th pages (coalesced 4-byte loads), issued one mainloop step before the tile's
//   copies, so the copies never wait on the table;
// - load_paged_kv_async: each row's page comes from that lane by a shuffle, its row in the page
//   from shifts and masks (power-of-two pages) or one 32-bit division; K and V share the lookups.
//   Where a tile starts a page of 2-4 of a thread's rows (pages of 16 or 32 at hdim 64-128), one
//   lookup serves the page's copies.
// Rows of one sequence are ints (capacity is an int), so the row arithmetic is 32-bit; only
// page · batch stride is 64-bit. Tiles hold at most 64 rows, so a window covers the pages of any
// page size.
// Out-of-range safety, as detail::kv_offset: entries past the last page that holds a row below
// rows_valid are never read (their lanes hold 0 and their rows are zero-filled copies, which read
// nothing), and every page number read is clamped to [0, num_pages).
#pragma once

#include <cstdint>

#include "api/params.hpp"
#include "sm80/mma_sm80.cuh"
#include "sm80/smem_tile.cuh"

namespace flashmonoid::cuda {

// Row -> (page slot, row in page) for the cache's page size, in 32-bit unsigned arithmetic.
struct PageDiv {
  unsigned size;
  int shift;  // size == 2^shift, or -1: divide
  template <bool kPow2>
  __device__ __forceinline__ int page(int row) const {
    return static_cast<int>(kPow2 ? static_cast<unsigned>(row) >> shift : static_cast<unsigned>(row) / size);
  }
  template <bool kPow2>
  __device__ __forceinline__ int in_page(int row) const {
    return static_cast<int>(kPow2 ? static_cast<unsigned>(row) & (size - 1) : static_cast<unsigned>(row) % size);
  }
};

__device__ __forceinline__ PageDiv page_div(int page_size) {
  return {static_cast<unsigned>(page_size), (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1};
}

// Pages a window of kRows rows starting at `first` can touch: one more than kRows / page_size when
// unaligned (leftpad), so one lane per page fits a warp for pages of at least 3 rows at kRows = 64,
// and two lanes per page (PageWindow::hi) pages of 1 or 2 rows.
__device__ __forceinline__ int page_window_slots(int first_in_page, int rows, int page_size) {
  return (first_in_page + rows - 1) / page_size + 1;
}

// A lane's block-table entries of a tile's pages: lo of the tile's (lane)-th page, hi of its
// (lane + 32)-th (only tiles of more than 32 pages read it).
struct PageWindow {
  int lo = 0, hi = 0;
};
struct NoWindow {};  // a contiguous cache's tiles: nothing carried

// A predicated 4-byte load of *entry (0 where !read) with no use in this step: the compiler keeps it
// in flight across the step.
__device__ __forceinline__ int table_entry(const int* entry, bool read) {
  int page;
  asm("{\n .reg .pred r;\n setp.ne.b32 r, %2, 0;\n mov.b32 %0, 0;\n @r ld.global.nc.b32 %0, [%1];\n}\n"
      : "=r"(page)
      : "l"(entry), "r"(static_cast<int>(read)));
  return page;
}

// This lane's block-table entries for the tile of sequence b's rows [first, first + kRows), unclamped
// (load_paged_kv_async clamps each where it is used, so that these loads are not waited for until
// then); 0 for pages holding no row below rows_valid, which are not read. Every lane of the warp
// calls it; not for unpaged caches.
template <int kRows>
__device__ __forceinline__ PageWindow page_window(const detail::FwdParams& p, int b, int first, int rows_valid) {
  const detail::KvCacheParams& kv = p.kv;
  const int last = first + (rows_valid < kRows ? rows_valid : kRows) - 1;  // last row read
  const PageDiv pd = page_div(kv.page_size);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int slot0 = pd.shift >= 0 ? pd.page<true>(first) : pd.page<false>(first);
  const int slot_last = pd.shift >= 0 ? pd.page<true>(last) : pd.page<false>(last);
  const int* entry = kv.block_table + b * kv.block_table_stride + slot0 + lane;
  PageWindow w;
  w.lo = table_entry(entry, rows_valid > 0 && slot0 + lane <= slot_last);
  if constexpr (kRows > 32)  // pages of 1 or 2 rows: a 64-row tile spans up to 64 pages (33 unaligned)
    w.hi = table_entry(entry + 32, rows_valid > 0 && slot0 + 32 + lane <= slot_last);
  return w;
}

// Rows [first, first + kRows) of sequence b's keys and values, KV head hk, from the pages into the
// swizzled (kRows, kCols) tiles sk and sv; rows at or past rows_valid zero-filled. window is this
// lane's page_window(p, b, first, rows_valid), read by every lane of each warp.
template <int kRows, int kCols, int kThreads, class T>
__device__ __forceinline__ void load_paged_kv_async(T* sk, T* sv, const detail::FwdParams& p, int b, int hk,
                                                    int first, int rows_valid, PageWindow window) {
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const detail::KvCacheParams& kv = p.kv;
  const PageDiv pd = page_div(kv.page_size);
  const int first_in_page = pd.shift >= 0 ? pd.in_page<true>(first) : pd.in_page<false>(first);
  // A tile inside one page (pages of at least kRows rows, aligned or not): one strided copy each.
  if (first_in_page + kRows <= kv.page_size) {
    const std::int64_t page = detail::clamp_int(__shfl_sync(0xffffffffu, window.lo, 0), 0, kv.num_pages - 1);
    load_rows_async<kRows, kCols, kThreads>(
        sk, k + page * p.k_stride.batch + first_in_page * p.k_stride.row + hk * p.k_stride.head, p.k_stride.row,
        rows_valid, p.d);
    load_rows_async<kRows, kCols, kThreads>(
        sv, v + page * p.v_stride.batch + first_in_page * p.v_stride.row + hk * p.v_stride.head, p.v_stride.row,
        rows_valid, p.d);
    return;
  }
  constexpr int kChunks = kCols / 8;
  static_assert(kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0,
                "each thread must copy one chunk column of evenly spaced rows");
  constexpr int kRowStep = kThreads / kChunks;
  const int c = static_cast<int>(threadIdx.x) % kChunks, r0 = static_cast<int>(threadIdx.x) / kChunks;
  const bool col_ok = c * 8 < p.d;
  const T* k_head = k + hk * p.k_stride.head + c * 8;
  const T* v_head = v + hk * p.v_stride.head + c * 8;
  // page and row are >= 0: as unsigned 64-bit operands their products with the strides are one
  // wide 32 x 64 multiply each, with the same low 64 bits as the signed products.
  auto wide = [](int x) { return static_cast<std::uint64_t>(static_cast<unsigned>(x)); };
  // With kRowStep a multiple of 8 every copy of this thread has the same swizzle (row % 8).
  const int s0 = swizzled<kCols>(r0, c * 8);
  // Row r of the tile: row (first_in_page + r) % page_size of the tile's page
  // (first_in_page + r) / page_size, whose entry lane slot % 32 holds (in lo for the first 32 pages,
  // in hi for the next 32). A zero-fill copy reads nothing, so a row past rows_valid keeps its
  // address (in page 0 at worst): no select per copy. Without the selects and with the swizzle
  // hoisted: H100, b = 1 32k, append, 0.741 -> 0.770 of copy (contiguous 0.818), b = 8 4k 0.734 ->
  // 0.772.
  auto gather = [&](auto pow2, auto two_lanes) {
    constexpr bool kPow2 = decltype(pow2)::value, kWide = decltype(two_lanes)::value;
#pragma unroll
    for (int it = 0; it < kRows / kRowStep; ++it) {
      const int r = r0 + it * kRowStep;
      const bool ok = col_ok && r < rows_valid;
      const int slot = pd.page<kPow2>(first_in_page + r);
      int page;
      if constexpr (kWide) {  // both shuffles: the lanes of one copy may want lo and hi
        const int lo = __shfl_sync(0xffffffffu, window.lo, slot & 31);
        const int hi = __shfl_sync(0xffffffffu, window.hi, slot & 31);
        page = slot < 32 ? lo : hi;
      } else {
        page = __shfl_sync(0xffffffffu, window.lo, slot & 31);
      }
      page = detail::clamp_int(page, 0, kv.num_pages - 1);
      const int row = pd.in_page<kPow2>(first_in_page + r);
      const std::uint64_t k_off = wide(page) * p.k_stride.batch + wide(row) * p.k_stride.row;
      const std::uint64_t v_off = wide(page) * p.v_stride.batch + wide(row) * p.v_stride.row;
      const int s = kRowStep % 8 == 0 ? s0 + it * kRowStep * kCols : swizzled<kCols>(r, c * 8);
      cp_async_16(sk + s, k_head + k_off, ok);
      cp_async_16(sv + s, v_head + v_off, ok);
    }
  };
  // A tile that starts a page whose size is a power of two holding kGroup = page_size / kRowStep
  // (2, 4, ... < kRows / kRowStep) of this thread's rows: copy `it` is row (it % kGroup)·kRowStep
  // + r0 of the tile's page it / kGroup, so the page lookup and the 64-bit page offsets are made
  // once per page and a group's other copies add a loop-invariant row step (page 16 at hdim 128:
  // 2 copies per page, ~110 SASS instructions per tile's 16 copies against the gather's ~200 and a
  // contiguous cache's ~94). H100, x copy with append: page 16 b = 1 32k 0.808 -> 0.819, b = 8 4k
  // 0.814 -> 0.825, b = 1 128k 0.965 -> 0.971 (contiguous 0.844-0.845, 1.013): what page 16 still
  // loses is mostly not the copies' instructions, nor the pages' scatter (pages in pool order read
  // ~1.3% faster at 134 MB, H200; bench/NOTES.md has the block timelines of the rest).
  auto gather_pages = [&](auto group) {
    constexpr int kGroup = decltype(group)::value;
    const std::int64_t k_step = kRowStep * p.k_stride.row, v_step = kRowStep * p.v_stride.row;
    const T* k_row = k_head + wide(r0) * p.k_stride.row;
    const T* v_row = v_head + wide(r0) * p.v_stride.row;
#pragma unroll
    for (int g = 0; g < kRows / kRowStep / kGroup; ++g) {
      const int page = detail::clamp_int(__shfl_sync(0xffffffffu, window.lo, g), 0, kv.num_pages - 1);
      const T* kp = k_row + wide(page) * p.k_stride.batch;
      const T* vp = v_row + wide(page) * p.v_stride.batch;
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const int it = g * kGroup + j;
        const bool ok = col_ok && r0 + it * kRowStep < rows_valid;
        cp_async_16(sk + s0 + it * kRowStep * kCols, kp, ok);
        cp_async_16(sv + s0 + it * kRowStep * kCols, vp, ok);
        kp += k_step;
        vp += v_step;
      }
    }
  };
  // Pages of 2 or 4 of this thread's rows (a page size equal to kGroup·kRowStep is a power of two).
  // Not at hdim 256 (4-row steps): there the narrow tile's hoisted page offsets spilled 4 bytes
  // (ptxas, sm_90), and its 32-key tiles read pages of 32 and more in one copy already.
  auto grouped = [&](auto group) {
    constexpr int kGroup = decltype(group)::value;
    if constexpr (kRowStep % 8 == 0 && 2 * kGroup <= kRows / kRowStep) {
      if (kv.page_size == kGroup * kRowStep) {
        gather_pages(group);
        return true;
      }
    }
    return false;
  };
  if (first_in_page == 0 && (grouped(std::integral_constant<int, 2>{}) || grouped(std::integral_constant<int, 4>{})))
    return;
  static_assert(kRows <= 64, "a window holds the entries of 64 pages (two per lane)");
  if constexpr (kRows > 32) {
    if (page_window_slots(first_in_page, kRows, kv.page_size) > 32) {  // pages of 1 or 2 rows: powers of two
      gather(std::true_type{}, std::true_type{});
      return;
    }
  }
  if (pd.shift >= 0)
    gather(std::true_type{}, std::false_type{});
  else
    gather(std::false_type{}, std::false_type{});
}

}  // namespace flashmonoid::cuda
