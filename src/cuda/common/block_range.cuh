// Which key tiles a block of query rows visits, and which of them need per-element masking: the one
// piece of block-to-work bookkeeping every forward mainloop (sm80, sm90, split-KV) shares; and its
// transpose for the backward (query_tiles: which query tiles a block of keys visits). Rows
// [i_first, i_end) of a sequence see keys [band.key_begin(i_first), band.key_end(i_end)); those
// tiles are cut into num_splits contiguous runs and the block takes run `split`.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flashmonoid/detail/host_device.hpp"
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

// Split-KV by shared key tiles (the narrow sm80 forward: decoding): the num_splits blocks of one
// (query block, head group, batch) stream the key tiles of its whole range from one counter instead
// of a fixed 1/num_splits each, so a block on a multiprocessor that streams faster takes more tiles
// and the blocks end together (every block still merges what it took into its own partial: the
// monoid's merge is commutative, so the combine is unchanged). With fixed runs the blocks' ends
// spread over ~9 us of a 50 us b = 1 32k call (H100 block timeline, bench/NOTES.md); more splits
// in more waves, the block scheduler's own balancing, lost 8-20% (each new block's start costs).
// Step t of block `split` reads visit position g_t (tile hi - 1 - g_t while g_t < count): the first
// kFixed steps g_t = t · num_splits + split, then kFixed · num_splits + the counter's next value,
// taken by one thread a step before the position is needed (take_next, an atomic whose result is
// read a step later), so no step waits for the counter. Without a counter, g_t = t (a fixed split).
//
// The counter is a word of the caller's workspace: (epoch << 32) | tiles taken, the epoch new per
// launch (launch_epoch.hpp), set back to 0 by the combine. The first take claims it: a 0 word, or
// a word of anything else (a fresh workspace's bytes, another call's partials; a 2^-32 chance that
// such a word carries this epoch), becomes this launch's with one compare-and-swap; a block that
// finds it claimed counts on with atomicAdd, as every later take does.
struct SharedKeyTiles {
  unsigned long long* counter = nullptr;  // null: a fixed split, g_t = t
  unsigned long long tag = 0;             // the launch's epoch << 32
  int stride = 1, first = 0;              // num_splits and split when shared

  __device__ __forceinline__ int fixed(int t) const { return t * stride + first; }
  // The position of the `taken`-th tile taken from the counter, after kFixed fixed steps.
  template <int kFixed>
  __device__ __forceinline__ int taken(unsigned long long word) const {
    return kFixed * stride + static_cast<int>(static_cast<unsigned>(word));
  }
  __device__ __forceinline__ unsigned long long take_first() const {
    unsigned long long seen = atomicCAS(counter, 0ull, tag | 1ull);
    while (seen != 0ull) {
      if ((seen & ~0xffffffffull) == tag) return atomicAdd(counter, 1ull);
      const unsigned long long prev = atomicCAS(counter, seen, tag | 1ull);  // claim it
      if (prev == seen) return tag;
      seen = prev;
    }
    return tag;
  }
  __device__ __forceinline__ unsigned long long take_next() const { return atomicAdd(counter, 1ull); }
};

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
//
// The split tail: units rarely divide by the grid (16k tokens at hdim 128 are 2048 units, 15.5
// rounds of 132 blocks), and in the last round the blocks without a unit idle: the H100 ran 128
// blocks as fast as 132 at every training shape (TFLOP/s equal within 1%; 124 blocks, 17 rounds,
// lost 4-17%). So the last tail_units units (grid + units % grid of them) are shared out by key
// steps: stretch c, [c, c + 1) · tail_units / grid of them in units, cut at key steps (TailPiece),
// goes to block grid - 1 - c; a unit cut between stretches c and c + 1 is computed in two parts
// whose states are merged (the monoid's merge) by stretch c's block, which waits for the other
// part from stretch c + 1's block, one of lower index. tail_units = 0: every unit whole, in rounds.
struct WorkTiles {
  int num_m_blocks = 0, heads = 0, batch = 0;
  bool paired = false;
  int tail_units = 0;
  struct Tile {
    int m_block, head, batch;  // m_block < 0: no tile here
  };
  __host__ __device__ int units_per_head() const { return paired ? (num_m_blocks + 1) / 2 : num_m_blocks; }
  __host__ __device__ int units() const { return units_per_head() * heads * batch; }
  __host__ __device__ int tiles_per_unit() const { return paired ? 2 : 1; }
  // Tile j (0, or 1 of a pair) of unit u: the longer block of a pair first.
  __device__ __forceinline__ Tile unit_tile(int u, int j) const {
    const int per = units_per_head(), hb = u / per, k = u - hb * per;
    int m = num_m_blocks - 1 - k;
    if (j == 1) m = k < num_m_blocks - 1 - k ? k : -1;
    return {m, hb % heads, hb / heads};
  }
  // A block walks positions t in [0, end(grid)): round t / tiles_per_unit, tile t % tiles_per_unit
  // of that round's unit; with a split tail, only the rounds before it (a whole number of them).
  __device__ __forceinline__ int end(int grid) const {
    const int whole = units() - tail_units;
    return (whole + grid - 1) / grid * tiles_per_unit();
  }
  __device__ __forceinline__ Tile at(int t, int block, int grid) const {
    const int round = t / tiles_per_unit(), j = t - round * tiles_per_unit();
    const int u = round * grid + (round & 1 ? grid - 1 - block : block);
    if (u >= units() - tail_units) return {-1, 0, 0};
    return unit_tile(u, j);
  }
};

