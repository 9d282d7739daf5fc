// The sm90 forward kernel: warp-specialised, TMA + wgmma (FlashAttention-3's schedule). A persistent
// grid (one block per multiprocessor) walks the (query block, head, batch) work tiles of WorkTiles;
// each block has a producer and `consumers` consumer warpgroups:
// - the producer (warpgroup 0, one thread) loads each work tile's Q into one of q_stages buffers and
//   streams K and V tiles (kBlockN, kHeadDim) through a `stages`-deep ring of shared-memory slots with
//   TMA, one "full" mbarrier per slot that the copy engine completes and one "empty" mbarrier that the
//   consumers release. The ring runs on across work tiles, so the next tile's K/V arrive while this
//   one's last products and epilogue run;
// - each consumer owns 64 query rows: S = Q·Kᵀ by wgmma from shared memory, the online softmax in
//   registers, O += P·V by wgmma with P from registers. S of step t is issued together with P·V of
//   step t - 1, so the softmax of one step runs while the tensor cores work on the other product.
//   With FwdTileSm90::head_split (hdim 256 with score modifiers) both consumers own the same 64 rows,
//   each computing S and the softmax, and P·V into its half of O's columns.
// Softmax, masks, score modifiers, dropout and the lse and register stores are common/'s, in the same
// register layout as sm80's (a wgmma accumulator row pair is an m16n8 tile's), so only the data
// movement (TMA loads, O staged in panels for a TMA store) and the products are sm90 specific.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "api/params.hpp"
#include "common/block_range.cuh"
#include "common/epilogue.cuh"
#include "common/score_mod.cuh"
#include "common/softmax.cuh"
#include "sm90/hopper.cuh"
#include "sm90/tile_fwd_sm90.hpp"

namespace flashmonoid::cuda {

// The split tail's exchange (WorkTiles::tail_units > 0): per merging block (slot) and consumer, a
// tail piece's normalised O and lse in its threads' register order, and a flag the tail's block
// sets to `epoch` once they are written; the head's block waits for it and sets it back to 0. The
// tail's block is the one before the head's (block b takes stretch grid - 1 - b of the tail, so the
// stretch after block b's is block b - 1's): a block waits only for a lower block index, which the
// hardware dispatches first (the rule the sm80 deterministic backward relies on too), so a grid
// larger than the SMs it gets (green contexts, MPS limits, kernels beside it) cannot hang. The epoch
// is new for every launch (and never 0), so a flag left in a reused workspace is never mistaken for
// this launch's; a graph replays its launches' epochs, whose flags were set back to 0.
struct FwdTailSm90 {
  float* o = nullptr;  // (slots, consumers, 64 · kHeadDim)
  float* lse = nullptr;  // (slots, consumers, 128 · 2)
  unsigned long long* flag = nullptr;  // (slots, consumers)
  unsigned long long epoch = 0;
};

struct FwdKernelArgsSm90 {
  CUtensorMap tm_q;  // (d, h, rows, batch), box (64, 1, 64, 1): one panel of one consumer's rows
  CUtensorMap tm_k;  // (d, h_k, rows, batch), box (64, 1, kBlockN, 1)
  CUtensorMap tm_v;
  CUtensorMap tm_o;  // (d, h, rows, batch), box (64, 1, 64, 1): the TMA store of one consumer's O panel
  detail::FwdParams p;
  WorkTiles work;  // num_m_blocks per (head, batch): ceil(max_seqlen_q / kBlockM)
  FwdTailSm90 tail;
};

namespace sm90 {

// Shared memory of one block: tiles in 128-byte-swizzled panels (hopper.cuh), then the barriers.
// Tiles are kCols = fwd_panel_cols_sm90(kHeadDim) columns wide (whole panels).
template <class T, int kHeadDim, FwdTileSm90 kTile>
struct FwdSmem {
  static constexpr int kCols = fwd_panel_cols_sm90(kHeadDim);
  static constexpr int kQElems = 64 * kCols;             // one consumer's Q rows
  static constexpr int kKVElems = kTile.block_n * kCols;  // one K or V slot
  static constexpr int kQStageElems = kTile.block_m() / 64 * kQElems;
  static constexpr int kOElems = kTile.o_rows() * kCols;
  static constexpr int kBarriers = 2 * kTile.q_stages + 4 * kTile.stages;
  // Work-tile records (FwdWork, written by the producer): q_stages + 1 of them, so the one a consumer
  // reads in its epilogue is not rewritten before every consumer has finished that tile.
  static constexpr int kRecords = kTile.q_stages + 1;
  T* base;
  Barrier* bars;  // q_full, q_empty (q_stages each), then k_full, v_full, k_empty, v_empty (stages each)

