// CPU flash forward: for each (batch, head, block of kBlockM query rows) a fold of the
// online-softmax monoid (detail/monoid.hpp) over blocks of kBlockN keys. Per thread the only
// scores alive are one (kBlockM, kBlockN) tile. Extra memory: K and V packed once
// (O(total_k·h_k·d); up to 256 MiB of it kept by the calling thread for its next call, kept_scratch)
// and the per-thread tiles (O(kBlockM·d)).
//
// The two block products run on fp32 operands (K, V and Q converted when packed), or, for bf16
// inputs where the kernel table has a bf16 dot product (AVX512_BF16), on bf16 pairs with fp32
// accumulation: K, V and Q stay exactly the input, scores are scaled in fp32 after S = QKᵀ, and P is
// rounded to bf16 before O += P·V, as the FlashAttention rule's input-precision reference rounds it.
// fp16 inputs stay on the fp32 products: converting them to bf16 would drop 3 mantissa bits.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/flash_tiles.hpp"
#include "cpu/kernels.hpp"
#include "cpu/profile.hpp"
#include "cpu/scratch.hpp"
#include "flashmonoid/detail/monoid.hpp"
#include "flashmonoid/error.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace flashmonoid::cpu {
namespace {

using detail::FwdParams;
using detail::RowState;
using detail::SeqInfo;
using tiles::kLanes;

// Tile sizes: kBlockM from a sweep of {48, 96, 192} at s = 2048 (barely mattered; 96 = 16 row blocks
// of 6 for AVX2, 12 of 8 for AVX-512). kBlockN = 256 against 128 (AMD EPYC VM, AVX-512, 2 threads,
// b = 1, h = 8, calls paired with the 128 build): 0.965-0.991 of the time at d = 64 and 128, s = 1k
// to 8k, from fewer per-tile costs (the rows' reductions and state merges, O's load and store around
// each P·V micro-kernel); 512 was within 1% of 256, with fewer key splits for short sequences. (Before
// Kᵀ was stored in column panels 256 lost 20% at d = 128: the (d, kBlockN) tile left L1; a panel is
// (d, Kernels::panel) now.) Under a causal mask or a band the products stop at the block's last
// visible key (fold_keys), so the wider tile computes no more masked columns.
// kBlockN is a multiple of 4 so that tiles start on a Philox column group.
constexpr int kBlockM = 96;
constexpr int kBlockN = 256;
static_assert(kBlockN % 32 == 0, "kBlockN must be a multiple of the micro-kernels' panels (Kernels::panel)");

// (batch, head, query block) items; sequences differ in length under varlen, so the items of
// batch entry b start at first[b]. When items are few (b·h small, short sequences) each item's
// keys are also split into `splits` runs of key blocks, one task each, whose partial states
// (m, l, o) are folded with the monoid's merge by whichever task of the item finishes last
// (merge_splits below).
struct Tasks {
  std::vector<std::int64_t> first;  // (batch + 1)
  std::vector<int> blocks;          // query blocks per head of batch entry b
  int splits = 1;
  std::int64_t items() const { return first.back(); }
};

// Key splits depend on the shape alone, never on the thread count, so that the forward's bits are
// the same for any number of threads (as the backward's chunks). Split when there are fewer than
// 64 items (4 tasks per thread on 16 cores): b = 1, h = 8 splits up to s = 576. At s = 1k
// (88 items) a split in 2 measured 10-15% slower with 2 threads (best of 6 alternated runs: 66 vs
// 47 ms, d = 64): each split's partial (kBlockM, dp) tiles are fresh memory, first touched in the
// call, and a merge per row.
constexpr std::int64_t kTargetTasks = 64;
constexpr int kMaxSplits = 8;

// Splits of each item's key blocks so that there are about kTargetTasks tasks, at most max_splits.
int key_splits(std::int64_t items, std::int64_t max_key_blocks, int max_splits = kMaxSplits) {
  if (items == 0) return 1;
  const std::int64_t want = (kTargetTasks + items - 1) / items;
  return static_cast<int>(std::clamp<std::int64_t>(std::min(want, max_key_blocks), 1, max_splits));
}

Tasks make_tasks(const FwdParams& p) {
  Tasks t;
  t.first.assign(p.batch + 1, 0);
  t.blocks.assign(p.batch, 0);
  std::int64_t max_key_blocks = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SeqInfo si = seq_info(p, b);
    t.blocks[b] = (si.len_q + kBlockM - 1) / kBlockM;
    t.first[b + 1] = t.first[b] + static_cast<std::int64_t>(t.blocks[b]) * p.h;
    max_key_blocks = std::max<std::int64_t>(max_key_blocks, (si.len_k + kBlockN - 1) / kBlockN);
  }
  t.splits = key_splits(t.items(), max_key_blocks);
  return t;
}

// K and V of every (batch, KV head) packed once, in the layouts the products read, zero-padded,
// each stored as column panels of kn.panel columns, panel after panel (a panel is (rows, panel),
// contiguous):
// - fp32 products: Kᵀ tiles (d, kBlockN) and V tiles (kBlockN, dp), converted to fp32;
// - bf16 products (`pairs`): Kᵀ tiles (d2, kBlockN) of K's pairs along d and V tiles
//   (kBlockN / 2, dp) of V's pairs along the keys (tiles::pair_along_row, pairs_across_rows),
//   half the bytes.
// Repacking them for every query block took 40% of the forward's time at d = 64 (perf, s = 4k);
// packing once costs O(total_k·h_k·d) memory, the O(N·d) that the issue allows, and GQA groups
// share it. Panels (tiles::to_panels): +4-17% at s = 2k, one thread, over row-major tiles.
struct PackedKV {
  int d = 0, dp = 0, panel = 0, vp = 0;  // vp: dp rounded up to whole panels
  int d2 = 0;                            // pairs along d: (d + 1) / 2
  bool pairs = false;
  std::vector<std::int64_t> first;  // (batch + 1) first key block of batch entry b
  // Uninitialised (pack_tile writes every element) scratch of kept_scratch: Kᵀ tiles, then V tiles,
  // 4-byte elements; kt, v for fp32 products, kt2, v2 for bf16 pairs.
  std::unique_ptr<std::byte[]> owned;  // when the call's tiles are too large to keep
  float *kt = nullptr, *v = nullptr;
  std::uint32_t *kt2 = nullptr, *v2 = nullptr;

  std::int64_t tile(int b, std::int64_t block, int hk, int h_k) const { return (first[b] + block) * h_k + hk; }
  // The u-th tile in the tasks' order (batch entry, KV head, key block), so that a thread's static
  // share of the packing is about the tiles its range of tasks (RangeQueue) folds first.
  std::int64_t tile_in_item_order(std::int64_t u, int h_k) const {
    const std::int64_t g = u / h_k;  // u's batch entry b holds tiles [first[b]·h_k, first[b + 1]·h_k)
    const auto b = static_cast<int>(std::upper_bound(first.begin(), first.end(), g) - first.begin()) - 1;
    const std::int64_t blocks = first[b + 1] - first[b], r = u - first[b] * h_k;
    return tile(b, r % blocks, static_cast<int>(r / blocks), h_k);
  }
  std::int64_t kt_elems() const { return static_cast<std::int64_t>(pairs ? d2 : d) * kBlockN; }
  std::int64_t v_elems() const { return static_cast<std::int64_t>(pairs ? kBlockN / 2 : kBlockN) * vp; }
  float* kt_tile(std::int64_t t) const { return kt + t * kt_elems(); }
  float* v_tile(std::int64_t t) const { return v + t * v_elems(); }
  std::uint32_t* kt2_tile(std::int64_t t) const { return kt2 + t * kt_elems(); }
  std::uint32_t* v2_tile(std::int64_t t) const { return v2 + t * v_elems(); }
  // Tile t's Kᵀ and V, whichever form they are in, for prefetching (4-byte elements either way).
  const void* kt_any(std::int64_t t) const { return pairs ? static_cast<const void*>(kt2_tile(t)) : kt_tile(t); }
  const void* v_any(std::int64_t t) const { return pairs ? static_cast<const void*>(v2_tile(t)) : v_tile(t); }
};

// Whether this call's products run on bf16 pairs.
bool pair_products(const FwdParams& p, const Kernels& kn) { return p.dtype == DType::bf16 && kn.gemm_bf16 != nullptr; }

// Sizes kv for p; pack_tile() fills tile t (key block t / h_k, KV head t % h_k).
void size_packed(const FwdParams& p, const Kernels& kn, PackedKV& kv) {
  kv.d = p.d;
  kv.dp = tiles::round_up(p.d, kLanes);
  kv.d2 = (p.d + 1) / 2;
  kv.pairs = pair_products(p, kn);
  kv.panel = kn.panel;
  kv.vp = tiles::round_up(kv.dp, kn.panel);
  kv.first.assign(p.batch + 1, 0);
  for (int b = 0; b < p.batch; ++b) kv.first[b + 1] = kv.first[b] + (seq_info(p, b).len_k + kBlockN - 1) / kBlockN;
  const auto n_tiles = static_cast<std::size_t>(kv.first.back() * p.h_k);
  const std::size_t kt_words = n_tiles * kv.kt_elems(), v_words = n_tiles * kv.v_elems();
  std::byte* mem = kept_scratch((kt_words + v_words) * 4, kv.owned);
  if (kv.pairs) {
    kv.kt2 = reinterpret_cast<std::uint32_t*>(mem);
    kv.v2 = kv.kt2 + kt_words;
  } else {
    kv.kt = reinterpret_cast<float*>(mem);
    kv.v = kv.kt + kt_words;
  }
}

