// CPU flash forward: for each (batch, head, block of kBlockM query rows) a fold of the
// online-softmax monoid (detail/monoid.hpp) over blocks of kBlockN keys. Per thread the only
// scores alive are one (kBlockM, kBlockN) tile. Extra memory: K and V packed to fp32 once
// (O(total_k·h_k·d)) and the per-thread tiles (O(kBlockM·d)).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/flash_tiles.hpp"
#include "cpu/kernels.hpp"
#include "flashmonoid/detail/monoid.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace flashmonoid::cpu {
namespace {

using detail::FwdParams;
using detail::RowState;
using detail::SeqInfo;
using tiles::kLanes;

// Tile sizes from a sweep of kBlockM in {48, 96, 192} × kBlockN in {32, 64, 128, 256} at s = 2048,
// d = 64 and 128, one thread (CPU time, the machine being shared): kBlockN = 128 was 3-9% faster
// than 64 (half the rescales of O per key), 256 lost 20% at d = 128 (the (d, kBlockN) Kᵀ tile left
// L1); kBlockM barely mattered, 96 = 16 micro-kernel row blocks of 6.
// kBlockN is a multiple of 4 so that tiles start on a Philox column group.
constexpr int kBlockM = 96;
constexpr int kBlockN = 128;
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
  if (t.items() > 0) {
    const std::int64_t want = (kTargetTasks + t.items() - 1) / t.items();
    t.splits = static_cast<int>(std::clamp<std::int64_t>(std::min(want, max_key_blocks), 1, kMaxSplits));
  }
  return t;
}

// K and V of every (batch, KV head) converted to fp32 once, in the layouts the products read:
// Kᵀ tiles (d, kBlockN) and V tiles (kBlockN, dp), zero-padded, each stored as column panels of
// kn.panel columns, panel after panel (a panel is (rows, panel), contiguous). Repacking them for
// every query block took 40% of the forward's time at d = 64 (perf, s = 4k); packing once costs
// O(total_k·h_k·d) memory, the O(N·d) that the issue allows, and GQA groups share it.
// Panels (tiles::to_panels): +4-17% at s = 2k, one thread, over row-major tiles.
struct PackedKV {
  int d = 0, dp = 0, panel = 0, vp = 0;  // vp: dp rounded up to whole panels
  std::vector<std::int64_t> first;  // (batch + 1) first key block of batch entry b
  // Uninitialised: pack_tile writes every element, so the pages are first touched by the threads
  // that pack them rather than zero-filled by the calling thread before the parallel region
  // (clear_page and page faults: ~3% of a 1-thread call at s = 1k, d = 64; no gain measurable at
  // 2 threads on the 2-core VM).
  std::unique_ptr<float[]> kt, v;

  std::int64_t tile(int b, std::int64_t block, int hk, int h_k) const { return (first[b] + block) * h_k + hk; }
  float* kt_tile(std::int64_t t) const { return kt.get() + t * d * kBlockN; }
  float* v_tile(std::int64_t t) const { return v.get() + t * kBlockN * vp; }
};

// Sizes kv for p; pack_tile() fills tile t (key block t / h_k, KV head t % h_k).
void size_packed(const FwdParams& p, int panel, PackedKV& kv) {
  kv.d = p.d;
  kv.dp = tiles::round_up(p.d, kLanes);
  kv.panel = panel;
  kv.vp = tiles::round_up(kv.dp, panel);
  kv.first.assign(p.batch + 1, 0);
  for (int b = 0; b < p.batch; ++b) kv.first[b + 1] = kv.first[b] + (seq_info(p, b).len_k + kBlockN - 1) / kBlockN;
  const std::int64_t n_tiles = kv.first.back() * p.h_k;
  kv.kt = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(n_tiles) * p.d * kBlockN);
  kv.v = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(n_tiles) * kBlockN * kv.vp);
}