  __device__ __forceinline__ explicit FwdSmem(unsigned char* raw)
      // Aligned as a generic pointer, unlike the backward's (align_smem_1024): every access here goes
      // through smem_addr or TMA anyway, and with a shared-space base ptxas spilled 4 bytes at hdim 256.
      : base(reinterpret_cast<T*>((reinterpret_cast<std::uintptr_t>(raw) + kSwizzleAtomBytes - 1) &
                                  ~std::uintptr_t(kSwizzleAtomBytes - 1))),
        bars(reinterpret_cast<Barrier*>(base + kTile.q_stages * kQStageElems + 2 * kTile.stages * kKVElems + kOElems)) {}
  // Addresses computed from the slot (an array of slot pointers indexed at run time went to local
  // memory).
  // A consumer's Q rows (with head_split both consumers read the stage's one 64-row tile).
  __device__ __forceinline__ T* q(int stage, int consumer) const {
    return base + stage * kQStageElems + (kTile.head_split ? 0 : consumer) * kQElems;
  }
  __device__ __forceinline__ T* k(int slot) const { return base + kTile.q_stages * kQStageElems + slot * kKVElems; }
  __device__ __forceinline__ T* v(int slot) const { return k(kTile.stages + slot); }
  // One consumer's (64, kCols) O tile for the TMA store (FwdStore::tma), after the K/V ring.
  __device__ __forceinline__ T* o(int consumer) const { return k(2 * kTile.stages) + consumer * kQElems; }
  __device__ __forceinline__ Barrier& q_full(int stage) const { return bars[stage]; }
  __device__ __forceinline__ Barrier& q_empty(int stage) const { return bars[kTile.q_stages + stage]; }
  __device__ __forceinline__ Barrier& k_full(int slot) const { return bars[2 * kTile.q_stages + slot]; }
  __device__ __forceinline__ Barrier& v_full(int slot) const { return bars[2 * kTile.q_stages + kTile.stages + slot]; }
  __device__ __forceinline__ Barrier& k_empty(int slot) const { return bars[2 * kTile.q_stages + 2 * kTile.stages + slot]; }
  __device__ __forceinline__ Barrier& v_empty(int slot) const { return bars[2 * kTile.q_stages + 3 * kTile.stages + slot]; }
  // The record of the n-th Q load (RingPos::n), published with it through q_full.
  template <class Work>
  __device__ __forceinline__ Work& record(unsigned n) const {
    return reinterpret_cast<Work*>(bars + kBarriers)[n % kRecords];
  }

  __device__ __forceinline__ void init_barriers() const {
#pragma unroll
    for (int s = 0; s < kTile.q_stages; ++s) {
      q_full(s).init(1);
      q_empty(s).init(128 * kTile.consumers);  // every consumer thread: each read the tile record
    }
#pragma unroll
    for (int s = 0; s < kTile.stages; ++s) {
      k_full(s).init(1);
      v_full(s).init(1);
      k_empty(s).init(4 * kTile.consumers);
      v_empty(s).init(4 * kTile.consumers);
    }
    fence_barrier_init();
  }
};

// What a work tile is: its rows, sequence, KV head and key tiles. The producer derives it from
// WorkTiles and hands it to the consumers as a shared-memory record (FwdSmem::record).
template <int kBlockM, int kBlockN>
struct FwdWork {
  int head, b, R0, kv_head;
  detail::SeqInfo si;
  detail::Band band;
  KeyTiles tiles;
  // A piece of a split-tail unit (WorkTiles), merged in the exchange slot of the head's block.
  TailRole role = TailRole::whole;