// Cache-line aligned storage for the tiles the micro-kernels stream (as kept_scratch's align64 for
// the packed K/V): a 64-byte vector load of a tile that starts mid-line touches two lines (with both
// aligned, the forward 2.0-2.2% faster at s = 1k, bench/NOTES.md).
template <class T>
struct Align64 {
  using value_type = T;
  Align64() = default;
  template <class U>
  Align64(const Align64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const Align64&) const { return true; }
};
using AlignedFloats = std::vector<float, Align64<float>>;

// One thread's tiles. dp = d rounded up to the 8-wide vector; d2 = pairs along d. The q2, p2 and
// row2 tiles serve bf16 pair products and are empty otherwise, as q is then. V goes straight into
// its panels (tiles::load_rows_panels, pack_tile), with no staging tile: s = 1k, 2 threads, AMD
// EPYC, fp32 1.5% faster at d = 64 than through a staging tile and to_panels, 3-4% on AVX2.
struct Workspace {
  int d, dp, d2;
  AlignedFloats q;   // (kBlockM, d)   scale · Q
  AlignedFloats s;   // (kBlockM, kBlockN) scores, then probabilities
  AlignedFloats o;   // (kBlockM, dp)  unnormalised output
  std::vector<float> row;  // (8, d)    staging rows for packing Kᵀ (tiles::load_rows_transposed_panels)
  std::vector<std::uint32_t> q2;        // (kBlockM, d2)  Q's pairs along d, unscaled
  std::vector<std::uint32_t> p2;        // (kBlockM, kBlockN / 2)  P's pairs along the keys
  std::vector<std::uint32_t> row2;      // (8, d2)  staging rows for packing Kᵀ's pairs (tiles::rows_transposed_panels)
  std::vector<RowState> state;  // (kBlockM)
  std::vector<float> alpha;     // (kBlockM)  rescale of o for the current key block
  std::vector<float> m_run, sums;  // (kBlockM)  Kernels::softmax_rows' running maxima and row sums
  Workspace(int d_, bool pairs)
      : d(d_), dp(tiles::round_up(d_, kLanes)), d2((d_ + 1) / 2), s(kBlockM * kBlockN),
        o(static_cast<std::size_t>(kBlockM) * dp), row(static_cast<std::size_t>(8) * d_), state(kBlockM), alpha(kBlockM),
        m_run(kBlockM), sums(kBlockM) {
    if (pairs) {
      q2.resize(static_cast<std::size_t>(kBlockM) * d2);
      p2.resize(kBlockM * kBlockN / 2);
      row2.resize(static_cast<std::size_t>(8) * d2);
    } else {
      q.resize(static_cast<std::size_t>(kBlockM) * d);
    }
  }
};

// Element offset of row r of K or V in tile t (key block t / h_k, KV head t % h_k), through
// detail::kv_offset: a KV cache's batch index or block table, when there is one. n: the tile's keys.
struct TileRows {
  const FwdParams& p;
  int b, hk, n;
  std::int64_t row0;  // the tile's first key, in the entry's rows
  std::int64_t k(int r) const { return detail::kv_offset(p, p.k_stride, b, row0 + r, hk); }
  std::int64_t v(int r) const { return detail::kv_offset(p, p.v_stride, b, row0 + r, hk); }
};

TileRows tile_rows(const FwdParams& p, const PackedKV& kv, std::int64_t t) {
  const std::int64_t block_global = t / p.h_k;
  const int b = static_cast<int>(std::upper_bound(kv.first.begin(), kv.first.end(), block_global) - kv.first.begin()) - 1;
  const SeqInfo si = seq_info(p, b);
  const std::int64_t j0 = (block_global - kv.first[b]) * kBlockN;
  return {p, b, static_cast<int>(t % p.h_k), static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0)),
          si.k_row0 + j0};
}

void pack_tile(const FwdParams& p, PackedKV& kv, std::int64_t t, Workspace& ws) {
  const TileRows rows = tile_rows(p, kv, t);
  const int n = rows.n;
  auto k_row = [&](int r) { return rows.k(r); };
  auto v_row = [&](int r) { return rows.v(r); };
  if (!kv.pairs) {
    tiles::load_rows_transposed_panels(p.k, p.dtype, k_row, n, p.d, kBlockN, kv.panel, 1.0f, ws.row.data(),
                                       kv.kt_tile(t));
    tiles::load_rows_panels(p.v, p.dtype, v_row, n, kBlockN, p.d, kv.vp, kv.panel, 1.0f, kv.v_tile(t));
    return;
  }
  // Kᵀ pairs (d2, kBlockN): column r holds key r's pairs along d; keys past n are zero. Rows copied
  // 8 at a time and transposed in 8×8 blocks straight into the panels (Xeon, 16 threads, bf16 on
  // AMX: element by element the packing was ~10% of the forward at s = 1k).
  const auto* k = static_cast<const std::uint16_t*>(p.k);
  tiles::rows_transposed_panels(
      [&](int r, std::uint32_t* out) {
        if (r + tiles::kRowsAhead < n) tiles::prefetch_row(p.k, p.dtype, rows.k(r + tiles::kRowsAhead), p.d);
        tiles::pairs_of_row(k + rows.k(r), p.d, out);
      },
      n, kv.d2, kBlockN, kv.panel, ws.row2.data(), kv.kt2_tile(t));
  // V pairs (kBlockN / 2, vp): row j pairs keys 2j and 2j + 1, written straight into the panels;
  // keys past n and columns past d are zero. With V in cache, 1.8 us a tile of d = 128 against 8.9
  // through a row-major stage, to_panels and the scalar pairs (AMD EPYC); in a forward at 1k keys the
  // packing's share stayed ~8%: it waits on its first reads of K and V from memory. Hence K's and V's
  // rows prefetched kRowsAhead ahead, as load_rows does for fp32 (EPYC, bf16, d = 128, 1k keys, 1-2
  // threads, 3 alternated rounds: the packing's share 7.3-8.9% -> 5.7-6.5%, the forward 1.5-2.5%
  // faster; d = 64, two lines a row, unchanged; 16 rows ahead the same as 8).
  const auto* v = static_cast<const std::uint16_t*>(p.v);
  for (int j = 0; j < kBlockN / 2; ++j) {
    const int r0 = 2 * j, r1 = 2 * j + 1;
    for (int r = r0 + tiles::kRowsAhead; r <= r1 + tiles::kRowsAhead && r < n; ++r)
      tiles::prefetch_row(p.v, p.dtype, rows.v(r), p.d);
    for (int c = 0; c < kv.vp; c += kv.panel) {
      std::uint32_t* dst = kv.v2_tile(t) + static_cast<std::int64_t>(c) * (kBlockN / 2) + j * kv.panel;
      if (r0 < n)
        tiles::pairs_across_rows(v + rows.v(r0) + c, r1 < n ? v + rows.v(r1) + c : nullptr,
                                 std::clamp(p.d - c, 0, kv.panel), kv.panel, dst);
      else
        std::fill(dst, dst + kv.panel, 0u);
    }
  }
}

// Score transforms in the order detail/mask.hpp defines them, in natural units (tiles::kLog2e
// says why), on row i (in the sequence) of the tile, keys j0 .. j0 + n; columns [n, cols)
// become -inf.
void transform_row(const FwdParams& p, const detail::Band& band, float slope, bool needs_mask, std::int64_t i,
                   std::int64_t j0, int n, int cols, float* s) {
  if (p.softcap > 0.0f) {
    const float inv = 1.0f / p.softcap;
    for (int c = 0; c < n; ++c) s[c] = p.softcap * std::tanh(s[c] * inv);
  }
  if (p.alibi != nullptr)
    for (int c = 0; c < n; ++c) s[c] += detail::alibi_bias(slope, i, j0 + c, band.diag);
  if (needs_mask)
    for (int c = 0; c < n; ++c)
      if (!band.visible(i, j0 + c)) s[c] = -INFINITY;
  for (int c = n; c < cols; ++c) s[c] = -INFINITY;
}

// Kept probabilities times 1/(1-p), dropped ones 0 (key columns j0 .. j0 + n of dropout row row_id).
void apply_dropout(const FwdParams& p, std::uint32_t row_id, std::int64_t j0, int n, float* s) {
  for (int c = 0; c < n; c += 4) {
    auto j = static_cast<std::uint32_t>(j0 + c);
    detail::Philox4 w = detail::dropout_words(p.seed, p.offset, row_id, j / 4);
    for (int u = 0; u < 4 && c + u < n; ++u)
      s[c + u] = w.x[u] >= p.dropout_threshold ? s[c + u] * p.dropout_rescale : 0.0f;
  }
}

