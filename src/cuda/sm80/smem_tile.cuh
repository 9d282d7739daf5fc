// Shared-memory tiles of 2-byte elements, (rows, kCols) row-major with kCols a multiple of 64 (one
// 128-byte line or more per row), the 16-byte chunks of each 128-byte group XOR-swizzled by the row
// (common/types.cuh: swizzle_chunk). An ldmatrix phase reads one chunk column from 8 consecutive rows;
// the swizzle sends those 8 chunks to 8 different bank groups, so it is conflict-free, and the
// 16-byte cp.async writes stay whole.
#pragma once

#include <cstdint>

#include "sm80/mma_sm80.cuh"

namespace flashmonoid::cuda {

// Byte offsets in a swizzled (rows, kCols) tile, for ldmatrix and fragment stores. A lane's row
// address is computed once per operand (lane_offset); the offset of a fragment dr rows and dc
// 16-byte chunks further is then an XOR and an add of constants (step) instead of a fresh swizzle
// per address. The offsets exclude the tile's base, so one offset serves every tile of the same
// shape (K and V, Q and dO): base + step(off, dr, dc). With the backward's mainloop unrolled,
// per-address swizzles kept ~100 addresses live and spilled at hdim 128 (ptxas, 255 registers,
// 160 bytes of stack).
template <int kCols>
struct SwizzledOffset {
  static constexpr int kRowBytes = kCols * 2;
  static_assert(kRowBytes % 128 == 0, "the swizzle's chunk bits (4-6) must not carry into the row");
  __device__ static __forceinline__ std::uint32_t lane_offset(int row, int chunk) {
    return row * kRowBytes + (chunk & ~7) * 16 + (((chunk ^ row) & 7) << 4);
  }
  // Offset of (row + dr, chunk + dc) from lane_offset(row, chunk): dr a multiple of 8 and the low
  // three bits of dc disjoint from those of chunk, so adding dc to the chunk is an XOR.
  __device__ static __forceinline__ std::uint32_t step(std::uint32_t off, int dr, int dc) {
    return (off ^ ((dc & 7) << 4)) + dr * kRowBytes + (dc & ~7) * 16;
  }
};

// Queue the copy of a (kRows, kCols) tile into shared memory, 16 bytes per cp.async, by all
// kThreads threads. row_ptr(r) gives row r's global address or nullptr for a row outside the
// tensor; columns at or past cols_valid (the true head dim, a multiple of 8) and missing rows are
// zero-filled, so padded head dims and ragged tiles contribute exact zeros to the products.
template <int kRows, int kCols, int kThreads, class T, class RowPtr>
__device__ __forceinline__ void load_tile_async(T* smem, RowPtr row_ptr, int cols_valid, const T* any_valid) {
  constexpr int kChunks = kCols / 8;
  static_assert((kRows * kChunks) % kThreads == 0, "tile chunks must divide evenly among the threads");
#pragma unroll
  for (int it = 0; it < kRows * kChunks / kThreads; ++it) {
    int idx = it * kThreads + static_cast<int>(threadIdx.x);
    int r = idx / kChunks, c = idx % kChunks;
    const T* g = row_ptr(r);
    bool ok = g != nullptr && c * 8 < cols_valid;
    cp_async_16(smem + swizzled<kCols>(r, c * 8), ok ? g + c * 8 : any_valid, ok);
  }
}

// The same for a tile whose rows are evenly spaced in global memory (K and V): row r at
// row0 + r·row_stride, rows at or past rows_valid missing. Each thread's chunk column is fixed
// (kThreads is a multiple of the chunks per row), so it keeps one pointer and one stride instead
// of a pointer per row, which the mainloop would otherwise hold in registers across iterations.
template <int kRows, int kCols, int kThreads, class T>
__device__ __forceinline__ void load_rows_async(T* smem, const T* row0, std::int64_t row_stride, int rows_valid,
                                                int cols_valid) {
  constexpr int kChunks = kCols / 8;
  static_assert(kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0,
                "each thread must copy one chunk column of evenly spaced rows");
  constexpr int kRowStep = kThreads / kChunks;
  const int c = static_cast<int>(threadIdx.x) % kChunks, r0 = static_cast<int>(threadIdx.x) / kChunks;
  const bool col_ok = c * 8 < cols_valid;
  // A running pointer: per copy one 64-bit add of a loop-invariant step. Per-row offsets
  // it·kRowStep·row_stride were hoisted out of the mainloop by the compiler and spilled.
  const T* g = row0 + r0 * row_stride + c * 8;
  const std::int64_t step = kRowStep * row_stride;
  // With kRowStep a multiple of 8 every copy of this thread has the same swizzle (row % 8), so the
  // shared addresses are one register plus immediates.
  T* dst = smem + swizzled<kCols>(r0, c * 8);
#pragma unroll
  for (int it = 0; it < kRows / kRowStep; ++it) {
    const int r = r0 + it * kRowStep;
    T* d = kRowStep % 8 == 0 ? dst + it * kRowStep * kCols : smem + swizzled<kCols>(r, c * 8);
    // A zero-fill copy reads nothing, so g may point past the tensor there (as CUTLASS's zfill).
    cp_async_16(d, g, col_ok && r < rows_valid);
    g += step;
  }
}

// load_rows_async for a row step that is a multiple of 8 (the backward's K, V, Q and dO tiles),
// with fewer live registers: row r at row0 + r·row_stride, rows at or past rows_valid missing. Each thread copies
// the same chunk column of rows r0 + it·kRowStep (kThreads is a multiple of the chunks per row),
// so its swizzle is the same for all of them and only one shared and one global address are live
// per tile (per-chunk addresses cost ~50 registers at hdim 256 when the compiler hoisted them out
// of the backward's mainloop), and the column and row tests are one int, rows_left. Per-copy
// products and separate tests took ~16 SASS instructions per cp.async (backward hdim 256: 262 for
// the 16 Q/dO copies of a step, now 203).
template <int kRows, int kCols, int kThreads, class T>
__device__ __forceinline__ void load_rows_async_folded(T* smem, const T* row0, std::int64_t row_stride, int rows_valid,
                                                int cols_valid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0,
                "each thread must copy one chunk column of evenly spaced rows, 8-row aligned for the swizzle");
  const int r0 = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks * 8;
  const std::uint32_t dst = smem_addr(smem + swizzled<kCols>(r0, c));
  const T* src = row0 + r0 * row_stride + c;
  const std::int64_t step = kRowStep * row_stride;
  // load_rows_async's separate tests held a flag and a bound per tile; in the backward they
  // spilled 8-28 bytes (ptxas, sm_90).
  const int rows_left = c < cols_valid ? rows_valid - r0 : 0;  // copy it is in the tile iff it·kRowStep < rows_left
#pragma unroll
  for (int it = 0; it < kRows / kRowStep; ++it) {
    const bool pred = it * kRowStep < rows_left;
    cp_async_16_at(dst + it * kRowStep * kCols * 2, pred ? src : row0, pred);
    src += step;
  }
}

}  // namespace flashmonoid::cuda