  __device__ __forceinline__ FwdWork(const detail::FwdParams& p, WorkTiles::Tile t)
      : head(t.head), b(t.batch), R0(t.m_block * kBlockM), kv_head(t.head / p.group()),
        si(detail::seq_info(p, t.batch)), band(detail::band_of(p, si)) {
    const int i_end = R0 + kBlockM < si.len_q ? R0 + kBlockM : si.len_q;
    tiles = key_tiles<kBlockN>(band, R0, i_end, si.len_k);
  }
};

// Position in a ring of kStages slots: the n-th use is slot n % kStages with mbarrier phase
// (n / kStages) % 2. One counter (a slot and a phase kept apart cost the hdim-256 consumers a spill).
template <int kStages>
struct RingPos {
  unsigned n = 0;
  __device__ __forceinline__ int slot() const { return static_cast<int>(n % kStages); }
  __device__ __forceinline__ std::uint32_t phase() const { return (n / kStages) & 1; }
  __device__ __forceinline__ void advance() { ++n; }
};

// The producer: one thread issues every TMA copy of the block. Per work tile: the first K tile, then
// Q (into a buffer the consumers have released: with one Q buffer that waits for the previous
// tile's last S product, which the K copy need not), then the
// rest of the K/V ring in visit order.
template <class T, int kHeadDim, FwdTileSm90 kTile, bool kSplitTail>
__device__ __forceinline__ void produce(const FwdKernelArgsSm90& args, const FwdSmem<T, kHeadDim, kTile>& sm,
                                        const WorkTiles& work) {
  // Whole panels, zero-filled past the head dim, count as transaction bytes.
  constexpr int kPanels = fwd_panel_cols_sm90(kHeadDim) / kPanelCols;
  constexpr std::uint32_t kQBytes = kTile.block_m() * kPanels * kPanelCols * sizeof(T);
  constexpr std::uint32_t kKVBytes = kTile.block_n * kPanels * kPanelCols * sizeof(T);
  const detail::FwdParams& p = args.p;
  RingPos<kTile.stages> pos;
  RingPos<kTile.q_stages> qpos;
  auto load_kv = [&](const CUtensorMap* map, T* dst, Barrier& empty, Barrier& full, int row, int batch_coord,
                     int kv_head) {
    empty.wait(pos.phase() ^ 1);
    full.arrive_expect_tx(kKVBytes);
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn)
      tma_load(dst + pn * kTile.block_n * kPanelCols, map, pn * kPanelCols, kv_head, row, batch_coord, full);
  };
  using Work = FwdWork<kTile.block_m(), kTile.block_n>;
  auto run_tile = [&](const Work& w) {
    const int batch_coord = p.is_varlen() ? 0 : w.b;  // varlen tensors are one batch entry of packed rows
    auto load_q = [&] {
      sm.q_empty(qpos.slot()).wait(qpos.phase() ^ 1);
      sm.template record<Work>(qpos.n) = w;  // visible through q_full's release
      sm.q_full(qpos.slot()).arrive_expect_tx(kQBytes);
#pragma unroll
      for (int c = 0; c < kTile.block_m() / 64; ++c)
#pragma unroll
        for (int pn = 0; pn < kPanels; ++pn)
          tma_load(sm.q(qpos.slot(), c) + pn * 64 * kPanelCols, &args.tm_q, pn * kPanelCols, w.head,
                   static_cast<int>(w.si.q_row0 + w.R0 + 64 * c), batch_coord, sm.q_full(qpos.slot()));
      qpos.advance();
    };
    if (w.tiles.count() == 0) load_q();  // the consumers wait for every tile's Q, even one without keys
#pragma unroll 1
    for (int j = 0; j < w.tiles.count(); ++j) {
      const int row = static_cast<int>(w.si.k_row0 + static_cast<std::int64_t>(w.tiles.hi - 1 - j) * kTile.block_n);
      load_kv(&args.tm_k, sm.k(pos.slot()), sm.k_empty(pos.slot()), sm.k_full(pos.slot()), row, batch_coord, w.kv_head);
      if (j == 0) load_q();
      load_kv(&args.tm_v, sm.v(pos.slot()), sm.v_empty(pos.slot()), sm.v_full(pos.slot()), row, batch_coord, w.kv_head);
      pos.advance();
    }
  };
  // Positions t < work.end(grid): the whole units of the rounds; then, with a split tail, this block's
  // stretch of it, cut at key steps (block_range.cuh: tail_position, tail_piece). One loop and one
  // copy of the tile's loads for both, everything derived from t again (kept live across the loads,
  // the tail's values overflowed the producer's 24 registers).
  // The split tail only where the launcher runs it (fwd_split_tail): the other kernels carry none of it.
  const int t_end = work.end(gridDim.x);
  const int t_tail = kSplitTail && work.tail_units > 0 ? 3 * work.tiles_per_unit() : 0;
#pragma unroll 1
  for (int t = 0; t < t_end + t_tail; ++t) {
    WorkTiles::Tile tile;
    TailPiece piece{0, 0, TailRole::whole};
    if (t < t_end) {
      tile = work.at(t, blockIdx.x, gridDim.x);
      if (tile.m_block < 0) continue;
    } else {
      TailPosition at;
      if (!tail_position(work.tail_units, gridDim.x, blockIdx.x, work.tiles_per_unit(), t - t_end, &at)) break;
      const int u = work.units() - work.tail_units + at.i;
      tile = work.unit_tile(u, at.x);
      if (tile.m_block < 0) continue;
      // The unit's step counts: its first tile's, then its second's.
      const int na = Work(p, work.unit_tile(u, 0)).tiles.count();
      const WorkTiles::Tile tb = work.unit_tile(u, 1);
      const int nb = tb.m_block >= 0 ? Work(p, tb).tiles.count() : 0;
      if (!tail_piece(at.x == 0 ? 0 : na, at.x == 0 ? na : nb, na + nb, at.lo, at.hi, gridDim.x, &piece)) continue;
    }
    Work w(p, tile);
    if (w.R0 >= w.si.len_q) continue;  // a varlen sequence shorter than this query block: nothing to do
    if (piece.role != TailRole::whole) {
      w.role = piece.role;
      w.tiles.lo = w.tiles.hi - piece.step_end;
      w.tiles.hi -= piece.step_begin;
    }
    run_tile(w);
  }
  sm.q_empty(qpos.slot()).wait(qpos.phase() ^ 1);
  sm.template record<Work>(qpos.n).head = -1;
  sm.q_full(qpos.slot()).arrive();
}

// S (64, kKeys) = Q (64, kHeadDim) · K (kKeys, kHeadDim)ᵀ for the first kKeys rows of a K slot of
// kBlockN rows, issued (not waited for).
template <class T, int kHeadDim, int kBlockN, int kKeys>
__device__ __forceinline__ void issue_scores(float (&s)[1][kKeys / 8][4], std::uint32_t q_addr, std::uint32_t k_addr) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_ss<0, 0>(flat(s), desc_k_major(q_addr, 64, ks), desc_k_major(k_addr, kBlockN, ks), T{}, ks > 0);
}