// Lazy rescaling (as FlashAttention-4): a row's running m moves only when a tile's max exceeds it
// by more than this many log2 units, so the probabilities the fold adds are at most 2^8 (far from
// fp32's range; simd::exp2 is accurate up to 8) and O is rescaled about once per row instead of at
// every new max. m stays a score of the row, so the row's largest term is at least 1.
constexpr float kLazyRescale = 8.0f;

// Where an item is: entry b, query head hq, query block qb.
struct Item {
  int b, hq, qb;
};

Item item_at(const Tasks& tasks, std::int64_t t) {
  const int b = static_cast<int>(std::upper_bound(tasks.first.begin(), tasks.first.end(), t) - tasks.first.begin()) - 1;
  const std::int64_t rest = t - tasks.first[b];
  return {b, static_cast<int>(rest / tasks.blocks[b]), static_cast<int>(rest % tasks.blocks[b])};
}

// The item's m query rows from row i0 of the entry: scale·Q in fp32 for the fp32 products, Q's
// pairs along d as they are for the bf16 ones (the scale then goes to the scores, scale_scores).
void load_q(const FwdParams& p, const PackedKV& kv, const SeqInfo& si, Item it, std::int64_t i0, int m,
            Workspace& ws) {
  if (!kv.pairs) {
    tiles::load_tile(p.q, p.dtype, p.q_stride, it.b, si.q_row0 + i0, it.hq, m, m, p.d, p.d, p.scale, ws.q.data());
    return;
  }
  const auto* q = static_cast<const std::uint16_t*>(p.q);
  for (int r = 0; r < m; ++r)
    tiles::pairs_of_row(q + detail::offset_of(p.q_stride, it.b, si.q_row0 + i0 + r, it.hq), p.d, ws.q2.data() + r * kv.d2);
}

// S (m, cols) = Q (m, d) · Kᵀ (d, cols) of tile `tile`, the tile's first cols columns (a whole number
// of panels; the rest of each row of ws.s is left as it was): scores in natural units for the fp32
// products (Q holds the scale), unscaled ones for the bf16 products.
void scores(const Kernels& kn, const PackedKV& kv, std::int64_t tile, int m, int cols, Workspace& ws) {
  if (kv.pairs)
    tiles::gemm_panels(kn.gemm_bf16, m, cols, kv.d2, ws.q2.data(), kv.d2, kv.kt2_tile(tile), kv.d2, kv.panel,
                       ws.s.data(), kBlockN);
  else
    tiles::gemm_panels(kn.gemm, m, cols, kv.d, ws.q.data(), kv.d, kv.kt_tile(tile), kv.d, kv.panel, ws.s.data(),
                       kBlockN);
}

// O (m, dp) += P (m, n) · V (n, dp) of tile `tile` (O = P·V without acc); for the bf16 products P's
// pairs (ws.p2, rounded by to_bf16_pairs), over the n keys rounded up to a pair (V's padding keys
// are zero).
void accumulate(const Kernels& kn, const PackedKV& kv, std::int64_t tile, int m, int n, bool acc, Workspace& ws) {
  if (kv.pairs)
    tiles::gemm_panels(acc ? kn.gemm_bf16_acc : kn.gemm_bf16, m, ws.dp, (n + 1) / 2, ws.p2.data(), kBlockN / 2,
                       kv.v2_tile(tile), kBlockN / 2, kv.panel, ws.o.data(), ws.dp);
  else
    tiles::gemm_panels(acc ? kn.gemm_acc : kn.gemm, m, ws.dp, n, ws.s.data(), kBlockN, kv.v_tile(tile), kBlockN,
                       kv.panel, ws.o.data(), ws.dp);
}

// Where the scale goes: the fp32 products' Q holds it; the bf16 pair products' scores are unscaled
// (Q stays exact), and the scale goes into the softmax's multiplier (mul), or, where a softcap or
// ALiBi needs the scaled scores first, onto each row (rows). The tiled and the decoding mainloops.
struct ScoreScale {
  bool rows;
  float mul;
};
ScoreScale score_scale(const FwdParams& p, bool pairs) {
  const bool rows = pairs && (p.softcap > 0.0f || p.alibi != nullptr);
  return {rows, pairs && !rows ? tiles::kLog2e * p.scale : tiles::kLog2e};
}

// ws.o, ws.state <- the fold of key blocks [kb_lo, kb_hi) (on the kBlockN grid of entry it.b) into
// the item's query rows, unnormalised; returns the number of rows m.
int fold_keys(const FwdParams& p, const Kernels& kn, const PackedKV& kv, Item it, std::int64_t kb_lo,
              std::int64_t kb_hi, Workspace& ws) {
  const SeqInfo si = seq_info(p, it.b);
  const detail::Band band = band_of(p, si);
  const int hk = it.hq / p.group();
  const int dp = ws.dp;
  const std::int64_t i0 = static_cast<std::int64_t>(it.qb) * kBlockM;
  const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
  const float slope = detail::alibi_slope(p, it.b, it.hq);

  profile::Lap lap;
  load_q(p, kv, si, it, i0, m, ws);
  lap.charge(profile::load_q);
  std::fill(ws.state.begin(), ws.state.end(), RowState{});

  // Key blocks on the kBlockN grid that hold a visible key for some row of this block.
  const std::int64_t k_begin = std::max(band.key_begin(i0, si.len_k) / kBlockN * kBlockN, kb_lo * kBlockN);
  const std::int64_t k_end = std::min<std::int64_t>({band.key_end(i0 + m, si.len_k), si.len_k, kb_hi * kBlockN});
  const ScoreScale sc = score_scale(p, kv.pairs);
  for (std::int64_t j0 = k_begin; j0 < k_end; j0 += kBlockN) {
    // The tile's keys up to the block's last visible one; the products run over those only.
    const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, k_end - j0));
    const std::int64_t tile = kv.tile(it.b, j0 / kBlockN, hk, p.h_k);

    scores(kn, kv, tile, m, tiles::round_up(n, kv.panel), ws);
    lap.charge(profile::scores);

    const bool needs_mask = band.tile_needs_mask(i0, i0 + m, j0, j0 + n, si.len_k);
    // Where the table asks for it (Kernels::prefetch_kv), V of this key block and Kᵀ of the next
    // are fetched into L2 while the rows' transforms and softmax run.
    const bool next = j0 + kBlockN < k_end;
    const tiles::PrefetchL2 v_next(kv.v_any(tile), kn.prefetch_kv ? kv.v_elems() * 4 : 0, m);
    const tiles::PrefetchL2 kt_next(kv.kt_any(next ? tile + p.h_k : tile),
                                    kn.prefetch_kv && next ? kv.kt_elems() * 4 : 0, m);
    for (int r = 0; r < m; ++r) {
      float* s = ws.s.data() + r * kBlockN;
      v_next.slice(r);
      if (sc.rows) kn.scale_row(s, kBlockN, p.scale);
      transform_row(p, band, slope, needs_mask, i0 + r, j0, n, kBlockN, s);
      ws.m_run[r] = ws.state[r].m;
    }
    // The tile's partial states are expressed against m_run >= the running states' m, so that
    // merging one is just the rescale of the running state (its own factor is 2^0 = 1): m_run moves
    // to the tile's max only where that exceeds the running m by more than kLazyRescale (else O is
    // not rescaled).
    kn.softmax_rows(ws.s.data(), m, kBlockN, sc.mul, kLazyRescale, ws.m_run.data(), ws.sums.data());
    lap.charge(profile::softmax);
    for (int r = 0; r < m; ++r) {
      float* s = ws.s.data() + r * kBlockN;
      kt_next.slice(r);
      float fa, fb;
      ws.state[r] = detail::merge(ws.state[r], RowState{ws.m_run[r], ws.sums[r]}, &fa, &fb);
      ws.alpha[r] = fa;
      if (p.dropout_p > 0.0f) apply_dropout(p, detail::dropout_row_id(p, it.hq, si, i0 + r), j0, n, s);
      if (kv.pairs) kn.to_bf16_pairs(s, kBlockN, ws.p2.data() + r * (kBlockN / 2));
    }
    lap.charge(profile::to_pairs);
    // The first tile's product writes O (its rows start from the identity, o = 0 scaled by
    // alpha = 0): no zero fill, no rescale pass and no load of O around it.
    const bool first = j0 == k_begin;
    if (!first)
      for (int r = 0; r < m; ++r)
        if (ws.alpha[r] != 1.0f) kn.scale_row(ws.o.data() + r * dp, dp, ws.alpha[r]);
    lap.charge(profile::rescale);
    accumulate(kn, kv, tile, m, n, !first, ws);
    lap.charge(profile::accumulate);
  }
  if (k_begin >= k_end) std::fill(ws.o.begin(), ws.o.begin() + static_cast<std::ptrdiff_t>(m) * dp, 0.0f);
  return m;
}