void pack_tile(const FwdParams& p, PackedKV& kv, std::int64_t t, float* row, float* staging) {
  const std::int64_t block_global = t / p.h_k;
  const int hk = static_cast<int>(t % p.h_k);
  const int b = static_cast<int>(std::upper_bound(kv.first.begin(), kv.first.end(), block_global) - kv.first.begin()) - 1;
  const SeqInfo si = seq_info(p, b);
  const std::int64_t j0 = (block_global - kv.first[b]) * kBlockN;
  const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
  // Rows through detail::kv_offset: a KV cache's batch index or block table, when there is one.
  auto k_row = [&](int r) { return detail::kv_offset(p, p.k_stride, b, si.k_row0 + j0 + r, hk); };
  auto v_row = [&](int r) { return detail::kv_offset(p, p.v_stride, b, si.k_row0 + j0 + r, hk); };
  tiles::load_rows_transposed(p.k, p.dtype, k_row, n, p.d, kBlockN, 1.0f, row, staging);
  tiles::to_panels(staging, p.d, kBlockN, kBlockN, kv.panel, kv.kt_tile(t));
  tiles::load_rows(p.v, p.dtype, v_row, n, kBlockN, p.d, kv.dp, 1.0f, staging);
  tiles::to_panels(staging, kBlockN, kv.dp, kv.dp, kv.panel, kv.v_tile(t));
}

// One thread's tiles. dp = d rounded up to the 8-wide vector.
struct Workspace {
  int d, dp;
  std::vector<float> q;   // (kBlockM, d)   scale·log2(e) · Q
  std::vector<float> s;   // (kBlockM, kBlockN) scores, then probabilities
  std::vector<float> o;   // (kBlockM, dp)  unnormalised output
  std::vector<float> row;  // (d)       staging row for packing
  std::vector<float> staging;   // (max(d, kBlockN), max(kBlockN, dp))  a K or V tile before to_panels
  std::vector<RowState> state;  // (kBlockM)
  std::vector<float> alpha;     // (kBlockM)  rescale of o for the current key block
  explicit Workspace(int d_)
      : d(d_), dp(tiles::round_up(d_, kLanes)), q(kBlockM * d), s(kBlockM * kBlockN),
        o(static_cast<std::size_t>(kBlockM) * dp), row(d_),
        staging(static_cast<std::size_t>(std::max(d_, kBlockN)) * std::max(kBlockN, dp)), state(kBlockM),
        alpha(kBlockM) {}
};