// O (64, kHeadDim) += P (64, kKeys) · V (kKeys, kHeadDim) over the first kKeys rows of a V slot of
// kBlockN rows, issued (not waited for).
template <class T, int kHeadDim, int kBlockN, int kKeys = kBlockN>
__device__ __forceinline__ void issue_pv(float (&o)[1][kHeadDim / 8][4], const std::uint32_t (&pa)[kBlockN / 16][4],
                                         std::uint32_t v_addr) {
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) wgmma_rs<1>(flat(o), pa[kk], desc_mn_major(v_addr, kBlockN, kk), T{}, 1);
}

// The first kCols columns of a (64, 8·kNTiles) accumulator tile and of its P fragments: the
// diagonal step's narrow form (FwdTileSm90::diag_keys). A wgmma accumulator's column c is in tile
// c / 8 whatever its N, so the leading tiles of the wide layout are the narrow one.
template <int kCols, int kNTiles>
__device__ __forceinline__ float (&leading_cols(float (&s)[1][kNTiles][4]))[1][kCols / 8][4] {
  static_assert(kCols % 16 == 0 && kCols <= 8 * kNTiles, "whole k steps of P·V");
  return reinterpret_cast<float (&)[1][kCols / 8][4]>(s);
}
template <int kCols, int kKSteps>
__device__ __forceinline__ std::uint32_t (&leading_cols(std::uint32_t (&pa)[kKSteps][4]))[kCols / 16][4] {
  static_assert(kCols % 16 == 0 && kCols <= 16 * kKSteps, "whole k steps of P·V");
  return reinterpret_cast<std::uint32_t (&)[kCols / 16][4]>(pa);
}

