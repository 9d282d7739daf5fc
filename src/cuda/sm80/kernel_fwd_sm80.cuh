// The sm80 forward kernel (FlashAttention-2 schedule on mma.sync): one block per (query block,
// head or KV head, batch[, KV split]). Q (kBlockM, kHeadDim) stays in shared memory; K and V tiles
// (kBlockN, kHeadDim) stream through a cp.async ring: as (K, V) pairs kStages deep, so one barrier
// per step and the next tiles' copies overlap the whole of S = Q·Kᵀ, softmax and O += P·V; or, where
// a pair ring would not fit (hdim 256, 64 keys), as single K or V slots with a barrier before each
// product, so a slot is refilled as soon as its product is done. Key tiles are visited last
// to first, so the diagonal (masked) tile of a causal block comes first. Only this file and
// warp_gemm_sm80.cuh are specific to sm80; softmax, masks, epilogues and the combine live in common/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "api/params.hpp"
#include "common/block_range.cuh"
#include "common/epilogue.cuh"
#include "common/pdl.cuh"
#include "common/score_mod.cuh"
#include "common/softmax.cuh"
#include "common/trace.cuh"
#include "sm80/mma_sm80.cuh"
#include "sm80/paged_kv_sm80.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/tile_fwd_sm80.hpp"
#include "sm80/warp_gemm_sm80.cuh"