// Score transforms in the order detail/mask.hpp defines them, in natural units (tiles::kLog2e
// says why), on row i (in the sequence) of the tile, keys j0 .. j0 + n; columns [n, kBlockN)
// become -inf.
void transform_row(const FwdParams& p, const detail::Band& band, float slope, bool needs_mask, std::int64_t i,
                   std::int64_t j0, int n, float* s) {
  if (p.softcap > 0.0f) {
    const float inv = 1.0f / p.softcap;
    for (int c = 0; c < n; ++c) s[c] = p.softcap * std::tanh(s[c] * inv);
  }
  if (p.alibi != nullptr)
    for (int c = 0; c < n; ++c) s[c] += detail::alibi_bias(slope, i, j0 + c, band.diag);
  if (needs_mask)
    for (int c = 0; c < n; ++c)
      if (!band.visible(i, j0 + c)) s[c] = -INFINITY;
  for (int c = n; c < kBlockN; ++c) s[c] = -INFINITY;
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

// ws.o, ws.state <- the fold of key blocks [kb_lo, kb_hi) (on the kBlockN grid of entry it.b) into
// the item's query rows, unnormalised; returns the number of rows m.
int fold_keys(const FwdParams& p, const Kernels& kn, const PackedKV& kv, Item it, std::int64_t kb_lo,
              std::int64_t kb_hi, Workspace& ws) {
  const SeqInfo si = seq_info(p, it.b);
  const detail::Band band = band_of(p, si);
  const int hk = it.hq / p.group();
  const int d = ws.d, dp = ws.dp;
  const std::int64_t i0 = static_cast<std::int64_t>(it.qb) * kBlockM;
  const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
  const float slope = detail::alibi_slope(p, it.b, it.hq);

  tiles::load_tile(p.q, p.dtype, p.q_stride, it.b, si.q_row0 + i0, it.hq, m, m, d, d, p.scale, ws.q.data());
  std::fill(ws.o.begin(), ws.o.end(), 0.0f);
  std::fill(ws.state.begin(), ws.state.end(), RowState{});

  // Key blocks on the kBlockN grid that hold a visible key for some row of this block.
  const std::int64_t k_begin = std::max(band.key_begin(i0, si.len_k) / kBlockN * kBlockN, kb_lo * kBlockN);
  const std::int64_t k_end = std::min<std::int64_t>({band.key_end(i0 + m, si.len_k), si.len_k, kb_hi * kBlockN});
  for (std::int64_t j0 = k_begin; j0 < k_end; j0 += kBlockN) {
    const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
    const std::int64_t tile = kv.tile(it.b, j0 / kBlockN, hk, p.h_k);

    // S (m, kBlockN) = (scale · Q) (m, d) · Kᵀ (d, kBlockN): scores in natural units
    tiles::gemm_panels(kn.gemm, m, kBlockN, d, ws.q.data(), d, kv.kt_tile(tile), d, kv.panel, ws.s.data(), kBlockN);

    const bool needs_mask = band.tile_needs_mask(i0, i0 + m, j0, j0 + n, si.len_k);
    // The K/V tiles of one head (1 MiB at s = 2k, d = 64) exceed L2 and come from L3 for every
    // query block: while the rows' softmax runs, V of this key block and Kᵀ of the next are fetched.
    const bool next = j0 + kBlockN < k_end;
    const std::int64_t kt_bytes = static_cast<std::int64_t>(d) * kBlockN * 4, v_bytes = kBlockN * kv.vp * 4;
    for (int r = 0; r < m; ++r) {
      float* s = ws.s.data() + r * kBlockN;
      const std::int64_t i = i0 + r;
      tiles::prefetch_l2(kv.v_tile(tile), v_bytes, r, m);
      if (next) tiles::prefetch_l2(kv.kt_tile(tile + p.h_k), kt_bytes, r, m);
      transform_row(p, band, slope, needs_mask, i, j0, n, s);
      // The tile's partial state is expressed against m_new >= the running state's m, so that
      // merging it is just the rescale of the running state (its own factor is 2^0 = 1): m_new is
      // the tile's max only where that exceeds the running m by more than kLazyRescale, else the
      // running m itself (its factor 1, so O is not rescaled).
      const float tile_max = kn.row_max(s, kBlockN) * tiles::kLog2e;  // log2 units, as the state's m
      const float m_new = tile_max > ws.state[r].m + kLazyRescale ? tile_max : ws.state[r].m;
      float sum = 0.0f;
      if (m_new == -INFINITY)
        std::fill(s, s + kBlockN, 0.0f);  // every key so far masked: nothing to add
      else
        sum = kn.exp2_sub_sum(s, kBlockN, tiles::kLog2e, m_new);
      float fa, fb;
      ws.state[r] = detail::merge(ws.state[r], RowState{m_new, sum}, &fa, &fb);
      ws.alpha[r] = fa;
      if (p.dropout_p > 0.0f) apply_dropout(p, detail::dropout_row_id(p, it.hq, si, i), j0, n, s);
    }
    for (int r = 0; r < m; ++r)
      if (ws.alpha[r] != 1.0f) kn.scale_row(ws.o.data() + r * dp, dp, ws.alpha[r]);
    // O (m, dp) += P (m, n) · V (n, dp)
    tiles::gemm_panels(kn.gemm_acc, m, dp, n, ws.s.data(), kBlockN, kv.v_tile(tile), kBlockN, kv.panel, ws.o.data(), dp);
  }
  return m;
}

// out, lse of the item's m rows from finished states: out = o / l, lse = ln 2·(m + log2 l).
void store_rows(const FwdParams& p, const Kernels& kn, Item it, int m, float* o, int dp, const RowState* state) {
  const SeqInfo si = seq_info(p, it.b);
  for (int r = 0; r < m; ++r) {
    const std::int64_t i = static_cast<std::int64_t>(it.qb) * kBlockM + r;
    float* row = o + r * dp;
    kn.scale_row(row, dp, detail::finish_inv_l(state[r]));
    tiles::store_row(p.out, p.dtype, detail::offset_of(p.o_stride, it.b, si.q_row0 + i, it.hq), p.d, row);
    p.lse[detail::lse_index(p, it.b, it.hq, si, i)] = detail::finish_lse(state[r]);
  }
}

// Partial states of the split tasks: (split, item) slots of kBlockM rows, uninitialised (a slot
// is read only where its task wrote it), and per item the number of its splits done.
struct Partials {
  int dp = 0;
  std::unique_ptr<float[]> o;          // (splits · items, kBlockM, dp)
  std::unique_ptr<RowState[]> state;   // (splits · items, kBlockM)
  std::unique_ptr<std::atomic<int>[]> done;  // (items)
  float* o_slot(std::int64_t slot) const { return o.get() + slot * kBlockM * dp; }
  RowState* state_slot(std::int64_t slot) const { return state.get() + slot * kBlockM; }
};

// Item t's rows: the monoid fold of its splits' partial states, in split order, then stored.
void merge_splits(const FwdParams& p, const Kernels& kn, const Tasks& tasks, const Partials& parts, std::int64_t t,
                  Workspace& ws) {
  const Item it = item_at(tasks, t);
  const SeqInfo si = seq_info(p, it.b);
  const std::int64_t i0 = static_cast<std::int64_t>(it.qb) * kBlockM;
  const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
  const int dp = ws.dp;
  for (int r = 0; r < m; ++r) {
    RowState acc{};
    float* o = ws.o.data() + r * dp;
    std::fill(o, o + dp, 0.0f);
    for (int c = 0; c < tasks.splits; ++c) {
      const std::int64_t slot = c * tasks.items() + t;
      const RowState part = parts.state_slot(slot)[r];
      if (part.m == -INFINITY) continue;  // the identity: no visible key in this split
      float fa, fb;
      acc = detail::merge(acc, part, &fa, &fb);
      const float* po = parts.o_slot(slot) + r * dp;
      for (int x = 0; x < dp; ++x) o[x] = fa * o[x] + fb * po[x];
    }
    ws.state[r] = acc;
  }
  store_rows(p, kn, it, m, ws.o.data(), dp, ws.state.data());
}

}  // namespace