// One consumer's side of the split tail's exchange (FwdTailSm90) in slot `slot`: its 128 threads'
// O (64, kHeadDim) and lse in register order, so the head's threads read back exactly the values
// of their own rows and columns.
template <int kHeadDim, int kConsumers>
struct TailExchange {
  float* o;
  float2* lse;
  unsigned long long* flag;
  unsigned long long epoch;
  int consumer, tid;
  __device__ __forceinline__ TailExchange(const FwdTailSm90& t, int slot, int consumer_, int tid_)
      : o(t.o + (static_cast<std::size_t>(slot) * kConsumers + consumer_) * 64 * kHeadDim),
        lse(reinterpret_cast<float2*>(t.lse) + (static_cast<std::size_t>(slot) * kConsumers + consumer_) * 128),
        flag(t.flag + slot * kConsumers + consumer_), epoch(t.epoch), consumer(consumer_), tid(tid_) {}

  // The tail: its normalised O and lse, then (every thread's stores fenced, the warpgroup synced)
  // the flag.
  __device__ __forceinline__ void leave(const float (&acc)[1][kHeadDim / 8][4], const float (&inv_l)[2],
                                        const float (&l)[2]) {
#pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt)
      __stcg(reinterpret_cast<float4*>(o) + dt * 128 + tid,
             make_float4(acc[0][dt][0] * inv_l[0], acc[0][dt][1] * inv_l[0], acc[0][dt][2] * inv_l[1],
                         acc[0][dt][3] * inv_l[1]));
    __stcg(lse + tid, make_float2(l[0], l[1]));
    __threadfence();
    named_sync(1 + consumer, 128);
    if (tid == 0) asm volatile("st.release.gpu.global.u64 [%0], %1;\n" ::"l"(flag), "l"(epoch) : "memory");
  }

  // The head: waits for the tail's flag (set by the previous block's first piece, which waits for
  // nothing, so the wait ends), then takes the tail's part into its softmax state and O
  // (OnlineSoftmax::absorb), before the epilogue finishes them as usual.
  __device__ __forceinline__ void take(OnlineSoftmax<1>& softmax, float (&acc)[1][kHeadDim / 8][4], float mul,
                                       int lane) {
    if (tid == 0) {
      unsigned long long seen;
      do {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(seen) : "l"(flag) : "memory");
      } while (seen != epoch);
      *flag = 0;  // for a replay of this launch (the same epoch)
    }
    named_sync(1 + consumer, 128);
    const float2 lt = __ldcg(lse + tid);
    const float part[2] = {lt.x, lt.y};
    float factor[2], weight[2];
    softmax.absorb(part, mul, lane, factor, weight);
#pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt) {
      const float4 y = __ldcg(reinterpret_cast<const float4*>(o) + dt * 128 + tid);
      acc[0][dt][0] = acc[0][dt][0] * factor[0] + y.x * weight[0];
      acc[0][dt][1] = acc[0][dt][1] * factor[0] + y.y * weight[0];
      acc[0][dt][2] = acc[0][dt][2] * factor[1] + y.z * weight[1];
      acc[0][dt][3] = acc[0][dt][3] * factor[1] + y.w * weight[1];
    }
  }
};

}  // namespace sm90

// Ping-pong between consumer warpgroups: each takes its turn to issue its products (named barriers
// kFirstTurnBarrier + c, the waiting warpgroup's 128 threads and the previous one's 128), so that
// one warpgroup's softmax and epilogue run while the next one's products occupy the tensor cores.
// The last warpgroup grants the first turn at the start and the first consumes the last grant at
// the end, so every barrier sees as many arrivals as waits.
inline constexpr int kFirstTurnBarrier = 4;  // 1..3: the consumers' epilogue barriers
template <int kConsumers, bool kOn>
struct Turns {
  int self, next;
  __device__ __forceinline__ explicit Turns(int consumer) : self(consumer), next((consumer + 1) % kConsumers) {}
  __device__ __forceinline__ void wait() const {
    if constexpr (kOn) sm90::named_sync(kFirstTurnBarrier + self, 256);
  }
  __device__ __forceinline__ void pass() const {
    if constexpr (kOn) sm90::named_arrive(kFirstTurnBarrier + next, 256);
  }
  __device__ __forceinline__ void start() const {
    if (kOn && self == kConsumers - 1) sm90::named_arrive(kFirstTurnBarrier + 0, 256);
  }
  __device__ __forceinline__ void finish() const {
    if (kOn && self == 0) sm90::named_sync(kFirstTurnBarrier + 0, 256);
  }
};