namespace flashmonoid::cuda {

struct FwdKernelArgs {
  detail::FwdParams p;
  int pack = 1;          // query heads interleaved into the rows of one block (GQA with short s_q)
  int num_m_blocks = 0;  // per (head group, batch): ceil(max_seqlen_q · pack / kBlockM)
  int num_splits = 1;
  int kv_slots = 0;  // slots of a kv_slots ring (fwd_kv_slots, 2 to 5); unused by (K, V) pair rings
  float* out_partial = nullptr;  // num_splits > 1 only
  float* lse_partial = nullptr;
  // Split-KV blocks that share their row block's key tiles (common/block_range.cuh: SharedKeyTiles,
  // the narrow tile only): a counter per (query block, head group, batch) in the workspace, and the
  // launch's epoch << 32. Null: fixed splits.
  unsigned long long* tile_counters = nullptr;
  unsigned long long counter_tag = 0;
  // Launched under the kernel before it (common/pdl.cuh: forward_kvcache's append, which writes the
  // rotated q and the appended K/V rows); only ever for the cache tiles (fwd_cache_tile). Kernels
  // launched otherwise do not wait.
  bool programmatic = false;
  // Launched under whatever kernel is before it in the stream (the cache tiles without an append of
  // their own: the previous decoding call's kernel lets it launch early): waits for that kernel
  // before reading anything, cache_seqlens included.
  bool wait_at_entry = false;
  // The kernel after this one may launch under it (pdl.cuh: the split-KV combine, or the next
  // forward_kvcache call's append): the blocks let it launch once their mainloops are done.
  bool programmatic_dependents = false;
};

// kShareTiles: the split blocks share their row block's key tiles (args.tile_counters; the narrow
// tile's pair ring only). A variant of its own: carried as a run-time choice, the positions'
// bookkeeping slowed the fixed splits' loop by 1-3.5% (paged 134 MB shapes the most; H100).
// kPaged: K/V through a block table (the cache tiles only). A variant of its own for the same
// reason: as a run-time choice (the block-table window carried by every call) contiguous decoding
// ran 1.1-1.5% slower at 134 MB, s_q 4 1.6-5.9%, paged 0.1-1.4% (H200); one kernel holding a loop
// of each kind cost paged calls 2-4%.
template <class T, int kHeadDim, FwdTileKind kKind, bool kScoreMods, bool kShareTiles = false, bool kPaged = false>
__global__ void __launch_bounds__(fwd_tile_sm80(kHeadDim, kKind).warps * 32, fwd_tile_sm80(kHeadDim, kKind).min_blocks)
    fwd_kernel_sm80(const __grid_constant__ FwdKernelArgs args) {
  constexpr FwdTileSm80 kTile = fwd_tile_sm80(kHeadDim, kKind);
  constexpr int kBlockM = kTile.block_m, kBlockN = kTile.block_n, kNWarps = kTile.warps;
  constexpr int kThreads = kNWarps * 32;
  // The decode tile's warps split each key tile (tile_fwd_sm80.hpp: warps_on_keys): every warp holds
  // all kBlockM rows and kWarpKeys of the keys; the other tiles' warps split the rows.
  constexpr bool kWarpsOnKeys = kTile.warps_on_keys;
  constexpr int kMTiles = kWarpsOnKeys ? kBlockM / 16 : kBlockM / (16 * kNWarps);  // m16 tiles per warp
  constexpr int kWarpKeys = kWarpsOnKeys ? kBlockN / kNWarps : kBlockN;
  constexpr int kNTiles = kWarpKeys / 8;
  constexpr int kDTiles = kHeadDim / 8;
  static_assert(kMTiles * 16 * (kWarpsOnKeys ? 1 : kNWarps) == kBlockM,
                "kBlockM must be a whole number of m16 tiles per warp");
  static_assert(kWarpKeys % 16 == 0, "a warp's keys are whole k16 steps of P·V");
  constexpr bool kQInRegisters = kTile.q_in_registers;
  constexpr bool kSlotRing = kTile.kv_slots;

  constexpr int kStages = kTile.stages;
  constexpr int kSub = kTile.sub;  // key tiles per (K, V) stage of a pair ring
  constexpr int kStageElems = 2 * kSub * kBlockN * kHeadDim;
  constexpr int kSlotElems = kBlockN * kHeadDim;
  static_assert(kSlotRing || kStages >= 2, "the K/V ring needs a stage in flight while one is read");
  static_assert(!(kSlotRing && kQInRegisters), "the kv_slots ring reads Q from shared memory every step");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // (kBlockM, kHeadDim), later the output staging tile
  // kStages stages of K (kBlockN, kHeadDim) then V (kBlockN, kHeadDim).
  // Or, for a kv_slots ring, args.kv_slots slots of K or V (kBlockN, kHeadDim).
  T* sK = sQ + kBlockM * kHeadDim;

  const detail::FwdParams& p = args.p;
  if (args.wait_at_entry) pdl_wait();
  trace_mark(p, TraceKernel::forward, 0);
  const int split = static_cast<int>(blockIdx.x) % args.num_splits;
  // Reversed so that the longest causal blocks (the last query rows) start first.
  const int m_block = args.num_m_blocks - 1 - static_cast<int>(blockIdx.x) / args.num_splits;
  const int b = blockIdx.z;
  const detail::SeqInfo si = detail::seq_info(p, b);
  const BlockRows blk{b, static_cast<int>(blockIdx.y) * args.pack, args.pack, si.len_q * args.pack, si};
  const int R0 = m_block * kBlockM;
  if (R0 >= blk.rows_total) return;  // varlen: a sequence shorter than the longest
  const int kv_head = blk.head_base / (p.h / p.h_k);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row0 = kWarpsOnKeys ? 0 : warp * 16 * kMTiles;
  const int warp_key0 = kWarpsOnKeys ? warp * kWarpKeys : 0;  // the warp's first key in each tile
  const bool warp_active = R0 + warp_row0 < blk.rows_total;  // has at least one real row
  const RowCoords<kMTiles> rows(R0 + warp_row0, blk.rows_total, args.pack, blk.head_base, lane);

  // Key tiles this block (and split) visits: those the band lets any of its rows see.
  const detail::Band band = detail::band_of(p, si);
  const int i_first = blk.query(R0);
  const int i_end = blk.query((R0 + kBlockM < blk.rows_total ? R0 + kBlockM : blk.rows_total) - 1) + 1;
  static_assert(!kShareTiles || (fwd_cache_tile(kKind) && !kSlotRing && kSub == 1),
                "shared key tiles are written for the narrow tile's (K, V) pair ring");
  const KeyTiles tiles = key_tiles<kBlockN>(band, i_first, i_end, si.len_k, kShareTiles ? 0 : split,
                                            kShareTiles ? 1 : args.num_splits);
  const int s_lo = tiles.lo, s_hi = tiles.hi;

  const ScoreMod mod(p);
  const float mul = kScoreMods ? mod.softmax_mul() : p.scale_log2;
  const bool dropout = kScoreMods && p.dropout_p > 0.0f;

  float o[kMTiles][kDTiles][4] = {};  // (16·kMTiles, kHeadDim) per warp, unnormalised
  OnlineSoftmax<kMTiles> softmax;
  QFragments<kHeadDim, kMTiles> q_frag;  // (16·kMTiles, kHeadDim) of this warp, when kQInRegisters

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  auto q_row = [&](int r) -> const T* {
    const int R = R0 + r;
    if (R >= blk.rows_total) return nullptr;
    return q + detail::offset_of(p.q_stride, b, si.q_row0 + blk.query(R), blk.head(R));
  };
  // Row 0 of this (batch, KV head)'s keys; tile n starts kBlockN rows further per step. Only the
  // narrow tile reads K/V through a KV cache's batch index or block table (plan_fwd_sm80 gives
  // such calls that tile; a paged cache has no row 0 and is gathered by paged_kv_sm80.cuh): in the
  // wide tiles the cache addressing cost hdim 128 a 4-byte spill (ptxas, sm90), so they keep the
  // plain strided copy.
  constexpr bool kCacheAddressing = fwd_cache_tile(kKind);
  static_assert(!kPaged || (kCacheAddressing && !kShareTiles), "a block table is read by the cache tiles' fixed splits");
  // What a paged copy carries from one step to the next: the tile's block-table entries.
  using Window = std::conditional_t<kPaged, PageWindow, NoWindow>;
  const T* k_seq = k + (kCacheAddressing ? (kPaged ? 0 : detail::kv_offset(p, p.k_stride, b, si.k_row0, kv_head))
                                         : detail::offset_of(p.k_stride, b, si.k_row0, kv_head));
  const T* v_seq = v + (kCacheAddressing ? (kPaged ? 0 : detail::kv_offset(p, p.v_stride, b, si.k_row0, kv_head))
                                         : detail::offset_of(p.v_stride, b, si.k_row0, kv_head));
  // Rows [key0, key0 + kRows) of K or V into a ring slot.
  auto load_keys = [&](auto rows, T* dst, bool is_v, int key0) {
    constexpr int kRows = decltype(rows)::value;
    const std::int64_t stride = is_v ? p.v_stride.row : p.k_stride.row;
    load_rows_async<kRows, kHeadDim, kThreads>(dst, (is_v ? v_seq : k_seq) + key0 * stride, stride, si.len_k - key0,
                                               p.d);
  };
  static_assert(!kCacheAddressing || (!kSlotRing && kSub == 1), "cache addressing is written for the 1-tile pair ring");
  // The (K, V) pair of key tile n into a ring stage; a paged cache's through the block-table
  // entries `window` (page_window of the tile, read one step earlier).
  auto load_pair = [&](T* stage, int n, Window window) {
    if constexpr (kPaged)
      load_paged_kv_async<kBlockN, kHeadDim, kThreads>(stage, stage + kBlockN * kHeadDim, p, b, kv_head,
                                                       static_cast<int>(si.k_row0) + n * kBlockN, si.len_k - n * kBlockN,
                                                       window);
    else {
      load_keys(std::integral_constant<int, kBlockN>{}, stage, false, n * kBlockN);
      load_keys(std::integral_constant<int, kBlockN>{}, stage + kBlockN * kHeadDim, true, n * kBlockN);
    }
  };
  const int num_tiles = tiles.count();
  const LdsmLane<kHeadDim> q_addr = q_lane<kHeadDim>(sQ, warp_row0, lane);
  const LdsmLane<kHeadDim> k_addr = k_lane<kHeadDim>(sK + warp_key0 * kHeadDim, lane);
  const LdsmLane<kHeadDim> v_addr =
      v_lane<kHeadDim>((kSlotRing ? sK : sK + kSub * kBlockN * kHeadDim) + warp_key0 * kHeadDim, lane);
  // s (16·kMTiles, kBlockN) of this warp = P of key tile key0, from the K tile k_bytes into the ring.
  auto scores = [&](float (&s)[kMTiles][kNTiles][4], std::uint32_t k_bytes, int tile_key0) {
    const int key0 = tile_key0 + warp_key0;  // of the warp's first column
    if constexpr (kQInRegisters)
      gemm_qk<T>(s, q_frag, k_addr.plus(k_bytes));
    else
      gemm_qk<T>(s, q_addr, k_addr.plus(k_bytes));
    // Per-row ALiBi slopes and dropout row ids are rebuilt per tile inside these branches: kept
    // for the whole loop they were 4 registers per m tile and spilled 16 bytes at hdim 128.
    if (kScoreMods && mod.active()) {
      float slope_log2[2 * kMTiles];
#pragma unroll
      for (int r = 0; r < 2 * kMTiles; ++r)
        slope_log2[r] = mod.alibi ? detail::alibi_slope(p, b, rows.head(r)) * kLog2e : 0.0f;
      mod.apply(s, slope_log2, rows, band.diag, key0, lane);
    }
    if (tiles.needs_mask(tile_key0))  // per tile: its unmasked range holds every warp's keys
      apply_mask(s, band, rows, si.len_k, key0, lane);
    softmax.fold(s, o, mul);
    if (dropout) {
      std::uint32_t row_id[2 * kMTiles];
#pragma unroll
      for (int r = 0; r < 2 * kMTiles; ++r) row_id[r] = detail::dropout_row_id(p, rows.head(r), si, rows.i(r));
      apply_dropout(s, p, row_id, key0, lane);
    }
  };
  if constexpr (!kSlotRing && kSub == 1) {
    // Step t reads visit position g_t into ring stage t % kStages: tile s_hi - 1 - g_t, K and V as one
    // group, while g_t < num_tiles (SharedKeyTiles: g_t = t for a fixed split). Positions are known
    // kAhead steps early: a step copies tile g_{t + kStages - 1} and reads the block-table entries of
    // g_{t + kStages}.
    constexpr int kAhead = kStages + 1;
    SharedKeyTiles order;
    if constexpr (kShareTiles) {
      order.counter =
          args.tile_counters + (static_cast<std::int64_t>(b) * gridDim.y + blockIdx.y) * args.num_m_blocks + m_block;
      order.tag = args.counter_tag;
      order.stride = args.num_splits;
      order.first = split;
    }
    // Whether any position past the fixed ones is left to take from the counter.
    const bool take = kShareTiles && kAhead * args.num_splits < num_tiles;
    __shared__ int s_taken[2];  // g_{t + kAhead} for step t, in slot t % 2 (written by thread 0 a step earlier)
    auto load_kv = [&](int t, int g, Window window) {
      if (g < num_tiles) load_pair(sK + (t % kStages) * kStageElems, s_hi - 1 - g, window);
      cp_async_commit();  // empty past the last tile, so that wait_group counts stay uniform
    };
    // Block-table entries of position g (paged caches): read a whole step before its copies are issued.
    auto window_of = [&](int g) {
      const int n = s_hi - 1 - g;
      if constexpr (kPaged)
        return g < num_tiles
                   ? page_window<kBlockN>(p, b, static_cast<int>(si.k_row0) + n * kBlockN, si.len_k - n * kBlockN)
                   : PageWindow{};
      else
        return Window{};
    };
    int pos[kAhead];  // g_t, ..., g_{t + kStages} (kShareTiles)
#pragma unroll
    for (int j = 0; j < kAhead; ++j) pos[j] = order.fixed(j);
    // Position g_{t + j}: a fixed split's is t + j, computed, so its loop is the plain one.
    auto at = [&](int t, int j) { return kShareTiles ? pos[j] : t + j; };
    if (at(0, 0) < num_tiles) {
      // The block table's entries for the first copies: the append does not write the block table,
      // so these reads are in flight while the append finishes.
      Window first_windows[kStages - 1];
#pragma unroll
      for (int t = 0; t < kStages - 1; ++t) first_windows[t] = window_of(at(0, t));
      // Launched under forward_kvcache's append (pdl.cuh), which writes the rotated q and the appended
      // K/V rows: every read of them waits for it.
      if (args.programmatic) pdl_wait();
      trace_mark(p, TraceKernel::forward, 1);
      load_tile_async<kBlockM, kHeadDim, kThreads>(sQ, q_row, p.d, q);
#pragma unroll
      for (int t = 0; t < kStages - 1; ++t) load_kv(t, at(0, t), first_windows[t]);
      // Thread 0 takes g_{kAhead} now (claiming the counter: the combine of the call before set it
      // back to 0, and that call ended before this grid started, or before its pdl_wait) and keeps
      // the take of g_{kAhead + 1} in flight across step 0.
      unsigned long long pending = 0;
      bool taking = take && threadIdx.x == 0;
      if (taking) {
        const int g = order.taken<kAhead>(order.take_first());
        s_taken[0] = g;
        taking = g < num_tiles;
        if (taking) pending = order.take_next();
      }
      // The next copy's entries, read after the first copies are issued (in flight until tile 0
      // lands): held across the wait too, they spilled 4 bytes at hdim 256 with score modifiers.
      Window window = window_of(at(0, kStages - 1));
#pragma unroll 1
      for (int t = 0; at(t, 0) < num_tiles; ++t) {
        const int key0 = (s_hi - 1 - at(t, 0)) * kBlockN;
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile t (and Q) landed; every warp is done with tile t - 1's stage
        load_kv(t + kStages - 1, at(t, kStages - 1), window);  // into the stage tile t - 1 used
        window = window_of(at(t, kStages));
        const int next = take ? s_taken[t & 1] : order.fixed(t + kAhead);
        if (take && threadIdx.x == 0) {
          // g_{t + kAhead + 1}, read at step t + 1; past the last position every later one is too.
          const int g = taking ? order.taken<kAhead>(pending) : num_tiles;
          s_taken[(t + 1) & 1] = g;
          taking = g < num_tiles;
          if (taking) pending = order.take_next();
        }
        if (kQInRegisters && t == 0 && warp_active) load_q_fragments(q_frag, q_addr);
        const std::uint32_t stage_bytes = static_cast<unsigned>(t) % kStages * kStageElems * sizeof(T);

        if (warp_active) {
          float s[kMTiles][kNTiles][4] = {};  // (16·kMTiles, kBlockN) per warp
          scores(s, stage_bytes, key0);
          gemm_pv<T>(o, s, v_addr.plus(stage_bytes));
        }
        if constexpr (kShareTiles) {
#pragma unroll
          for (int j = 0; j + 1 < kAhead; ++j) pos[j] = pos[j + 1];
          pos[kAhead - 1] = next;
        }
      }
    }
  } else if constexpr (!kSlotRing) {
    // Stages of kSub key tiles: one wait and one barrier per kSub tiles (FlashAttention-2 copies and
    // synchronises per 64 or 128 keys), while the scores, softmax and P·V still go one kBlockN tile
    // at a time, so S needs no more registers. Groups are aligned to multiples of kSub tiles (a
    // group's first key is never negative) and visited last to first; a group's tiles outside
    // [s_lo, s_hi) are copied (at most one per block end) but skipped.
    static_assert(!kQInRegisters, "the sub-tiled pair ring reads Q from shared memory every step");
    constexpr int kGroupRows = kSub * kBlockN;
    const int g_hi = num_tiles > 0 ? (s_hi - 1) / kSub : 0, g_lo = s_lo / kSub;
    const int num_groups = num_tiles > 0 ? g_hi - g_lo + 1 : 0;
    auto load_group = [&](int t) {
      if (t < num_groups) {
        const int n0 = (g_hi - t) * kSub;  // the group's first (lowest) tile
        T* stage = sK + (t % kStages) * kStageElems;
        load_keys(std::integral_constant<int, kGroupRows>{}, stage, false, n0 * kBlockN);
        load_keys(std::integral_constant<int, kGroupRows>{}, stage + kGroupRows * kHeadDim, true, n0 * kBlockN);
      }
      cp_async_commit();  // empty past the last group, so that wait_group counts stay uniform
    };
    if (num_groups > 0) {
      load_tile_async<kBlockM, kHeadDim, kThreads>(sQ, q_row, p.d, q);
#pragma unroll
      for (int t = 0; t < kStages - 1; ++t) load_group(t);
#pragma unroll 1
      for (int t = 0; t < num_groups; ++t) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // group t (and Q) landed; every warp is done with group t - 1's stage
        load_group(t + kStages - 1);
        const std::uint32_t stage_bytes = static_cast<unsigned>(t) % kStages * kStageElems * sizeof(T);
        const int n0 = (g_hi - t) * kSub;
        if (warp_active) {
#pragma unroll
          for (int j = kSub - 1; j >= 0; --j) {
            const int n = n0 + j;
            if (n < s_lo || n >= s_hi) continue;
            const std::uint32_t tile_bytes = stage_bytes + j * kBlockN * kHeadDim * sizeof(T);
            float s[kMTiles][kNTiles][4] = {};  // (16·kMTiles, kBlockN) per warp
            scores(s, tile_bytes, n * kBlockN);
            gemm_pv<T>(o, s, v_addr.plus(tile_bytes));
          }
        }
      }
    }
  } else {
    // Ring tile h is K (h even) or V (h odd) of visit step h / 2, in slot h % slots. Before tile h is
    // read, tiles up to h + slots - 2 have been queued (one commit group each), so at most slots - 2
    // may still be pending; the barrier after the wait also means every warp is done with tile
    // h - 1, whose slot then takes tile h + slots - 1.
    const int slots = args.kv_slots;
    auto load_slot = [&](int h, int slot) {
      if (h < 2 * num_tiles) {
        const int n = s_hi - 1 - h / 2;
        load_keys(std::integral_constant<int, kBlockN>{}, sK + slot * kSlotElems, h & 1, n * kBlockN);
      }
      cp_async_commit();  // empty past the last tile, so that wait_group counts stay uniform
    };
    // wait_group takes an immediate: waiting for fewer pending groups than slots - 2 is also correct.
    // With 2 slots nothing may stay pending: V's copy then overlaps Q·Kᵀ, the next K's softmax and P·V.
    auto wait_slot = [&] {
      if (slots >= 5)
        cp_async_wait<3>();
      else if (slots == 4)
        cp_async_wait<2>();
      else if (slots == 3)
        cp_async_wait<1>();
      else
        cp_async_wait<0>();
    };
    if (num_tiles > 0) {
      load_tile_async<kBlockM, kHeadDim, kThreads>(sQ, q_row, p.d, q);  // in tile 0's group
#pragma unroll 1
      for (int h = 0; h < slots - 1; ++h) load_slot(h, h);
      int slot = 0;  // of the next tile to read
#pragma unroll 1
      for (int t = 0; t < num_tiles; ++t) {
        const int key0 = (s_hi - 1 - t) * kBlockN;
        float s[kMTiles][kNTiles][4] = {};  // (16·kMTiles, kBlockN) per warp
        wait_slot();
        __syncthreads();  // K of step t (and Q) landed; every warp is done with V of step t - 1
        load_slot(2 * t + slots - 1, slot == 0 ? slots - 1 : slot - 1);
        const std::uint32_t k_bytes = slot * kSlotElems * sizeof(T);
        slot = slot + 1 == slots ? 0 : slot + 1;
        if (warp_active) scores(s, k_bytes, key0);
        wait_slot();
        __syncthreads();  // V of step t landed; every warp is done with K of step t
        load_slot(2 * t + slots, slot == 0 ? slots - 1 : slot - 1);
        const std::uint32_t v_bytes = slot * kSlotElems * sizeof(T);
        slot = slot + 1 == slots ? 0 : slot + 1;
        if (warp_active) gemm_pv<T>(o, s, v_addr.plus(v_bytes));
      }
    }
  }