// out, lse of query rows i0 .. i0 + m of (entry b, head hq) from finished states: out = o / l,
// lse = ln 2·(m + log2 l).
void store_rows(const FwdParams& p, int b, int hq, std::int64_t i0, int m, const float* o, int dp,
                const RowState* state) {
  const SeqInfo si = seq_info(p, b);
  const auto row_offset = [&](int r) { return detail::offset_of(p.o_stride, b, si.q_row0 + i0 + r, hq); };
  for (int r = 0; r < m; ++r) {
    const std::int64_t i = i0 + r;
    const float inv_l = detail::finish_inv_l(state[r]);
    if (!tiles::store_row_stream(p.out, p.dtype, row_offset(r), p.d, o + r * dp, inv_l)) {
      if (r + tiles::kRowsAhead < m) tiles::prefetch_row(p.out, p.dtype, row_offset(r + tiles::kRowsAhead), p.d, true);
      tiles::store_row(p.out, p.dtype, row_offset(r), p.d, o + r * dp, inv_l);
    }
    p.lse[detail::lse_index(p, b, hq, si, i)] = detail::finish_lse(state[r]);
  }
  _mm_sfence();  // the streamed rows ordered before the call returns
}

// Partial states of the split tasks: (split, item) slots of `rows` rows, uninitialised (a slot is
// read only where its task wrote it), and per item the number of its splits done. In `owned`, or
// in memory the caller keeps.
struct Partials {
  int rows = 0, dp = 0;
  float* o = nullptr;                // (splits · items, rows, dp)
  RowState* state = nullptr;         // (splits · items, rows)
  std::atomic<int>* done = nullptr;  // (items)
  std::unique_ptr<std::byte[]> owned;

  static std::size_t bytes(std::int64_t slots, std::int64_t items, int rows, int dp) {
    return static_cast<std::size_t>(slots * rows) * (dp * sizeof(float) + sizeof(RowState)) +
           static_cast<std::size_t>(items) * sizeof(std::atomic<int>) + 128;
  }
  // Lays the slots out in mem (Partials::bytes of it, 64-byte aligned), or in owned memory.
  void place(std::int64_t slots, std::int64_t items, int rows_, int dp_, std::byte* mem = nullptr) {
    rows = rows_;
    dp = dp_;
    if (mem == nullptr) {
      owned = std::make_unique_for_overwrite<std::byte[]>(bytes(slots, items, rows, dp) + 64);
      mem = align64(owned.get());
    }
    o = reinterpret_cast<float*>(mem);
    state = reinterpret_cast<RowState*>(o + slots * rows * dp);
    done = reinterpret_cast<std::atomic<int>*>(align64(reinterpret_cast<std::byte*>(state + slots * rows)));
    for (std::int64_t t = 0; t < items; ++t) new (done + t) std::atomic<int>(0);
  }
  float* o_slot(std::int64_t slot) const { return o + slot * rows * dp; }
  RowState* state_slot(std::int64_t slot) const { return state + slot * rows; }
};

// o, state (m rows) <- the monoid fold of item t's splits' partial states, in split order.
void merge_splits(const Partials& parts, int splits, std::int64_t items, std::int64_t t, int m, float* o,
                  RowState* state) {
  const int dp = parts.dp;
  for (int r = 0; r < m; ++r) {
    RowState acc{};
    float* orow = o + r * dp;
    std::fill(orow, orow + dp, 0.0f);
    for (int c = 0; c < splits; ++c) {
      const std::int64_t slot = c * items + t;
      const RowState part = parts.state_slot(slot)[r];
      if (part.m == -INFINITY) continue;  // the identity: no visible key in this split
      float fa, fb;
      acc = detail::merge(acc, part, &fa, &fb);
      const float* po = parts.o_slot(slot) + r * dp;
      for (int x = 0; x < dp; ++x) orow[x] = fa * orow[x] + fb * po[x];
    }
    state[r] = acc;
  }
}

// A finished task's m rows: stored at once without splits; else kept in its slot, and the item's
// last task to finish folds the slots into o, state (merge_splits) and calls store(o, state). The
// fold's order is the split order whichever task runs it, so the bits do not depend on the schedule.
template <class Store>
void finish_task(const Partials& parts, int splits, std::int64_t items, std::int64_t task, int m, float* o,
                 RowState* state, Store&& store) {
  if (splits == 1) {
    store(o, state);
    return;
  }
  const std::int64_t t = task % items;
  const int dp = parts.dp;
  std::copy(o, o + static_cast<std::ptrdiff_t>(m) * dp, parts.o_slot(task));
  std::copy(state, state + m, parts.state_slot(task));
  // acq_rel: the last task sees every other split's partial.
  if (parts.done[t].fetch_add(1, std::memory_order_acq_rel) == splits - 1) {
    merge_splits(parts, splits, items, t, m, o, state);
    store(o, state);
  }
}

// ---------------------------------------------------------------------------------------------
// Decoding: few query rows per KV head (s_q·group <= kDecodeRows, as forward_kvcache's steps). The
// tiled path above packs every K/V tile of the cache first: per decoding step a copy of the whole
// cache (b = 8, s_k = 4k, h = 32, h_k = 8, d = 128, fp32: 183-202 ms and 65k page faults per call,
// torch's SDPA 69 ms; now 3.1 ms at 16 threads on a Xeon, no faults). Here a task (batch entry,
// group of KV heads (kDecodeGroupHeads), key split) walks its keys a chunk at a time, its KV heads'
// s_q·group query rows sharing every K and V row read where the cache holds it (detail::kv_offset:
// contiguous, batch index or pages). With fp32 caches, and 2-byte ones with few rows per KV head
// (decode_in_place), the products read those rows themselves (fold_chunk_in_place); otherwise the
// chunk's rows are first copied into a small fp32 stage (stage_chunk) that each KV head folds
// (fold_chunk). fp32 products for every dtype, Q scaled as in the tiled path's fp32 products. Extra
// memory: a workspace per thread of O(heads·group·s_q·d) plus the stage (decode_chunk_keys), and
// the split partials; never the cache's size.
// Up to 32 rows per KV head, by measurement against the tiled path (2 threads, AMD EPYC, s_k = 4k,
// h = 32, d = 128, fp32): 16 rows (h_k = 8, s_q = 4) 2.2x faster, 32 rows (s_q = 8) 1.6x, 64 rows
// (s_q = 16) 1.16x, 128 rows 0.95x; MHA at 64 rows 0.85x with s_k = 512.
constexpr int kDecodeRows = 32;
constexpr int kDecodeMaxKeys = 64;
// Key splits per batch entry, up to 16 (the tiled path's 8 leave 8 tasks at b = 1): Xeon, b = 1,
// h = 32, h_k = 8, d = 128, fp32, s_k = 32k: 3.3 ms at 16 threads against 6.9 with 8 splits; 32-64
// splits gained at 16 threads on some shapes but lost at 2 (fp32 32k 16.4-17.7 ms against 15.0: more
// partials for the last task to merge).
constexpr int kDecodeMaxSplits = 16;
// KV heads per task: a task folds the query rows of up to 8 KV heads (all of GQA's 8, groups of 8
// with more), so that a key's staged rows stay a few KiB and multi-head caches give more tasks (Xeon,
// MHA, 16 threads: 832-891 us against 974-1166 with all 32 heads in one task).
// This shape group, min(kDecodeGroupHeads, h_k), alone sets the chunk's keys and the splits (the
// arithmetic); the thread count then sets the KV heads per task (task_heads). The bits stay: each
// KV head folds its own rows alone (fold_chunk; dot_rows_at and pv_rows_at head by head) over the
// same chunks and splits in any group. The group is halved while the call has fewer tasks than
// threads (the dynamic schedule wants a few per thread to even out the threads' rates); head-major
// (a head's keys one run in any group) and fp32 caches, while it has fewer than
// kDecodeTasksPerThread per thread; heads side by side in 2-byte caches, while it has fewer than
// kDecodeTasksPerThreadRuns; side by side, only while a task's run of a key row stays >=
// kDecodeMinRun bytes. Against groups of 8 (Xeon, 16 threads, b = 1, h = 32, d = 128, alternated
// rounds): head-major 1.10-1.56x at all 13 shapes, heads side by side in bf16 1.22x at s_k = 32k;
// fp32 side by side at 8 tasks per thread against 1 (groups of 2 instead of 8 at h_k = 8), 5
// alternated rounds: GQA s_q = 2 / 4 / 8 1.13 / 1.22 / 1.41x, MHA s_q = 1 1.11x, GQA s_q = 1
// 0.98-1.07x; bf16 side by side at 8 lost (MHA s_q = 4 0.90-0.91x).
constexpr int kDecodeGroupHeads = 8;
constexpr int kDecodeTasksPerThread = 8;      // head-major memory, fp32 caches
constexpr int kDecodeTasksPerThreadRuns = 2;  // heads side by side, 2-byte caches
constexpr int kDecodeMinRun = 1024;           // bytes of a key row per task, heads side by side
// With 2-byte caches, up to this many query rows per KV head the products read K and V where the
// cache holds them (fold_chunk_in_place, Kernels::dot_rows_at and pv_rows_at); with more, they fold
// an fp32 stage (stage_chunk), which converts each element once where the in-place scores convert
// K's rows once per row block (m / dot_row_block times). In place against the stage (Xeon, 2
// threads, b = 1, s_k = 4k, d = 128): MHA bf16 s_q = 1 2890 against 7193 us, GQA 32/8 s_q = 1 995
// against 1314; bf16 16 rows tied (2364 against 2214), and on AVX2 (2 rows per block) 8 rows lost
// (3888 against 2965), hence also m <= 2·dot_row_block. fp32 caches (nothing to convert) fold in
// place at every row count: 16 rows 1823 against 2654 us. So do bf16 caches where the scores come
// from pairs (decode_pairs: nothing to convert in K, and P·V converts each V element once for all
// rows): against the stage (AMD EPYC, Zen 4, two rounds), 1 thread: GQA 32/8 s_q 4 and 8 (16 and
// 32 rows) 1.34-1.47x, MHA s_q 16 1.42-1.43x, 134-537 MB calls 0.92-1.03x; 2 threads: head-major
// 134-537 MB 1.39-1.47x, on (b, s, h_k, d) caches 0.93-1.00x, d = 64 1.22x. Xeon, medians of 5-6
// alternated rounds: head-major 0.93-1.13x at 16 threads; (b, s, h_k, d) caches 0.81-1.00x at 16-32
// rows while their walk was keys outermost, and since walk_heads_outer, at 1, 2 and 16 threads,
// b = 8 s_q 4 0.97-1.20x, b = 1 32k s_q 2 0.96-1.79x, 4k keys s_q 4-8 0.86-1.08x.
constexpr int kDecodeInPlaceRows = 8;

