// K/V tile loads of the sm80 forward for caches addressed through FwdParams::kv (forward_kvcache,
// paged varlen). A contiguous cache (with or without a batch index) keeps load_rows_async's one
// pointer and stride per thread; a paged cache gathers each row through the block table
// (detail::kv_offset), still one 16-byte cp.async per (row, chunk), so any page size >= 1 works
// and a row never straddles pages; a tile that lies inside one page takes one lookup. Rows at or past rows_valid are zero-filled without reading the
// block table, so an entry past a sequence's last page is never touched; page numbers read from
// the table are clamped to [0, num_pages) by kv_offset.
#pragma once

#include <cstdint>

#include "api/params.hpp"
#include "sm80/mma_sm80.cuh"
#include "sm80/smem_tile.cuh"

namespace flashmonoid::cuda {

// Rows [key0, key0 + kRows) of sequence b's keys (or values: base, st) of KV head hk into a
// swizzled (kRows, kCols) tile. seq is the sequence's row 0 when the cache is not paged.
template <int kRows, int kCols, int kThreads, class T>
__device__ __forceinline__ void load_kv_rows_async(T* smem, const detail::FwdParams& p, const T* base, const T* seq,
                                                   const detail::Strides& st, int b, int hk, std::int64_t row0,
                                                   int key0, int rows_valid) {
  if (p.kv.block_table == nullptr) {
    load_rows_async<kRows, kCols, kThreads>(smem, seq + static_cast<std::int64_t>(key0) * st.row, st.row, rows_valid,
                                            p.d);
    return;
  }
  // A tile inside one page (pages of at least kRows rows, aligned or not) is one strided copy after
  // one lookup. rows_valid > 0 keeps the lookup within the sequence's pages.
  const std::int64_t first = row0 + key0;
  if (rows_valid > 0 && first % p.kv.page_size + kRows <= p.kv.page_size) {
    load_rows_async<kRows, kCols, kThreads>(smem, base + detail::kv_offset(p, st, b, first, hk), st.row, rows_valid,
                                            p.d);
    return;
  }
  constexpr int kChunks = kCols / 8;
  static_assert(kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0,
                "each thread must copy one chunk column of evenly spaced rows");
  constexpr int kRowStep = kThreads / kChunks;
  const int c = static_cast<int>(threadIdx.x) % kChunks, r0 = static_cast<int>(threadIdx.x) / kChunks;
  const bool col_ok = c * 8 < p.d;
#pragma unroll
  for (int it = 0; it < kRows / kRowStep; ++it) {
    const int r = r0 + it * kRowStep;
    const bool ok = col_ok && r < rows_valid;
    const T* g = ok ? base + detail::kv_offset(p, st, b, row0 + key0 + r, hk) + c * 8 : base;
    cp_async_16(smem + swizzled<kCols>(r, c * 8), g, ok);
  }
}

}  // namespace flashmonoid::cuda