  if constexpr (kWarpsOnKeys) {
    // Every warp summed the same rows over its own keys of each tile: warps 1..3 leave their states
    // (O, and m and l per row) in the ring's shared memory, free once every copy has landed and
    // every warp is past its last product, and warp 0 merges them into its own (the monoid's merge,
    // OnlineSoftmax::merge). Word i of lane l of warp w at red[((w - 1) · kWords + i) · 32 + l].
    constexpr int kOWords = kMTiles * kDTiles * 4, kWords = kOWords + 4 * kMTiles;
    static_assert((kNWarps - 1) * kWords * 32 * sizeof(float) <= kStages * kStageElems * sizeof(T),
                  "the warps' states fit in the K/V ring");
    float* red = reinterpret_cast<float*>(sK);
    cp_async_wait<0>();
    __syncthreads();
    if (warp > 0) {
      float* mine = red + (warp - 1) * kWords * 32 + lane;
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int di = 0; di < kDTiles; ++di)
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[((mi * kDTiles + di) * 4 + e) * 32] = o[mi][di][e];
#pragma unroll
      for (int r = 0; r < 2 * kMTiles; ++r) {
        mine[(kOWords + 2 * r) * 32] = softmax.m[r];
        mine[(kOWords + 2 * r + 1) * 32] = softmax.l[r];
      }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll 1
      for (int w = 1; w < kNWarps; ++w) {
        const float* theirs = red + (w - 1) * kWords * 32 + lane;
        float m_b[2 * kMTiles], l_b[2 * kMTiles], fa[2 * kMTiles], fb[2 * kMTiles];
#pragma unroll
        for (int r = 0; r < 2 * kMTiles; ++r) {
          m_b[r] = theirs[(kOWords + 2 * r) * 32];
          l_b[r] = theirs[(kOWords + 2 * r + 1) * 32];
        }
        softmax.merge(m_b, l_b, mul, fa, fb);
        softmax.rescale(o, fa);
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
          for (int di = 0; di < kDTiles; ++di)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mi][di][e] += theirs[((mi * kDTiles + di) * 4 + e) * 32] * fb[2 * mi + e / 2];
      }
    }
  }
  trace_mark(p, TraceKernel::forward, 2);
  // The next kernel (the split-KV combine, or the next call's first kernel) may launch once every
  // block is here; it waits for this grid before reading anything. Not at the start: waiting combine
  // blocks resident beside the mainloops slowed decoding by 7-20% (H200, b <= 8).
  if (args.programmatic_dependents) pdl_launch_dependents();
  float inv_l[2 * kMTiles], lse[2 * kMTiles];
  softmax.finish(mul, inv_l, lse);
  if (dropout) {
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) inv_l[r] *= p.dropout_rescale;
  }
  const bool holds_rows = !kWarpsOnKeys || warp == 0;  // the decode tile's merged state is warp 0's
  if (args.num_splits > 1) {
    if (holds_rows)
      store_partial<kHeadDim>(p, blk, split, args.out_partial, args.lse_partial, o, inv_l, lse, rows, lane);
  } else {
    store_output<T, kHeadDim, kMTiles, kBlockM, kThreads>(p, blk, R0, o, inv_l, lse, rows, sQ, warp_row0, lane,
                                                          holds_rows);
  }
  trace_mark(p, TraceKernel::forward, 3);
}

}  // namespace flashmonoid::cuda