// With bf16 caches, where the table has the pair products (Kernels::dot_pairs_at), the products
// read the cache in place at every row count and the scores come from pairs: K's rows as they are
// against Q's unscaled pairs, nothing converted, the scale placed by score_scale as in the tiled
// path's pair products; P·V stays fp32 (pv_rows_at).
// Against fp32 scores, Xeon (AMX table), medians of 6 alternated rounds: MHA 1.03-1.42x at 1, 2
// and 16 threads, GQA 32/8 0.95-1.35x, calls of 134 MB 1.00-1.07x; AMD EPYC (Zen 4), 1 thread:
// 1.07-1.28x. P·V from pairs as well (P rounded, V paired in registers) lost on the Xeon: 0.72-0.88x
// on GQA.
bool decode_pairs(const FwdParams& p, const Kernels& kn) {
  return p.dtype == DType::bf16 && kn.dot_pairs_at != nullptr;
}
bool decode_in_place(const FwdParams& p, const Kernels& kn, int m) {
  return p.dtype == DType::f32 || decode_pairs(p, kn) || m <= std::min(kDecodeInPlaceRows, 2 * kn.dot_row_block);
}
static_assert(kDecodeMaxKeys % 8 == 0, "chunks start on a Philox column group and fill whole 8-lane vectors");

// Keys per chunk: a multiple of 8 up to 64, the chunk's K and V for a task's `heads` KV heads
// (staged as fp32, stage_chunk) within kDecodeStageBytes, so that they stay near the core while the
// heads fold them. 512 KiB (this AMD EPYC's L2) against 256, measured with all KV heads in one task:
// MHA (h_k = 32, d = 128, s_k = 4k) at 16 keys instead of 8, bf16 s_q = 4: 7.9-8.3 ms against
// 9.9-10.9; GQA shapes (64 keys either way at h_k = 8, d = 64, and 32 against 64 at d = 128) equal
// within this machine's noise; 1 MiB no better (a 2 MiB stage on the Xeon: slower, bench/NOTES.md).
constexpr std::int64_t kDecodeStageBytes = 512 << 10;
int decode_chunk_keys(const FwdParams& p, int heads) {
  const std::int64_t per_key = 2 * std::int64_t{heads} * tiles::round_up(p.d, kLanes) * 4;
  return static_cast<int>(std::clamp<std::int64_t>(kDecodeStageBytes / per_key / 8 * 8, 8, kDecodeMaxKeys));
}

// Whether a key's KV heads lie side by side in memory ((b, s, h_k, d) caches and pages), rather
// than each head's keys (head-major: (b, h_k, s, d), torch's SDPA layout and HF transformers'
// caches). The decoding mainloop reads in memory order: keys outermost where heads lie side by
// side, else each head's keys in turn (stage_chunk; Kernels::dot_rows_at and pv_rows_at with
// heads_outer, which also prefetch each block's successor: a block's rows are read a vector of each
// in turn, an order within a page the hardware prefetchers do not follow). Head-major caches
// against keys outermost (Xeon, 3 alternated rounds): 1.18-1.82x at 16 threads, 1.44-2.03x at 2;
// where heads lie side by side, heads outermost lost up to 44%.
bool heads_side_by_side(const detail::Strides& st) { return st.head < st.row; }  // strides >= 0 (validate.cpp)

// The in-place products walk a chunk keys outermost (memory order, where heads lie side by side)
// unless one of two costs of that order applies; then heads outermost, each head's keys in turn with
// the next block's rows prefetched (walk_blocks). The order changes no bits.
// 1. The task's rows, Q, O and the scores of every head, exceed this CPU's L1 (cache_bytes; 32 KiB
//    where the OS does not say): keys outermost, every block's visit of every head passed them
//    through L2. Heads outermost against keys outermost on (b, s, h_k, d) caches, alternated rounds:
//    - AMD EPYC (Zen 5, 48 KiB L1), 3 rounds, past 8 rows: GQA 32/8 s_q 2-8 (8-32 rows of 8 heads,
//      64-256 KiB of rows) 1.10-1.40x at 1 and 2 threads, b = 8 s_q 4 (134 MB) 1.34-1.55x, fp32
//      s_q 4 1.22-1.47x, fp32 s_q 1 (40 KiB) 0.96-1.18x;
//    - Xeon (48 KiB L1), 5 rounds, past 32 KiB: b = 8 s_q 4 1.22-1.37x at 1, 2 and 16 threads,
//      b = 1 32k s_q 2 1.24-1.75x at 1 and 2; fp32 s_q 1 (40 KiB) 0.80-0.90x.
// 2. `streams`: a 2-byte cache larger than the threads' L2s together (decode_streams), whose chunk
//    spans at most kDecodeWalkSpan: the reads come from L3 or DRAM, and the prefetched walk waits
//    less for them. Against keys outermost, GQA 32/8 s_q 1 (4 rows of 8 heads, 128 KiB chunks),
//    Xeon, medians of 4 alternated rounds at 16 / 2 / 1 threads: 134 MB 1.13-1.24 / 1.53-1.67 /
//    1.14x, 537 MB 1.32 / 1.25 / 1.24x, 67 MB (h_k 4, 16k keys, d = 64) 0.98-1.05 / 1.14-1.42 /
//    1.16-1.59x, fp16 134 MB 1.02 / 1.16 / 1.23x. Heads outermost lost where a chunk spans more
//    (MHA, 8 KiB key rows: 512 KiB, 128 pages, visited once per head): Xeon 0.81-0.89x, AMD EPYC
//    0.87-0.91x; and on fp32 caches (Xeon, 33 MB: 0.85-0.90x); and by 10-14% on the EPYC's caches
//    of 4-17 MB at 1 thread (hence the size rule).
constexpr std::int64_t kDecodeWalkSpan = 256 << 10;
// The walk of K or V (strides st) for a task whose rows (Q, O, scores of every head) take
// rows_bytes, over chunks of `keys` keys.
bool walk_heads_outer(const FwdParams& p, const detail::Strides& st, std::int64_t rows_bytes, int keys, bool streams) {
  if (!heads_side_by_side(st)) return true;
  if (streams && std::int64_t{keys} * st.row * static_cast<std::int64_t>(dtype_size(p.dtype)) <= kDecodeWalkSpan)
    return true;
  return rows_bytes > cache_bytes(1, 32 << 10);
}
// decode_streams' floor (cpu_backend.hpp): on the AMD EPYC at 1 thread, GQA calls of 4 and 17 MB
// (over its 1 MiB L2, inside its 32 MiB L3) ran 0.90x and 0.86x heads outermost, 67-134 MB 1.12-1.23x.
constexpr std::int64_t kDecodeStreamMin = 32 << 20;

// KV heads per task for a call of `threads` threads: the shape's group `heads` (`splits` splits per
// item), halved by the rule at kDecodeGroupHeads (one thread has nothing to balance).
int task_heads(const FwdParams& p, int heads, int splits, int threads) {
  const auto tasks = [&](int g) { return std::int64_t{p.batch} * ((p.h_k + g - 1) / g) * splits; };
  // A key's heads side by side: the group's run of the row; head-major: a head's keys, any group.
  const bool side_by_side = heads_side_by_side(p.k_stride);
  const auto runs_ok = [&](int g) {
    return !side_by_side || std::int64_t{g} * p.d * static_cast<std::int64_t>(dtype_size(p.dtype)) >= kDecodeMinRun;
  };
  const int per_thread = side_by_side && dtype_size(p.dtype) == 2 ? kDecodeTasksPerThreadRuns : kDecodeTasksPerThread;
  while (heads > 1) {
    const int half = (heads + 1) / 2;
    const bool few = threads > 1 && tasks(heads) < std::int64_t{per_thread} * threads && runs_ok(half);
    if (tasks(heads) >= threads && !few) break;
    heads = half;
  }
  return heads;
}