template <class T, int kHeadDim, FwdVariantSm90 kVariant>
__global__ void __launch_bounds__(fwd_tile_sm90(kHeadDim, kVariant).threads(), 1)
    fwd_kernel_sm90(const __grid_constant__ FwdKernelArgsSm90 args) {
  using namespace sm90;
  constexpr FwdTileSm90 kTile = fwd_tile_sm90(kHeadDim, kVariant);
  constexpr bool kScoreMods = kVariant == FwdVariantSm90::score_mods;
  static_assert(kTile.registers_fit(), "setmaxnreg targets exceed the block's launch registers");
  constexpr int kBlockM = kTile.block_m(), kBlockN = kTile.block_n;
  // O's columns per consumer: all of the head dim, or half of it with head_split (FwdTileSm90).
  constexpr int kOCols = kTile.o_cols(kHeadDim);
  constexpr int kNTiles = kBlockN / 8, kDTiles = kOCols / 8;
  static_assert(kHeadDim % 32 == 0, "the products run over whole 16-column k steps and 8-column tiles of O");
  static_assert(kBlockN % 16 == 0, "P·V takes keys 16 at a time");
  static_assert(FwdSmem<T, kHeadDim, kTile>::kBarriers * sizeof(Barrier) +
                        FwdSmem<T, kHeadDim, kTile>::kRecords * sizeof(FwdWork<kBlockM, kBlockN>) + kSwizzleAtomBytes <=
                    2048,
                "barriers, tile records and the panels' alignment fit FwdTileSm90::smem_bytes's 2048 bytes");

  extern __shared__ unsigned char smem_raw[];
  const FwdSmem<T, kHeadDim, kTile> sm(smem_raw);
  const detail::FwdParams& p = args.p;
  const WorkTiles work = args.work;

  if (threadIdx.x == 0) sm.init_barriers();
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    regs_dealloc<kTile.producer_regs>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&args.tm_q);
      prefetch_tensor_map(&args.tm_k);
      prefetch_tensor_map(&args.tm_v);
      produce<T, kHeadDim, kTile, fwd_split_tail(kHeadDim, kVariant)>(args, sm, work);
    }
    return;
  }

  regs_alloc<kTile.consumer_regs>();
  const int consumer = warpgroup - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int row0 = kTile.head_split ? 0 : 64 * consumer;  // this consumer's first row of a work tile
  // With head_split, this consumer's O columns start kOCols · consumer into each V slot's panels.
  const std::uint32_t v_col_bytes = kTile.head_split ? consumer * (kOCols / kPanelCols) * kBlockN * kPanelRowBytes : 0;
  const ScoreMod mod(p);
  const float mul = kScoreMods ? mod.softmax_mul() : p.scale_log2;
  const bool dropout = kScoreMods && p.dropout_p > 0.0f;
  RingPos<kTile.stages> kpos, vpos;
  RingPos<kTile.q_stages> qpos;
  const Turns<kTile.consumers, kTile.pingpong> turns(consumer);
  turns.start();

  // The consumers take each work tile from the producer's record (published with its Q) rather than
  // deriving it: WorkTiles::at's divisions and FwdWork's parameter loads were ~800 cycles at every
  // tile boundary, where both consumers reach it together and the tensor cores idle (H100: +2-6% at
  // 512-1k keys, hdim 64 causal 512 208 -> 219 TFLOP/s; nothing from 4k on).