// Blocks of a persistent grid of at most `grid` that run `units` whole units in as few rounds, every
// round full (2048 units: 128 blocks of 16 rounds instead of 132, whose last round is half idle).
inline int balanced_grid(int units, int grid) {
  const int rounds = (units + grid - 1) / grid;
  return (units + rounds - 1) / rounds;
}

// The host's choice of WorkTiles::tail_units for `units` units on `grid` blocks: grid + the
// remainder when the units leave a partial last round (a block's stretch is then at least one unit,
// so a unit is cut at most once), 0 when they divide evenly or fill no more than one round.
inline int split_tail_units(int units, int grid) {
  return units > grid && units % grid != 0 ? grid + units % grid : 0;
}

// How a piece of a split-tail unit's tile is computed and finished: whole (its own output); the
// head (the first key steps in visit order, the last piece of its block), whose block merges the
// tail's state into its own before the epilogue; the tail (the remaining steps, the first piece of
// the next block), which leaves its state (normalised O, lse) to the head's block.
enum class TailRole : int { whole, head, tail };

// Visit steps [step_begin, step_end) of a tile's `count` key steps (0 = the last key tile, the
// diagonal one of a causal block): the key tiles [hi - step_end, hi - step_begin) of its KeyTiles.
struct TailPiece {
  int step_begin, step_end;
  TailRole role;
};

// Position k of block `block`'s stretch of the split tail (stretch grid - 1 - block, [s0, s1) in
// units of 1 / grid, unit i spanning [i·grid, (i + 1)·grid)): tail unit i, its tile x, and the
// stretch's share [lo, hi) of unit i (lo, hi in [0, grid]); false past the stretch. A stretch is
// under two units long, so k < 3 · tiles_per_unit covers it. Reverse block order: the piece a
// stretch's head waits for is the first of the next stretch, whose block has the lower index.
struct TailPosition {
  int i, x, lo, hi;
};
FM_HD bool tail_position(int tail_units, int grid, int block, int tiles_per_unit, int k, TailPosition* pos) {
  const int s0 = (grid - 1 - block) * tail_units, s1 = s0 + tail_units;
  const int i = s0 / grid + k / tiles_per_unit;
  if (i * grid >= s1) return false;
  pos->i = i;
  pos->x = k % tiles_per_unit;
  pos->lo = (s0 > i * grid ? s0 : i * grid) - i * grid;
  pos->hi = (s1 < (i + 1) * grid ? s1 : (i + 1) * grid) - i * grid;
  return true;
}

// This block's piece of tile x of a tail unit whose tiles take unit steps [x0, x0 + count) of the
// unit's [0, steps), given the block's stretch of the unit [lo, hi) in units of 1 / grid (lo, hi
// in [0, grid]). Cut points are floor(pos · steps / grid): the neighbour computes the same cut.
// A tile without key steps is whole in the block holding the unit's start (lo == 0). Empty: no piece.
FM_HD bool tail_piece(int x0, int count, int steps, int lo, int hi, int grid, TailPiece* piece) {
  if (count == 0) {
    *piece = {0, 0, TailRole::whole};
    return lo == 0;
  }
  const int a = static_cast<int>(static_cast<long long>(lo) * steps / grid);
  const int b = static_cast<int>(static_cast<long long>(hi) * steps / grid);
  const int s0 = a > x0 ? a - x0 : 0, s1 = b < x0 + count ? b - x0 : count;
  if (s1 <= s0) return false;
  const TailRole role = s0 == 0 && s1 == count ? TailRole::whole : s0 == 0 ? TailRole::head : TailRole::tail;
  *piece = {s0, s1, role};
  return true;
}

// The exchange slot of a cut unit: its head's block. The tail's block is the next one down.
FM_HD int tail_slot(int block, TailRole role) { return block + (role == TailRole::tail ? 1 : 0); }

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