// A task's rows: row hq·len_q + i is query head hq0 + hq (hq0 = hk0·group, its first KV head's
// first), query row i; its KV head hk0 + hk's rows are the contiguous run [hk·m, (hk + 1)·m),
// m = len_q·group.
struct DecodeWorkspace {
  int dp = 0, dp2 = 0;
  AlignedFloats q;   // (rows, dp)  scale · Q
  std::vector<std::uint32_t> q2;  // (rows, dp2)  Q's pairs along d, unscaled, zero past them (decode_pairs)
  AlignedFloats o;   // (rows, dp)  unnormalised output
  std::vector<RowState> state;  // (rows)
  std::vector<float> slope;     // (rows)
  std::vector<const void*> k_rows, v_rows;  // (heads, keys)  addresses of the chunk's K and V rows
  // (heads, keys, dp)  the chunk's K and V rows in fp32, zero past d (and K past the keys to 8); only
  // where some batch entry stages (decode_in_place)
  AlignedFloats kc, vc;
  // (kDecodeRows, cols) one KV head's scores, then probabilities, or (rows, cols) every head's (in
  // place); cols: the chunk's keys rounded up to 8
  AlignedFloats s;
  float m_run[kDecodeRows], sums[kDecodeRows];
  bool streams = false;  // this call's decode_streams
};

// The calling thread's workspace, kept across calls (allocated per call it was page faults per
// call), grown to this call's sizes: Q's fp32 rows, or its pairs (decode_pairs).
DecodeWorkspace& decode_workspace(int rows, int keys, int heads, bool staged, bool pairs, const FwdParams& p) {
  thread_local DecodeWorkspace ws;
  const auto grow = [](auto& v, std::size_t n) {
    if (v.size() < n) v.resize(n);
  };
  ws.dp = tiles::round_up(p.d, kLanes);
  ws.dp2 = tiles::round_up((p.d + 1) / 2, kLanes);
  if (pairs)
    grow(ws.q2, static_cast<std::size_t>(rows) * ws.dp2);
  else
    grow(ws.q, static_cast<std::size_t>(rows) * ws.dp);
  grow(ws.o, static_cast<std::size_t>(rows) * ws.dp);
  grow(ws.state, rows);
  grow(ws.slope, rows);
  if (staged) {
    grow(ws.kc, static_cast<std::size_t>(heads) * keys * ws.dp);
    grow(ws.vc, static_cast<std::size_t>(heads) * keys * ws.dp);
  }
  grow(ws.k_rows, static_cast<std::size_t>(heads) * keys);
  grow(ws.v_rows, static_cast<std::size_t>(heads) * keys);
  grow(ws.s, static_cast<std::size_t>(std::max(rows, kDecodeRows)) * kDecodeMaxKeys);
  return ws;
}

// ws.k_rows, ws.v_rows <- the addresses of the n keys from row row0 of entry b, KV heads hk0 ..
// hk0 + heads: one kv_offset per head without pages; with pages one block-table entry (and division)
// per page for every head and both tensors (pages of one row: per key, where a lookup per key, head
// and tensor took page-1 calls to 1.13-1.38x a contiguous cache's time, EPYC).
void chunk_rows(const FwdParams& p, int b, int hk0, int heads, std::int64_t row0, int n, int keys, DecodeWorkspace& ws) {
  const auto* k_base = static_cast<const char*>(p.k);
  const auto* v_base = static_cast<const char*>(p.v);
  const auto esize = static_cast<std::int64_t>(dtype_size(p.dtype));
  const detail::Strides &ks = p.k_stride, &vs = p.v_stride;
  if (p.kv.block_table == nullptr) {
    for (int hk = 0; hk < heads; ++hk) {
      const std::int64_t k0 = detail::kv_offset(p, ks, b, row0, hk0 + hk), v0 = detail::kv_offset(p, vs, b, row0, hk0 + hk);
      for (int c = 0; c < n; ++c) {
        ws.k_rows[hk * keys + c] = k_base + (k0 + c * ks.row) * esize;
        ws.v_rows[hk * keys + c] = v_base + (v0 + c * vs.row) * esize;
      }
    }
    return;
  }
  const detail::KvCacheParams& kv = p.kv;
  for (int c = 0; c < n;) {
    const detail::PageRow at = detail::page_row(kv, b, row0 + c);
    const int run = std::min(n - c, kv.page_size - at.row);
    for (int hk = 0; hk < heads; ++hk) {
      const std::int64_t k0 = at.page * ks.batch + static_cast<std::int64_t>(at.row) * ks.row + (hk0 + hk) * ks.head;
      const std::int64_t v0 = at.page * vs.batch + static_cast<std::int64_t>(at.row) * vs.row + (hk0 + hk) * vs.head;
      for (int u = 0; u < run; ++u) {
        ws.k_rows[hk * keys + c + u] = k_base + (k0 + u * ks.row) * esize;
        ws.v_rows[hk * keys + c + u] = v_base + (v0 + u * vs.row) * esize;
      }
    }
    c += run;
  }
}

// ws.kc, ws.vc <- the n keys from row row0 of entry b, KV heads hk0 .. hk0 + heads, as fp32 rows of
// dp, copied in memory order (heads_side_by_side), which the hardware prefetchers follow (a software
// prefetch of the next chunk did no better): with a key's heads side by side, copied head by head, a
// task read 512-byte runs 4 KiB apart and took 1.4-2.1x as long (2 threads, AMD EPYC, b = 1, s_k =
// 32k, h_k = 8); head-major caches copied head by head, bf16 s_q = 4: 1.2-1.5x faster there,
// 0.99-1.21x on the Xeon.
void stage_chunk(const FwdParams& p, int b, int hk0, int heads, std::int64_t row0, int n, int keys,
                 DecodeWorkspace& ws) {
  const int dp = ws.dp;
  chunk_rows(p, b, hk0, heads, row0, n, keys, ws);
  const bool keys_outer = heads_side_by_side(p.k_stride);
  for (int i = 0; i < n * heads; ++i) {
    const int c = keys_outer ? i / heads : i % n, hk = keys_outer ? i % heads : i / n;
    const std::ptrdiff_t at = static_cast<std::ptrdiff_t>(hk) * keys + c;
    float* k = ws.kc.data() + at * dp;
    float* v = ws.vc.data() + at * dp;
    tiles::load_row(ws.k_rows[at], p.dtype, 0, p.d, 1.0f, k);
    tiles::load_row(ws.v_rows[at], p.dtype, 0, p.d, 1.0f, v);
    std::fill(k + p.d, k + dp, 0.0f);
    std::fill(v + p.d, v + dp, 0.0f);
  }
  for (int hk = 0; hk < heads; ++hk)  // score columns past the keys read zero rows
    std::fill(ws.kc.data() + (static_cast<std::ptrdiff_t>(hk) * keys + n) * dp,
              ws.kc.data() + (static_cast<std::ptrdiff_t>(hk) * keys + tiles::round_up(n, kLanes)) * dp, 0.0f);
}

// KV head hk's m rows (from row r0 = hk·m of the task's, state and o there) over keys j0 .. j0 + n
// given their scores s (m rows of cols, scaled as sc says): the stages of fold_keys between the
// products: the scale, transform_row, Kernels::softmax_rows, the monoid's merge, dropout, the
// rescale of O. s then holds the probabilities.
void fold_scores(const FwdParams& p, const Kernels& kn, const SeqInfo& si, const detail::Band& band, ScoreScale sc,
                 int hq0, int hk, int m, std::int64_t j0, int n, bool first, float* s, DecodeWorkspace& ws) {
  const int dp = ws.dp, cols = tiles::round_up(n, kLanes), r0 = hk * m;
  float* o = ws.o.data() + static_cast<std::ptrdiff_t>(r0) * dp;
  RowState* state = ws.state.data() + r0;
  const bool needs_mask = band.tile_needs_mask(0, si.len_q, j0, j0 + n, si.len_k);
  for (int r = 0; r < m; ++r) {
    if (sc.rows) kn.scale_row(s + r * cols, cols, p.scale);
    transform_row(p, band, ws.slope[r0 + r], needs_mask, (r0 + r) % si.len_q, j0, n, cols, s + r * cols);
    ws.m_run[r] = state[r].m;
  }
  kn.softmax_rows(s, m, cols, sc.mul, kLazyRescale, ws.m_run, ws.sums);
  for (int r = 0; r < m; ++r) {
    float fa, fb;
    state[r] = detail::merge(state[r], RowState{ws.m_run[r], ws.sums[r]}, &fa, &fb);
    if (p.dropout_p > 0.0f)
      apply_dropout(p, detail::dropout_row_id(p, hq0 + (r0 + r) / si.len_q, si, (r0 + r) % si.len_q), j0, n,
                    s + r * cols);
    if (!first && fa != 1.0f) kn.scale_row(o + r * dp, dp, fa);
  }
}