#pragma unroll 1
  for (;;) {
    sm.q_full(qpos.slot()).wait(qpos.phase());
    const FwdWork<kBlockM, kBlockN> w = sm.template record<FwdWork<kBlockM, kBlockN>>(qpos.n);
    if (w.head < 0) break;
    const RowCoords<1> rows(w.R0 + row0 + 16 * warp, w.si.len_q, 1, w.head, lane);
    const KeyTiles& tiles = w.tiles;

    float o[1][kDTiles][4] = {};  // (64, kOCols) per warpgroup, unnormalised
    float s[1][kNTiles][4];       // (64, kBlockN) scores, then P
    std::uint32_t pa[kNTiles / 2][4];  // P of the previous step as wgmma A fragments
    OnlineSoftmax<1> softmax;
    float factor[2];
    bool rescale_o = true;  // whether the last softmax step moved a row max of the warp

    // Masks, score modifiers and the first two softmax steps on S (sx: s, or its leading columns in
    // the narrow diagonal step) of the key tile starting at key0; P stays there (fp32) for the dropout,
    // then becomes pa after O is rescaled.
    auto softmax_step = [&](auto& sx, int key0) {
      if (kScoreMods && mod.active()) {
        float slope_log2[2];
#pragma unroll
        for (int r = 0; r < 2; ++r)
          slope_log2[r] = mod.alibi ? detail::alibi_slope(p, w.b, rows.head(r)) * kLog2e : 0.0f;
        mod.apply(sx, slope_log2, rows, w.band.diag, key0, lane);
      }
      if (tiles.needs_mask(key0)) apply_mask<kTile.mask_bits>(sx, w.band, rows, w.si.len_k, key0, lane);
      rescale_o = softmax.update_max_lazy(sx, mul, factor);
      softmax.exp_and_sum(sx, mul, factor);
      if (dropout) {
        std::uint32_t row_id[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) row_id[r] = detail::dropout_row_id(p, rows.head(r), w.si, rows.i(r));
        apply_dropout(sx, p, row_id, key0, lane);
      }
    };

    const std::uint32_t q_addr = smem_addr(sm.q(qpos.slot(), consumer));
    const int num_tiles = tiles.count();
    if (num_tiles > 0) {
      // Step 0 (S only) and the P·V of step j - 1 that step j issues: over kCols columns, the key
      // tile's leading ones in the narrow diagonal step.
      auto first_step = [&](auto cols) {
        constexpr int kCols = decltype(cols)::value;
        auto& sx = leading_cols<kCols>(s);
        sm.k_full(kpos.slot()).wait(kpos.phase());
        turns.wait();
        wgmma_fence();
        issue_scores<T, kHeadDim, kBlockN, kCols>(sx, q_addr, smem_addr(sm.k(kpos.slot())));
        wgmma_commit();
        turns.pass();
        wgmma_wait<0>();
        fence_regs(flat(sx));
        if (lane == 0) sm.k_empty(kpos.slot()).arrive();
        kpos.advance();
        softmax_step(sx, (tiles.hi - 1) * kBlockN);
        p_fragments<T>(leading_cols<kCols>(pa), sx);
      };
      auto step = [&](int j, auto pv_cols) {
        const int key0 = (tiles.hi - 1 - j) * kBlockN;
        sm.k_full(kpos.slot()).wait(kpos.phase());
        sm.v_full(vpos.slot()).wait(vpos.phase());
        turns.wait();
        wgmma_fence();
        issue_scores<T, kHeadDim, kBlockN, kBlockN>(s, q_addr, smem_addr(sm.k(kpos.slot())));
        wgmma_commit();
        issue_pv<T, kOCols, kBlockN, decltype(pv_cols)::value>(o, pa, smem_addr(sm.v(vpos.slot())) + v_col_bytes);
        wgmma_commit();
        turns.pass();
        wgmma_wait<1>();  // S of step j
        fence_regs(flat(s));
        if (lane == 0) sm.k_empty(kpos.slot()).arrive();
        kpos.advance();
        softmax_step(s, key0);
        wgmma_wait<0>();  // P·V of step j - 1
        fence_regs(flat(o));
        if (lane == 0) sm.v_empty(vpos.slot()).arrive();
        vpos.advance();
        if (rescale_o) OnlineSoftmax<1>::rescale(o, factor);
        p_fragments<T>(pa, s);
      };
      using Full = std::integral_constant<int, kBlockN>;
      int j = 1;
      if constexpr (kTile.diag_keys > 0) {
        using Narrow = std::integral_constant<int, kTile.diag_keys>;
        // This consumer's rows [i0, i1) see no key at or past the first tile's key0 + diag_keys (or
        // have no rows at all): warpgroup-uniform, as the products need, and taken from lane 0 so
        // that ptxas sees it uniform too (else it serialised the wgmmas of both branches: C7520).
        const int i0 = w.R0 + row0, i1 = i0 + 64 < w.si.len_q ? i0 + 64 : w.si.len_q;
        const bool narrow = __shfl_sync(0xffffffffu, i1 <= i0 || w.band.key_end(i1, w.si.len_k) <=
                                                                     static_cast<std::int64_t>(tiles.hi - 1) * kBlockN + kTile.diag_keys,
                                        0);
        if (narrow) {
          first_step(Narrow{});
          if (num_tiles > 1) {
            step(1, Narrow{});
            j = 2;
          } else {
            // A tile of one step: its P·V (after the loop) runs over the whole slot, with P's columns
            // past diag_keys zero (as they are anyway).
#pragma unroll
            for (int kk = kTile.diag_keys / 16; kk < kNTiles / 2; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
          }
        } else {
          first_step(Full{});
        }
      } else {
        first_step(Full{});
      }
#pragma unroll 1
      for (; j < num_tiles; ++j) step(j, Full{});
      // Every read of Q is over (the tile's S products have completed): its buffer goes back to the
      // producer, so the next tile's Q loads under this last P·V and the epilogue. Every thread
      // arrives: each one's release orders its reads of the tile records before the producer rewrites
      // one (it does once every consumer thread has released the Q after it).
      sm.q_empty(qpos.slot()).arrive();
      sm.v_full(vpos.slot()).wait(vpos.phase());
      turns.wait();
      wgmma_fence();
      issue_pv<T, kOCols, kBlockN>(o, pa, smem_addr(sm.v(vpos.slot())) + v_col_bytes);
      wgmma_commit();
      turns.pass();
      wgmma_wait<0>();
      fence_regs(flat(o));
      if (lane == 0) sm.v_empty(vpos.slot()).arrive();
      vpos.advance();
    } else {
      sm.q_empty(qpos.slot()).arrive();
    }

    // The epilogue reads its rows from the record again: kept live across the mainloop they spilled
    // at hdim 256.
    const FwdWork<kBlockM, kBlockN> we = sm.template record<FwdWork<kBlockM, kBlockN>>(qpos.n);
    const BlockRows blk{we.b, we.head, 1, we.si.len_q, we.si};
    const RowCoords<1> erows(we.R0 + row0 + 16 * warp, we.si.len_q, 1, we.head, lane);
    float inv_l[2], lse[2];
    if (fwd_split_tail(kHeadDim, kVariant) && we.role != TailRole::whole) {
      // A split-tail piece (WorkTiles): the tail leaves its finished state (O normalised, without
      // the dropout scale, a constant) to the head's block; the head takes it into its own.
      TailExchange<kOCols, kTile.consumers> x(args.tail, tail_slot(blockIdx.x, we.role), consumer, tid);
      if (we.role == TailRole::tail) {
        softmax.template finish<true>(mul, inv_l, lse);
        x.leave(o, inv_l, lse);
        qpos.advance();
        continue;
      }
      x.take(softmax, o, mul, lane);
    }
    softmax.template finish<true>(mul, inv_l, lse);
    if (dropout) {
#pragma unroll
      for (int r = 0; r < 2; ++r) inv_l[r] *= p.dropout_rescale;
    }
    if (kTile.store == FwdStore::tma && !p.is_varlen()) {
      // The previous tile's store has read the O buffer (its issuing thread waits) before anyone
      // writes it again; the fence makes the writes visible to the copy engine.
      T* so = sm.o(consumer);
      if (tid == 0) tma_store_wait_read();
      named_sync(1 + consumer, 128);
      stage_output_panels<T, kOCols>(so, o, inv_l, 16 * warp, lane);
      fence_async_shared();
      named_sync(1 + consumer, 128);
      if (tid == 0) {
#pragma unroll
        for (int pn = 0; pn < fwd_panel_cols_sm90(kHeadDim) / kPanelCols; ++pn)
          tma_store(&args.tm_o, so + pn * 64 * kPanelCols, pn * kPanelCols, we.head,
                    static_cast<int>(we.si.q_row0 + we.R0 + row0), we.b);
        tma_store_commit();
      }
      store_lse(p, blk, lse, erows, lane);
    } else {
      store_output_regs<T, kOCols, 1>(p, blk, o, inv_l, lse, erows, lane, kTile.head_split ? consumer * kOCols : 0,
                                      !kTile.head_split || consumer == 0);
    }
    qpos.advance();
  }
  turns.finish();
  // The block's shared memory must outlive the copy engine's reads of the last O tile.
  if (kTile.store == FwdStore::tma && tid == 0) tma_store_wait_all();
}

}  // namespace flashmonoid::cuda