void flash_forward(const FwdParams& p, int num_threads, const Kernels& kn) {
  const Tasks tasks = make_tasks(p);
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  PackedKV kv;
  size_packed(p, kn.panel, kv);
  const std::int64_t n_tiles = kv.first.back() * p.h_k;
  Partials parts;
  if (tasks.splits > 1) {
    const std::size_t slots = static_cast<std::size_t>(tasks.splits) * tasks.items();
    parts.dp = tiles::round_up(p.d, kLanes);
    parts.o = std::make_unique_for_overwrite<float[]>(slots * kBlockM * parts.dp);
    parts.state = std::make_unique<RowState[]>(slots * kBlockM);
    parts.done = std::make_unique<std::atomic<int>[]>(static_cast<std::size_t>(tasks.items()));
  }
  // One parallel region, one barrier (after packing): on a loaded 2-core machine every fork/join or
  // barrier cost ~10 ms (a descheduled worker holds up the others), 3x the whole compute at s = 256.
  // A barrier before merging the splits cost as much (b = 1, h = 8, s = 1k, d = 64, 2 threads:
  // 56-80 ms without splits, 72-102 with splits and a barrier), hence the merge by the last task.
#pragma omp parallel num_threads(threads)
  {
    Workspace ws(p.d);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < n_tiles; ++t) pack_tile(p, kv, t, ws.row.data(), ws.staging.data());
    // Dynamic: under causal masks a block's work grows with its row index. Splits outermost, so
    // that the first tasks taken cover every item once.
#pragma omp for schedule(dynamic, 1) nowait
    for (std::int64_t task = 0; task < tasks.splits * tasks.items(); ++task) {
      const std::int64_t t = task % tasks.items();
      const int c = static_cast<int>(task / tasks.items());
      const Item it = item_at(tasks, t);
      const std::int64_t kblocks = (seq_info(p, it.b).len_k + kBlockN - 1) / kBlockN;
      const int m = fold_keys(p, kn, kv, it, kblocks * c / tasks.splits, kblocks * (c + 1) / tasks.splits, ws);
      if (tasks.splits == 1) {
        store_rows(p, kn, it, m, ws.o.data(), ws.dp, ws.state.data());
        continue;
      }
      std::copy(ws.o.begin(), ws.o.begin() + static_cast<std::ptrdiff_t>(m) * ws.dp, parts.o_slot(task));
      std::copy(ws.state.begin(), ws.state.begin() + m, parts.state_slot(task));
      // acq_rel: the last task sees every other split's partial. The fold's order is the split
      // order whichever task runs it, so the bits do not depend on the schedule.
      if (parts.done[t].fetch_add(1, std::memory_order_acq_rel) == tasks.splits - 1)
        merge_splits(p, kn, tasks, parts, t, ws);
    }
  }
}

}  // namespace flashmonoid::cpu
