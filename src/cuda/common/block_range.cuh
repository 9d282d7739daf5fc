// Which key tiles a block of query rows visits, and which of them need per-element masking: the one
// piece of block-to-work bookkeeping every forward mainloop (sm80, sm90, split-KV) shares; and its
// transpose for the backward (query_tiles: which query tiles a block of keys visits). Rows
// [i_first, i_end) of a sequence see keys [band.key_begin(i_first), band.key_end(i_end)); those
// tiles are cut into num_splits contiguous runs and the block takes run `split`.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flashmonoid/detail/mask.hpp"

namespace flashmonoid::cuda {

struct KeyTiles {
  int lo = 0, hi = 0;  // key tiles [lo, hi) of kBlockN keys; visited last to first
  // Tiles starting at key0 with unmasked_lo <= key0 <= unmasked_hi need no mask for any row of the
  // block (detail::Band::tile_needs_mask solved for key0 once), so the loop carries two ints
  // instead of the band's 64-bit bounds.
  int unmasked_lo = 0, unmasked_hi = 0;

  __device__ __forceinline__ int count() const { return hi - lo; }
  __device__ __forceinline__ bool needs_mask(int key0) const { return key0 < unmasked_lo || key0 > unmasked_hi; }
};

template <int kBlockN>
__device__ __forceinline__ KeyTiles key_tiles(const detail::Band& band, int i_first, int i_end, int len_k, int split = 0,
                                              int num_splits = 1) {
  KeyTiles t;
  const std::int64_t key_lo = band.key_begin(i_first, len_k), key_hi = band.key_end(i_end, len_k);
  const int n_lo = static_cast<int>(key_lo / kBlockN);
  const int n_hi = key_hi > key_lo ? static_cast<int>((key_hi + kBlockN - 1) / kBlockN) : n_lo;
  const int per_split = (n_hi - n_lo + num_splits - 1) / num_splits;
  t.lo = n_lo + split * per_split;
  t.hi = t.lo + per_split < n_hi ? t.lo + per_split : n_hi;
  constexpr std::int64_t kFar = 1 << 30;
  std::int64_t hi = static_cast<std::int64_t>(len_k) - kBlockN;
  if (band.right >= 0) hi = std::min<std::int64_t>(hi, i_first + band.diag + band.right - kBlockN + 1);
  const std::int64_t lo = band.left >= 0 ? i_end - 1 + band.diag - band.left : -kFar;
  t.unmasked_lo = static_cast<int>(std::max<std::int64_t>(lo, -kFar));
  t.unmasked_hi = static_cast<int>(std::max<std::int64_t>(std::min<std::int64_t>(hi, kFar), -kFar));
  return t;
}

// The backward's transpose of key_tiles: the query tiles [lo, hi) of kBlockM rows that a block of
// keys [key0, key_end) visits, those holding a row that sees one of its keys.
struct QueryTiles {
  int lo = 0, hi = 0;
  __device__ __forceinline__ int count() const { return hi - lo; }
};

template <int kBlockM>
__device__ __forceinline__ QueryTiles query_tiles(const detail::Band& band, std::int64_t key0, std::int64_t key_end,
                                                  int len_q) {
  const std::int64_t row_lo = band.query_begin(key0), row_hi = band.query_end(key_end, len_q);
  QueryTiles t;
  t.lo = static_cast<int>(row_lo / kBlockM);
  t.hi = row_hi > row_lo ? static_cast<int>((row_hi + kBlockM - 1) / kBlockM) : t.lo;
  return t;
}

// A persistent grid's static schedule of the num_m_blocks · heads · batch (query block, head, batch)
// work tiles. The unit of work is one query block, or under a causal-like mask (a right window
// bound) the pair of blocks k and num_m_blocks - 1 - k, whose key ranges add up to about the same
// length for every k. Units run head by head, so blocks side by side share a head's K/V in L2; in
// round r block c takes unit r·grid + c, or r·grid + grid - 1 - c when r is odd ("snake"), so
// units of alternating lengths (an odd block count leaves a middle block alone) do not all land on
// the same blocks. (A plain round robin of single causal blocks gave some blocks only long tiles:
// -30% at 16k causal; ordering heads in L2-sized groups lost up to 20% at s = 512, H100.)
struct WorkTiles {
  int num_m_blocks = 0, heads = 0, batch = 0;
  bool paired = false;
  struct Tile {
    int m_block, head, batch;  // m_block < 0: no tile here
  };
  __host__ __device__ int units_per_head() const { return paired ? (num_m_blocks + 1) / 2 : num_m_blocks; }
  __host__ __device__ int units() const { return units_per_head() * heads * batch; }
  __host__ __device__ int tiles_per_unit() const { return paired ? 2 : 1; }
  // A block walks positions t in [0, end(grid)): round t / tiles_per_unit, tile t % tiles_per_unit
  // of that round's unit.
  __device__ __forceinline__ int end(int grid) const { return (units() + grid - 1) / grid * tiles_per_unit(); }
  __device__ __forceinline__ Tile at(int t, int block, int grid) const {
    const int round = t / tiles_per_unit(), j = t - round * tiles_per_unit();
    const int u = round * grid + (round & 1 ? grid - 1 - block : block);
    if (u >= units()) return {-1, 0, 0};
    const int per = units_per_head(), hb = u / per, k = u - hb * per;
    int m = num_m_blocks - 1 - k;  // the longer block of a pair first
    if (j == 1) m = k < num_m_blocks - 1 - k ? k : -1;
    return {m, hb % heads, hb / heads};
  }
};

// Deterministic dQ, both backward families: the key blocks that see a query tile (rows from row0)
// form a contiguous range from the key block of band.key_begin(row0) on (a band mask's visible keys
// per row are an interval that moves right by one per row), and they add their dQ partials in
// key-block order behind the tile's semaphore, which counts the additions done. dq_turn is key block
// n_block's place in that range. A key block waits only for key blocks < n_block of the same
// (batch, head), which started before it (sm80: a lower linear block index, launched first; sm90: a
// work item taken earlier by a running persistent block), so the wait cannot deadlock.
template <int kBlockN>
__device__ __forceinline__ int dq_turn(const detail::Band& band, int n_block, std::int64_t row0, std::int64_t len_k) {
  return n_block - static_cast<int>(band.key_begin(row0, len_k) / kBlockN);
}
__device__ __forceinline__ void sem_wait(const int* sem, int value) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
  } while (seen != value);
}
__device__ __forceinline__ void sem_release(int* sem, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(sem), "r"(value) : "memory");
}

}  // namespace flashmonoid::cuda