// KV head hk's m rows folded over the staged chunk: scores, fold_scores, O += P·V.
void fold_chunk(const FwdParams& p, const Kernels& kn, const SeqInfo& si, const detail::Band& band, int hq0, int hk,
                int m, std::int64_t j0, int n, int keys, bool first, DecodeWorkspace& ws) {
  const int dp = ws.dp, cols = tiles::round_up(n, kLanes), r0 = hk * m;
  const float* k = ws.kc.data() + static_cast<std::ptrdiff_t>(hk) * keys * dp;  // (cols, dp)
  const float* v = ws.vc.data() + static_cast<std::ptrdiff_t>(hk) * keys * dp;  // (n, dp)
  kn.dot_rows(m, cols, dp, ws.q.data() + static_cast<std::ptrdiff_t>(r0) * dp, dp, k, dp, ws.s.data(), cols);
  fold_scores(p, kn, si, band, score_scale(p, false), hq0, hk, m, j0, n, first, ws.s.data(), ws);
  float* o = ws.o.data() + static_cast<std::ptrdiff_t>(r0) * dp;
  (first ? kn.gemm : kn.gemm_acc)(m, dp, n, ws.s.data(), cols, v, dp, o, dp);
}

// The chunk's KV heads folded with K and V read where the cache holds them (Kernels::dot_rows_at,
// pv_rows_at, in the order walk_heads_outer picks): every head's scores, each head's fold_scores,
// every head's O += P·V. The same arithmetic as fold_chunk over a stage.
void fold_chunk_in_place(const FwdParams& p, const Kernels& kn, const SeqInfo& si, const detail::Band& band, int b,
                         int hk0, int heads, int m, std::int64_t j0, int n, int keys, bool first, DecodeWorkspace& ws) {
  const int dp = ws.dp, cols = tiles::round_up(n, kLanes);
  const int t = p.dtype == DType::f32 ? kRowF32 : p.dtype == DType::bf16 ? kRowBf16 : kRowF16;
  chunk_rows(p, b, hk0, heads, si.k_row0 + j0, n, keys, ws);
  for (int hk = 0; hk < heads; ++hk) {  // scores past the keys: -inf (transform_row)
    const void** k_rows = ws.k_rows.data() + hk * keys;
    std::fill(k_rows + n, k_rows + cols, k_rows[0]);
  }
  if (first) std::fill(ws.o.begin(), ws.o.begin() + static_cast<std::ptrdiff_t>(heads) * m * dp, 0.0f);
  const bool pairs = decode_pairs(p, kn);
  const std::int64_t rows_bytes =  // the task's Q (fp32 rows or pairs), O and scores
      4 * std::int64_t{heads} * m * ((pairs ? ws.dp2 : dp) + dp + tiles::round_up(keys, kLanes));
  const bool k_heads_outer = walk_heads_outer(p, p.k_stride, rows_bytes, keys, ws.streams);
  if (pairs)
    kn.dot_pairs_at(heads, m, cols, p.d, ws.q2.data(), ws.dp2, ws.k_rows.data(), keys, k_heads_outer, ws.s.data(), cols);
  else
    kn.dot_rows_at[t](heads, m, cols, p.d, ws.q.data(), dp, ws.k_rows.data(), keys, k_heads_outer, ws.s.data(), cols);
  for (int hk = 0; hk < heads; ++hk)
    fold_scores(p, kn, si, band, score_scale(p, pairs), hk0 * p.group(), hk, m, j0, n, first,
                ws.s.data() + static_cast<std::ptrdiff_t>(hk) * m * cols, ws);
  kn.pv_rows_at[t](heads, m, n, p.d, ws.s.data(), cols, ws.v_rows.data(), keys,
                   walk_heads_outer(p, p.v_stride, rows_bytes, keys, ws.streams), ws.o.data(), dp);
}

// ws.o, ws.state <- the fold of key chunks [c_lo, c_hi) (chunks of `keys` keys of entry b) into
// the query rows of KV heads hk0 .. hk0 + heads of entry b, unnormalised; returns the number of
// rows, heads·group·len_q.
int decode_fold(const FwdParams& p, const Kernels& kn, int b, int hk0, int heads, int keys, std::int64_t c_lo,
                std::int64_t c_hi, DecodeWorkspace& ws) {
  const SeqInfo si = seq_info(p, b);
  const detail::Band band = band_of(p, si);
  const int dp = ws.dp, m = si.len_q * p.group(), rows = heads * m, hq0 = hk0 * p.group();
  if (rows == 0) return 0;
  const bool pairs = decode_pairs(p, kn);
  for (int r = 0; r < rows; ++r) {
    const int hq = hq0 + r / si.len_q;
    const std::int64_t at = detail::offset_of(p.q_stride, b, si.q_row0 + r % si.len_q, hq);
    if (pairs) {
      std::uint32_t* q2 = ws.q2.data() + static_cast<std::ptrdiff_t>(r) * ws.dp2;
      tiles::pairs_of_row(static_cast<const std::uint16_t*>(p.q) + at, p.d, q2);
      std::fill(q2 + (p.d + 1) / 2, q2 + ws.dp2, 0u);
    } else {
      float* q = ws.q.data() + static_cast<std::ptrdiff_t>(r) * dp;
      tiles::load_row(p.q, p.dtype, at, p.d, p.scale, q);
      std::fill(q + p.d, q + dp, 0.0f);
    }
    ws.slope[r] = detail::alibi_slope(p, b, hq);
    ws.state[r] = RowState{};
  }
  // Chunks that hold a visible key for some row.
  const std::int64_t k_begin = std::max(band.key_begin(0, si.len_k) / keys * keys, c_lo * keys);
  const std::int64_t k_end = std::min<std::int64_t>({band.key_end(si.len_q, si.len_k), si.len_k, c_hi * keys});
  const bool in_place = decode_in_place(p, kn, m);
  for (std::int64_t j0 = k_begin; j0 < k_end; j0 += keys) {
    const int n = static_cast<int>(std::min<std::int64_t>(keys, k_end - j0));
    if (in_place) {
      fold_chunk_in_place(p, kn, si, band, b, hk0, heads, m, j0, n, keys, j0 == k_begin, ws);
      continue;
    }
    stage_chunk(p, b, hk0, heads, si.k_row0 + j0, n, keys, ws);
    for (int hk = 0; hk < heads; ++hk) fold_chunk(p, kn, si, band, hq0, hk, m, j0, n, keys, j0 == k_begin, ws);
  }
  if (k_begin >= k_end) std::fill(ws.o.begin(), ws.o.begin() + static_cast<std::ptrdiff_t>(rows) * dp, 0.0f);
  if (in_place && p.dtype == DType::bf16) kn.join_bf16_rows(ws.o.data(), rows, p.d, dp);  // pv_rows_at's split
  return rows;
}

// The tiled forward's tasks dealt as contiguous ranges: a thread takes its own range's tasks in
// order, then the other ranges' from their fronts (thread i + 1's first). Tasks are numbered query
// block innermost, so a thread's consecutive tasks fold the same head's (or KV group's) packed K/V,
// which its L2 then holds where it fits there; one range shared by all threads is OpenMP's dynamic
// schedule, which deals consecutive blocks to different threads. Which thread runs a task never
// changes its bits (finish_task merges splits in split order).
class RangeQueue {
 public:
  RangeQueue(std::int64_t tasks, int ranges) : n_(std::max(ranges, 1)), r_(std::make_unique<Range[]>(n_)) {
    for (int j = 0; j < n_; ++j) {
      r_[j].next.store(tasks * j / n_, std::memory_order_relaxed);
      r_[j].end = tasks * (j + 1) / n_;
    }
  }
  // Runs f(task) for tasks until none is left; every thread of the team calls it (a team smaller than
  // the ranges leaves the missing threads' ranges to the others).
  template <class F>
  void run(int thread, F&& f) {
    for (int k = 0; k < n_; ++k) {
      Range& r = r_[(thread + k) % n_];
      for (std::int64_t t; (t = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) f(t);
    }
  }

 private:
  struct alignas(64) Range {
    std::atomic<std::int64_t> next{0};
    std::int64_t end = 0;
  };
  int n_;
  std::unique_ptr<Range[]> r_;
};

}  // namespace

