// Which key tiles a block of query rows visits, and which of them need per-element masking: the one
// piece of block-to-work bookkeeping every forward mainloop (sm80, sm90, split-KV) shares. Rows
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

// A persistent grid's static schedule: block c takes work tiles c, c + grid, c + 2·grid, ... of
// num_m_blocks · heads · batch (query block, head, batch) tiles. Query blocks vary fastest and are
// visited last to first, so blocks running side by side share a head's K/V in L2 and the longest
// causal rows start first.
struct WorkTiles {
  int num_m_blocks = 0, heads = 0, batch = 0;
  struct Tile {
    int m_block, head, batch;
  };
  __host__ __device__ int count() const { return num_m_blocks * heads * batch; }
  __device__ __forceinline__ Tile operator[](int t) const {
    const int rest = t / num_m_blocks;
    return {num_m_blocks - 1 - (t - rest * num_m_blocks), rest % heads, rest / heads};
  }
};

}  // namespace flashmonoid::cuda
