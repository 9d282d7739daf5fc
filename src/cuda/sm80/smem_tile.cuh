// Shared-memory tiles of 2-byte elements, (rows, kCols) row-major with kCols a multiple of 64 (one
// 128-byte line or more per row), the 16-byte chunks of each 128-byte group XOR-swizzled by the row
// (common/types.cuh: swizzle_chunk). An ldmatrix phase reads one chunk column from 8 consecutive rows;
// the swizzle sends those 8 chunks to 8 different bank groups, so it is conflict-free, and the
// 16-byte cp.async writes stay whole.
#pragma once

#include <cstdint>

#include "sm80/mma_sm80.cuh"

namespace flashmonoid::cuda {

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

}  // namespace flashmonoid::cuda