void flash_forward_tiled(const FwdParams& p, int num_threads, const Kernels& kn) {
  const Tasks tasks = make_tasks(p);
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  PackedKV kv;
  size_packed(p, kn, kv);
  const std::int64_t n_tiles = kv.first.back() * p.h_k;
  Partials parts;
  if (tasks.splits > 1) parts.place(tasks.splits * tasks.items(), tasks.items(), kBlockM, tiles::round_up(p.d, kLanes));
  // A range per thread where one KV head's packed tiles fit in half this CPU's L2, the packing in the
  // same order so that a thread packs about the tiles it folds first; else one shared range (ranges
  // everywhere read 0.92-1.02x at 4k keys, 1-4 MiB a head). Xeon, 16 threads, b = 1, h = 8, medians
  // of 7 alternated rounds against one shared range: bf16 1k keys 1.13-1.18x, 2k 1.04-1.09x, fp32 1k
  // 1.00-1.05x; 2 threads within the VM's spread (their dynamic schedule already gives a thread
  // consecutive blocks of one head).
  std::int64_t head_blocks = 0;
  for (int b = 0; b < p.batch; ++b) head_blocks = std::max(head_blocks, kv.first[b + 1] - kv.first[b]);
  const bool ranges = head_blocks * (kv.kt_elems() + kv.v_elems()) * 4 <= cache_bytes(2, 1 << 20) / 2;
  RangeQueue queue(tasks.splits * tasks.items(), ranges ? threads : 1);
  // One parallel region, one barrier (after packing): on a loaded 2-core machine every fork/join or
  // barrier cost ~10 ms (a descheduled worker holds up the others), 3x the whole compute at s = 256.
  // A barrier before merging the splits cost as much (b = 1, h = 8, s = 1k, d = 64, 2 threads:
  // 56-80 ms without splits, 72-102 with splits and a barrier), hence the merge by the last task.
#pragma omp parallel num_threads(threads)
  {
    Workspace ws(p.d, kv.pairs);
    profile::Lap lap;
#pragma omp for schedule(static) nowait
    for (std::int64_t u = 0; u < n_tiles; ++u) pack_tile(p, kv, ranges ? kv.tile_in_item_order(u, p.h_k) : u, ws);
    lap.charge(profile::pack);
#pragma omp barrier
    lap.charge(profile::merge);  // waiting for the other threads' packing
    // Under causal masks a block's work grows with its row index; the steals from other ranges
    // even it out. Splits outermost.
    queue.run(omp_get_thread_num(), [&](std::int64_t task) {
      const std::int64_t t = task % tasks.items();
      const int c = static_cast<int>(task / tasks.items());
      const Item it = item_at(tasks, t);
      const std::int64_t kblocks = (seq_info(p, it.b).len_k + kBlockN - 1) / kBlockN;
      lap.charge(profile::merge);  // the loop's scheduling since the last task
      const int m = fold_keys(p, kn, kv, it, kblocks * c / tasks.splits, kblocks * (c + 1) / tasks.splits, ws);
      lap = profile::Lap();
      finish_task(parts, tasks.splits, tasks.items(), task, m, ws.o.data(), ws.state.data(),
                  [&](const float* o, const RowState* state) {
                    store_rows(p, it.b, it.hq, static_cast<std::int64_t>(it.qb) * kBlockM, m, o, ws.dp, state);
                  });
      lap.charge(tasks.splits == 1 ? profile::store : profile::merge);
    });
    profile::flush();
  }
}

bool decode_path(const FwdParams& p) {
  for (int b = 0; b < p.batch; ++b)
    if (static_cast<std::int64_t>(seq_info(p, b).len_q) * p.group() > kDecodeRows) return false;
  return true;
}

bool decode_streams(const FwdParams& p, int threads) {
  if (dtype_size(p.dtype) != 2) return false;
  std::int64_t keys = 0;
  for (int b = 0; b < p.batch; ++b) keys += seq_info(p, b).len_k;
  const std::int64_t bytes = 2 * keys * p.h_k * p.d * static_cast<std::int64_t>(dtype_size(p.dtype));
  return bytes > kDecodeStreamMin && bytes > std::int64_t{threads} * cache_bytes(2, 1 << 20);
}

// Decoding, the second mainloop (decode_fold above): one parallel region without a barrier, tasks
// (batch entry, group of KV heads, key split), splits by the shape as the tiled path's.
void flash_forward_decode(const FwdParams& p, int num_threads, const Kernels& kn) {
  if (!decode_path(p))  // the workspace's score rows (kDecodeRows)
    throw Error("q", "flash_forward_decode takes at most " + std::to_string(kDecodeRows) +
                         " query rows per KV head (s_q·group); use flash_forward");
  // The arithmetic from the shape's head groups (kDecodeGroupHeads): chunk keys and splits.
  const int shape_heads = std::min(kDecodeGroupHeads, p.h_k);
  const int keys = decode_chunk_keys(p, shape_heads);
  std::int64_t max_chunks = 0;
  for (int b = 0; b < p.batch; ++b)
    max_chunks = std::max<std::int64_t>(max_chunks, (seq_info(p, b).len_k + keys - 1) / keys);
  const int splits = key_splits(std::int64_t{p.batch} * ((p.h_k + shape_heads - 1) / shape_heads), max_chunks,
                                kDecodeMaxSplits);
  // The partition from the thread count: tasks (batch entry, group of group_heads KV heads, split).
  const int wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int group_heads = task_heads(p, shape_heads, splits, wanted);
  const int head_groups = (p.h_k + group_heads - 1) / group_heads;
  const std::int64_t items = std::int64_t{p.batch} * head_groups;
  const std::int64_t tasks = splits * items;
  int rows = 0;
  bool staged = false;
  for (int b = 0; b < p.batch; ++b) {
    const int m = seq_info(p, b).len_q * p.group();
    rows = std::max(rows, m * group_heads);
    staged |= m > 0 && !decode_in_place(p, kn, m);
  }
  const int dp = tiles::round_up(p.d, kLanes);
  // The partials in the calling thread's kept scratch (fresh memory per call would be page faults
  // per call): splits · items slots of a head group's group_heads·group·s_q rows, about the bytes of
  // the shape's groups (task_heads trades rows per slot for slots).
  Partials parts;
  if (splits > 1) parts.place(tasks, items, rows, dp, kept_scratch(Partials::bytes(tasks, items, rows, dp), parts.owned));
  const int threads = static_cast<int>(std::min<std::int64_t>(wanted, tasks));
  const bool streams = decode_streams(p, std::max(threads, 1));
#pragma omp parallel num_threads(std::max(threads, 1))
  {
    DecodeWorkspace& ws = decode_workspace(rows, keys, group_heads, staged, decode_pairs(p, kn), p);
    ws.streams = streams;
#pragma omp for schedule(dynamic, 1) nowait
    for (std::int64_t task = 0; task < tasks; ++task) {
      const std::int64_t item = task % items;
      const int b = static_cast<int>(item / head_groups), hk0 = static_cast<int>(item % head_groups) * group_heads;
      const int heads = std::min(group_heads, p.h_k - hk0), c = static_cast<int>(task / items);
      const SeqInfo si = seq_info(p, b);
      const std::int64_t chunks = (si.len_k + keys - 1) / keys;
      const int m = decode_fold(p, kn, b, hk0, heads, keys, chunks * c / splits, chunks * (c + 1) / splits, ws);
      finish_task(parts, splits, items, task, m, ws.o.data(), ws.state.data(), [&](const float* o, const RowState* state) {
        const int hq0 = hk0 * p.group();
        for (int hq = 0; hq < heads * p.group(); ++hq)
          store_rows(p, b, hq0 + hq, 0, si.len_q, o + static_cast<std::ptrdiff_t>(hq) * si.len_q * dp, dp,
                     state + hq * si.len_q);
      });
    }
  }
}

void flash_forward(const FwdParams& p, int num_threads, const Kernels& kn) {
  if (decode_path(p))
    flash_forward_decode(p, num_threads, kn);
  else
    flash_forward_tiled(p, num_threads, kn);
}

#ifdef FLASHMONOID_CPU_PROFILE
namespace profile {
namespace {
thread_local unsigned long long t_cycles[kPhases];
std::atomic<unsigned long long> g_cycles[kPhases];
constexpr const char* kNames[kPhases] = {"pack K/V", "load Q", "S = QK^T", "softmax", "P to pairs, merge",
                                         "rescale O", "O += PV", "store O", "scheduling, split merge"};
}  // namespace
Lap::Lap() : last_(__rdtsc()) {}
void Lap::charge(Phase phase) {
  const unsigned long long now = __rdtsc();
  t_cycles[phase] += now - last_;
  last_ = now;
}
void flush() {
  for (int i = 0; i < kPhases; ++i) {
    g_cycles[i].fetch_add(t_cycles[i], std::memory_order_relaxed);
    t_cycles[i] = 0;
  }
}
void print(std::FILE* out) {
  unsigned long long c[kPhases], total = 0;
  for (int i = 0; i < kPhases; ++i) total += c[i] = g_cycles[i].exchange(0);
  std::fprintf(out, "cpu profile (rdtsc cycles over all threads):");
  for (int i = 0; i < kPhases; ++i)
    std::fprintf(out, " %s %.1f%%;", kNames[i], total ? 100.0 * static_cast<double>(c[i]) / static_cast<double>(total) : 0.0);
  std::fprintf(out, " total %.3g\n", static_cast<double>(total));
}
}  // namespace profile
#endif

}  // namespace flashmonoid::cpu
