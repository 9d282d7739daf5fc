// The sm90 backward: warp-specialised, TMA + wgmma, three kernels:
//   1. bwd_preprocess_sm90: per query row D = rowsum(dO∘O) and lse·log2(e) into the workspace,
//      padded per sequence to whole query blocks (bwd_sm90.hpp); clears the dQ accumulator.
//   2. bwd_kernel_sm90: persistent, one block per multiprocessor (launch_bwd_sm90.cuh: bwd_main_blocks
//      gives the grid), walking the work items (key block,
//      KV head, batch) in BwdWork's order, each taken by the block that frees first (work_next). A
//      producer warpgroup (one thread) loads an item's K and V once, then streams Q, dO, lse and D of
//      every query block of every query head of the GQA group that sees the keys through a q_stages
//      ring (TMA, mbarriers) that runs on across items. Up to hdim 128 the two consumer warpgroups
//      own 64 of the block's 128 keys each (bwd_consumer_key_split):
//        Sᵀ = K Qᵀ, dPᵀ = V dOᵀ            wgmma, both operands from shared memory
//        Pᵀ = exp2(Sᵀ·scale·log2 e - lse), dSᵀ = Pᵀ∘(dPᵀ - D)   in registers
//        dV += Pᵀ dO, dK += dSᵀ Q          wgmma with Pᵀ, dSᵀ from registers; dK, dV stay in fp32
//                                          registers for the whole block (the GQA sum included)
//        dQ = dS K                         dSᵀ through shared memory (both warpgroups' keys), each
//                                          warpgroup a 64-row part of the step's dQ tile (DqSplit)
//      and each dQ part is staged in shared memory (in the fragments' own order, so that the writes
//      are conflict-free), from where the producer warpgroup's dQ writer warp adds it to the
//      accumulator with one bulk reduction (cp.reduce.async.bulk .add.f32, 16 KB). At hdim 256
//      they split the head dim instead (bwd_consumer_head_split, tile_bwd_sm90.hpp says why).
//   3. bwd_convert_dq_sm90: dq = scale · accumulator in the input dtype, undoing the fragment order.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "api/params.hpp"
#include "common/block_range.cuh"
#include "common/score_mod.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"
#include "sm90/hopper.cuh"
#include "sm90/tile_bwd_sm90.hpp"

namespace flashmonoid::cuda {

struct BwdKernelArgsSm90 {
  CUtensorMap tm_q, tm_do;  // (d, h, rows, batch), box (64, 1, kBlockM, 1)
  CUtensorMap tm_k, tm_v;   // (d, h_k, rows, batch), box (64, 1, kBlockN, 1)
  CUtensorMap tm_rows;      // lse·log2(e) and D: (rows, h, 2), box (kBlockM, 1, 2), workspace (bwd_sm90.hpp)
  detail::BwdParams p;
  float* dq_acc;      // (h, rows, head-dim bucket) in fragment order per query block
  int* dq_sem;        // (h, rows / kBlockM) key blocks added so far, deterministic mode only
  int* work_next;     // the next work item to take, zero at the launch
  int items;          // work items: key blocks · batch · KV heads
  std::int64_t rows;  // padded query rows per head
  int group_heads;    // BwdWork's block order: 0 key blocks fastest, else groups of this many batch·KV heads
};

namespace sm90 {

// First padded row of sequence b's query blocks: sequences start on a block boundary and never share
// a block, so a block's dQ reduction never touches another sequence's rows.
template <int kBlockM>
__device__ __forceinline__ std::int64_t padded_row0(const detail::FwdParams& p, int b) {
  if (p.cu_seqlens_q != nullptr) return (static_cast<std::int64_t>(p.cu_seqlens_q[b]) / kBlockM + b) * kBlockM;
  return static_cast<std::int64_t>(b) * ((p.seqlen_q + kBlockM - 1) / kBlockM) * kBlockM;
}

// How the two consumers share a step's (kBlockM, kHeadDim) dQ tile: each computes one 64-row wgmma
// tile of kCols columns, dQ = dS K over all the block's keys: with 64 queries per step the column
// halves, with 128 the row halves.
template <int kBlockM, int kHeadDim>
struct DqSplit {
  static_assert(kBlockM == 64 || kBlockM == 128, "one or two 64-row wgmma tiles of queries");
  static constexpr bool kByRows = kBlockM == 128;
  static constexpr int kCols = kByRows ? kHeadDim : kHeadDim / 2;
  static constexpr int kFloats = 64 * kCols;  // one consumer's part
  __host__ __device__ static constexpr int row0(int w) { return kByRows ? 64 * w : 0; }
  __host__ __device__ static constexpr int col0(int w) { return kByRows ? 0 : kCols * w; }
  // The accumulator block in fragment order: consumer w's part is kCols / 8 float4 per thread,
  // float4 j of thread t at this index (so that 128 threads' stores are contiguous).
  __host__ __device__ static constexpr int float4_index(int w, int j, int t) { return (w * (kCols / 8) + j) * 128 + t; }
  // The inverse with dq_fragment_index's element order: float4 f of the block holds columns c, c + 1 of
  // rows r (elements 0, 1) and r + 8 (elements 2, 3).
  __host__ __device__ static constexpr void rows_cols_of(int f, int& r, int& c) {
    const int t = f % 128, w = f / 128 / (kCols / 8), j = f / 128 % (kCols / 8);
    r = row0(w) + (t / 32) * 16 + (t % 32) / 4;
    c = col0(w) + 8 * j + 2 * (t % 4);
  }
};

// Where element (row r, column c) of a (kBlockM, kHeadDim) dQ tile sits in its accumulator block
// (DqSplit::float4_index: the staging stores are conflict-free). Within a part (local row lr, column lc) the
// wgmma accumulator layout: warp lr/16, lane 4·(lr%8) + (lc%8)/2, element (lc&1) + 2·((lr/8)&1)
// of column tile lc/8.
// The convert pass reads the block through its inverse, DqSplit::rows_cols_of; the static_assert
// below checks the two against each other for every tile.
template <int kBlockM, int kHeadDim>
__host__ __device__ constexpr int dq_fragment_index(int r, int c) {
  using Split = DqSplit<kBlockM, kHeadDim>;
  const int w = Split::kByRows ? r / 64 : c / Split::kCols;
  const int lr = r % 64, lc = c - Split::col0(w);
  const int t = (lr / 16) * 32 + (lr % 8) * 4 + (lc % 8) / 2;
  const int e = (lc & 1) + 2 * ((lr / 8) & 1);
  return Split::float4_index(w, lc / 8, t) * 4 + e;
}

template <int kBlockM, int kHeadDim>
constexpr bool rows_cols_of_inverts_dq_fragment_index() {
  for (int f = 0; f < kBlockM * kHeadDim / 4; ++f) {
    int r = 0, c = 0;
    DqSplit<kBlockM, kHeadDim>::rows_cols_of(f, r, c);
    if (dq_fragment_index<kBlockM, kHeadDim>(r, c) != 4 * f || dq_fragment_index<kBlockM, kHeadDim>(r, c + 1) != 4 * f + 1 ||
        dq_fragment_index<kBlockM, kHeadDim>(r + 8, c) != 4 * f + 2 || dq_fragment_index<kBlockM, kHeadDim>(r + 8, c + 1) != 4 * f + 3)
      return false;
  }
  return true;
}
static_assert(rows_cols_of_inverts_dq_fragment_index<128, 64>() && rows_cols_of_inverts_dq_fragment_index<64, 128>() &&
                  rows_cols_of_inverts_dq_fragment_index<64, 256>(),
              "DqSplit::rows_cols_of must invert dq_fragment_index (the convert pass reads dQ in that order)");

// The row kernels' thread: kHeadDim / 8 lanes (8 columns each) per (query row i, head, batch b),
// 256 threads per block.
template <int kHeadDim>
struct RowThread {
  static constexpr int kLanes = kHeadDim / 8;
  static constexpr int kRowsPerBlock = 256 / kLanes;
  int b, head, lane, i;
  detail::SeqInfo si;
  __device__ __forceinline__ explicit RowThread(const detail::FwdParams& p)
      : b(blockIdx.z), head(blockIdx.y), lane(threadIdx.x % kLanes),
        i(blockIdx.x * kRowsPerBlock + threadIdx.x / kLanes), si(detail::seq_info(p, b)) {}
};

}  // namespace sm90

// 1. D and lse·log2(e) per padded query row (+inf lse on padding rows and rows that saw no key, so
// that their P is exp2(s - inf) = 0), zeros in the dQ accumulator, its semaphores and work_next.
// kHeadDim / 8 lanes per row.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(256)
    bwd_preprocess_sm90(const detail::BwdParams p, float* __restrict__ lse, float* __restrict__ dsum,
                        float* __restrict__ dq_acc, int* __restrict__ dq_sem, int* __restrict__ work_next, std::int64_t rows) {
  constexpr int kBlockM = bwd_tile_sm90(kHeadDim).block_m;
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *work_next = 0;
  const sm90::RowThread<kHeadDim> t(p);
  const auto [b, head, lane, i, si] = t;
  const int padded_len = (si.len_q + kBlockM - 1) / kBlockM * kBlockM;
  const bool row_ok = i < si.len_q;  // no early return: the reduction below needs every lane
  float acc = 0.0f;
  if (row_ok && lane * 8 < p.d)
    acc = dot8(static_cast<const T*>(p.out) + detail::offset_of(p.o_stride, b, si.q_row0 + i, head) + lane * 8,
               static_cast<const T*>(p.dout) + detail::offset_of(p.do_stride, b, si.q_row0 + i, head) + lane * 8);
#pragma unroll
  for (int off = t.kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (i >= padded_len) return;
  const std::int64_t r = static_cast<std::int64_t>(head) * rows + sm90::padded_row0<kBlockM>(p, b) + i;
  if (lane == 0) {
    const float l = row_ok ? p.lse[detail::lse_index(p, b, head, si, i)] : -INFINITY;
    lse[r] = l == -INFINITY ? INFINITY : l * kLog2e;
    dsum[r] = acc;
    if (i % kBlockM == 0) dq_sem[r / kBlockM] = 0;
  }
  // Row i's kHeadDim floats of its block's accumulator (any bijection clears the block).
  float4* z = reinterpret_cast<float4*>(dq_acc + r * kHeadDim) + 2 * lane;
  z[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  z[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// 3. dq = scale · accumulator, one block per (query block, head, batch). The accumulator block is
// read in its own fragment order, a warp's float4s side by side (each holds columns c, c + 1 of rows
// r and r + 8: DqSplit::rows_cols_of), staged row-major in shared memory, and written as whole
// 16-byte row pieces. Read row by row instead (8 bytes per thread from float4s 2 KB apart), the pass
// took 99 us at hdim 256 and 80 at hdim 128 for 16k tokens (2.0-2.5 TB/s; cuDNN's 73-74 us; H100,
// ncu); stored straight from the float4s as 4-byte pairs, 8-14% of the whole backward slower again.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(256)
    bwd_convert_dq_sm90(const detail::BwdParams p, const float* __restrict__ dq_acc, std::int64_t rows) {
  constexpr int kBlockM = bwd_tile_sm90(kHeadDim).block_m;
  using Split = sm90::DqSplit<kBlockM, kHeadDim>;
  // (kBlockM, kHeadDim) in rows padded by 16 bytes, so that the 8 rows of a warp's pair stores fall
  // on different banks.
  constexpr int kRowElems = kHeadDim + 8;
  __shared__ __align__(16) T tile[kBlockM * kRowElems];
  const int b = blockIdx.z, head = blockIdx.y, row0 = blockIdx.x * kBlockM;
  const detail::SeqInfo si = detail::seq_info(p, b);
  if (row0 >= si.len_q) return;  // the whole block
  const std::int64_t block_row = static_cast<std::int64_t>(head) * rows + sm90::padded_row0<kBlockM>(p, b) + row0;
  const float4* src = reinterpret_cast<const float4*>(dq_acc + block_row * kHeadDim);
#pragma unroll 4
  for (int f = static_cast<int>(threadIdx.x); f < kBlockM * kHeadDim / 4; f += 256) {
    const float4 v = src[f];
    int r = 0, c = 0;
    Split::rows_cols_of(f, r, c);
    *reinterpret_cast<std::uint32_t*>(tile + r * kRowElems + c) = pack2<T>(v.x * p.scale, v.y * p.scale);
    *reinterpret_cast<std::uint32_t*>(tile + (r + 8) * kRowElems + c) = pack2<T>(v.z * p.scale, v.w * p.scale);
  }
  __syncthreads();
  constexpr int kChunks = kHeadDim / 8;
  T* dq = static_cast<T*>(p.dq);
#pragma unroll 4
  for (int idx = static_cast<int>(threadIdx.x); idx < kBlockM * kChunks; idx += 256) {
    const int r = idx / kChunks, c = idx % kChunks * 8;
    if (row0 + r < si.len_q && c < p.d)
      *reinterpret_cast<uint4*>(dq + detail::offset_of(p.dq_stride, b, si.q_row0 + row0 + r, head) + c) =
          *reinterpret_cast<const uint4*>(tile + r * kRowElems + c);
  }
}

namespace sm90 {

// Shared memory of one block: 2-byte tiles in 128-byte-swizzled panels (hopper.cuh), then fp32
// buffers, then the barriers.
template <class T, int kHeadDim>
struct BwdSmem {
  static constexpr BwdTileSm90 kTile = bwd_tile_sm90(kHeadDim);
  static constexpr int kBlockM = kTile.block_m, kBlockN = kTile.block_n, kStages = kTile.q_stages;
  static constexpr int kKVElems = kBlockN * kHeadDim;  // (kBlockN, kHeadDim) K or V
  static constexpr int kQElems = kBlockM * kHeadDim;   // (kBlockM, kHeadDim) Q or dO of one stage
  static constexpr int kSElems = kBlockN * kBlockM;    // (kBlockN, kBlockM) dSᵀ or Pᵀ, panels of 64 queries
  static constexpr int kDqFloats = kTile.dq_stage_floats(kHeadDim);
  T* base;
  float* f32;  // the dQ tile (both parts), then per stage lse (kBlockM) and D (kBlockM)
  static constexpr int kKeepWords = kBlockM * kBlockN / 32;
  std::uint32_t* keep;  // dropout keep bits of the step (dropout_keep_tile), kBlockN / 32 words per query row
  Barrier* bars;  // kv_full, q_full (kStages), q_empty (kStages), kv_empty, then the work record

  __device__ __forceinline__ explicit BwdSmem(unsigned char* raw)
      : base(reinterpret_cast<T*>(align_smem_1024(raw))),
        f32(reinterpret_cast<float*>(base + 2 * kKVElems + 2 * kStages * kQElems + kTile.score_buffers() * kSElems)),
        keep(reinterpret_cast<std::uint32_t*>(f32 + kDqFloats + 2 * kStages * kBlockM)),
        bars(reinterpret_cast<Barrier*>(keep + kKeepWords)) {}
  __device__ __forceinline__ T* k() const { return base; }
  __device__ __forceinline__ T* v() const { return base + kKVElems; }
  __device__ __forceinline__ T* q(int stage) const { return base + 2 * kKVElems + stage * kQElems; }
  __device__ __forceinline__ T* dout(int stage) const { return base + 2 * kKVElems + (kStages + stage) * kQElems; }
  // dSᵀ of step t in buffer t % 2 (see the consumer loops for why two); with head_split also Pᵀ.
  __device__ __forceinline__ T* ds(int buf) const { return base + 2 * kKVElems + 2 * kStages * kQElems + buf * kSElems; }
  __device__ __forceinline__ T* pt(int buf) const {
    static_assert(kTile.head_split, "Pᵀ goes through shared memory only when the consumers split the head dim");
    return ds(2 + buf);
  }
  // Consumer w's part of the dQ tile (DqSplit), in fragment order (dq_fragment_index).
  __device__ __forceinline__ float* dq(int consumer) const { return f32 + consumer * (kDqFloats / 2); }
  __device__ __forceinline__ float* lse(int stage) const { return f32 + kDqFloats + 2 * stage * kBlockM; }  // 128-byte aligned: a TMA box
  __device__ __forceinline__ float* dsum(int stage) const { return lse(stage) + kBlockM; }
  __device__ __forceinline__ Barrier& kv_full() const { return bars[0]; }
  __device__ __forceinline__ Barrier& q_full(int stage) const { return bars[1 + stage]; }
  __device__ __forceinline__ Barrier& q_empty(int stage) const { return bars[1 + kStages + stage]; }
  // K and V (and the record) read by every consumer thread (and the dQ writer's lanes): the producer
  // may load the next work item's.
  __device__ __forceinline__ Barrier& kv_empty() const { return bars[2 + 2 * kStages]; }
  // The work item whose K and V kv_full announces (written by the producer before its arrival; -1:
  // no more work).
  __device__ __forceinline__ int& record() const { return *reinterpret_cast<int*>(bars + 3 + 2 * kStages); }
  static constexpr int kKvEmptyArrivals = 128 * BwdTileSm90::consumers + (kTile.head_split ? 0 : 32);
  static_assert((3 + 2 * kStages) * sizeof(Barrier) + sizeof(int) <= 64, "barriers and the record fit smem_bytes's 64 bytes");

  __device__ __forceinline__ void init_barriers() const {
    kv_full().init(1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      q_full(s).init(1);
      q_empty(s).init(4 * BwdTileSm90::consumers);  // one arrival per consumer warp
    }
    kv_empty().init(kKvEmptyArrivals);
    fence_barrier_init();
  }
};

// What a work item is: its keys, sequence, KV head and the (query head, query block) steps, derived
// the same way by the producer, the dQ writer and the consumers. Items are taken in index order,
// the key blocks of one (batch, KV head) consecutive, so that the items running together share
// their Q, dO and dQ rows in L2 (with the (batch, head) pairs fastest, 2k tokens ran at 240 TFLOP/s
// instead of 386 at hdim 128, H100). Steps run head-major, query blocks last to first. (Starting each key
// block's sweep at its own query block, so that the key blocks of a head do not add into the same
// dQ rows at the same time, measured within noise: bench/NOTES.md.)
template <int kBlockM, int kBlockN>
struct BwdWork {
  int b, kv_head, group;
  std::int64_t kb;  // first key of the block in its sequence
  int keys_valid;
  detail::SeqInfo si;
  detail::Band band;
  QueryTiles qb;

  __device__ __forceinline__ static BwdBlockCoords coords(const BwdKernelArgsSm90& args, int item) {
    const detail::FwdParams& p = args.p;
    const int n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
    return bwd_block_coords(static_cast<unsigned>(item), static_cast<unsigned>(n_blocks), static_cast<unsigned>(p.batch * p.h_k),
                            static_cast<unsigned>(args.group_heads));
  }
  // empty() of item `item` without the rest of BwdWork (the producer has 24 registers): only a
  // varlen sequence shorter than the padded key range has key blocks past its end.
  __device__ __forceinline__ static bool empty_item(const BwdKernelArgsSm90& args, int item) {
    const detail::FwdParams& p = args.p;
    if (p.cu_seqlens_k == nullptr) return false;
    const BwdBlockCoords c = coords(args, item);
    const int b = static_cast<int>(c.batch_head) / p.h_k;
    return static_cast<std::int64_t>(c.n_block) * kBlockN >= detail::varlen_len(p.cu_seqlens_k, p.seqused_k, b);
  }

  __device__ __forceinline__ BwdWork(const BwdKernelArgsSm90& args, int item) : group(args.p.h / args.p.h_k) {
    const detail::FwdParams& p = args.p;
    const BwdBlockCoords c = coords(args, item);
    const int n_block = static_cast<int>(c.n_block), batch_head = static_cast<int>(c.batch_head);
    b = batch_head / p.h_k;
    kv_head = batch_head % p.h_k;
    kb = static_cast<std::int64_t>(n_block) * kBlockN;
    si = detail::seq_info(p, b);
    band = detail::band_of(p, si);
    keys_valid = kb < si.len_k ? static_cast<int>(si.len_k - kb < kBlockN ? si.len_k - kb : kBlockN) : 0;
    qb = query_tiles<kBlockM>(band, kb, kb + keys_valid, si.len_q);
  }
  __device__ __forceinline__ bool empty() const { return keys_valid == 0; }
  __device__ __forceinline__ int steps() const { return qb.count() * group; }

  // Where a step is: its query head and its query block, advanced by next() without divisions (the
  // producer warpgroup has 24 registers).
  struct Cursor {
    int head, m_block;
  };
  __device__ __forceinline__ Cursor first() const { return Cursor{kv_head * group, qb.hi - 1}; }
  __device__ __forceinline__ void next(Cursor& c) const {
    if (--c.m_block < qb.lo) {
      c.m_block = qb.hi - 1;
      ++c.head;
    }
  }
};

// Named barriers (0 is __syncthreads): the step's dSᵀ tile is written (both consumers, 256
// threads); the step's dropout keep bits are written (both consumers); consumer w's dQ part in shared memory is free (kBarDqEmpty + w) or written
// (kBarDqFull + w), between that consumer and the dQ writer warp (160 threads).
inline constexpr int kBarDsFull = 1, kBarDqEmpty = 2, kBarDqFull = 4, kBarKeep = 6;
inline constexpr int kDqSyncThreads = 128 + 32;

}  // namespace sm90

namespace sm90 {

// The dQ writer, warp 1 of the producer warpgroup: per step, each consumer's dQ part (staged in
// shared memory in fragment order) goes to the fp32 accumulator with one bulk reduction
// (cp.reduce.async.bulk .add.f32); the half's buffer is handed back once the reduction has read it.
// The consumers only store and signal, so the reduction's latency is off their path.
//
// Deterministic mode: the key blocks add into a query block's dQ in increasing key-block order
// (dq_turn, block_range.cuh), so the fp32 sums are the same in every run: before its reductions
// the writer waits for its turn on the query block's semaphore; after them it waits for the
// additions to complete and passes the turn on.
// Each role's walk over the block's work items: wait for the item's K and V, read its record, and
// release the record (the dQ writer at once; the consumers once their last products have read K and
// V). The step count runs on across items (stages, phases and the score buffers' parity).
template <class Smem>
struct ItemWalk {
  const Smem& sm;
  // The block's steps before this item, times 2, plus the parity of the items taken so far (kv_full's
  // phase): one register, as two made the hdim-128 score-modifier consumers spill 4 bytes.
  int state = 0;
  __device__ __forceinline__ explicit ItemWalk(const Smem& sm_) : sm(sm_) {}
  __device__ __forceinline__ int step0() const { return state >> 1; }
  // The next item, or -1 when there is none.
  __device__ __forceinline__ int next() {
    sm.kv_full().wait(static_cast<std::uint32_t>(state & 1));
    return sm.record();
  }
  __device__ __forceinline__ void done(int steps) { state = ((step0() + steps) << 1) | ((state & 1) ^ 1); }
};

template <int kBlockM, int kBlockN, int kHeadDim, class Smem>
__device__ __forceinline__ void dq_writer(const BwdKernelArgsSm90& args, const Smem& sm, float* dq_smem, int lane) {
  constexpr int kHalfFloats = DqSplit<kBlockM, kHeadDim>::kFloats;
  const bool ordered = args.p.deterministic;
  ItemWalk<Smem> walk(sm);
#pragma unroll 1
  for (int item; (item = walk.next()) >= 0;) {
    const BwdWork<kBlockM, kBlockN> w(args, item);
    sm.kv_empty().arrive();  // the record is read; K and V are not the writer's
    const int steps = w.steps();
    const std::int64_t prow0 = padded_row0<kBlockM>(args.p, w.b);
    auto cur = w.first();
#pragma unroll 1
    for (int step = 0; step < steps; ++step, w.next(cur)) {
      // The halves are free once the previous step's reductions have read them (at the block's first
      // step nothing is pending): one hand-back per step, as the consumers take one.
#pragma unroll
      for (int c = 0; c < BwdTileSm90::consumers; ++c) {
        if (lane == 0) {
          if (c == 0) ::cuda::ptx::cp_async_bulk_wait_group_read(::cuda::ptx::n32_t<1>{});
          else ::cuda::ptx::cp_async_bulk_wait_group_read(::cuda::ptx::n32_t<0>{});
        }
        __syncwarp();
        named_arrive(kBarDqEmpty + c, kDqSyncThreads);
      }
      const std::int64_t row = static_cast<std::int64_t>(cur.head) * args.rows + prow0 + cur.m_block * kBlockM;
      int* sem = args.dq_sem + row / kBlockM;
      const int turn = ordered ? dq_turn<kBlockN>(w.band, static_cast<int>(w.kb / kBlockN), static_cast<std::int64_t>(cur.m_block) * kBlockM, w.si.len_k) : 0;
      if (ordered && lane == 0) {
        sem_wait(sem, turn);
        ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_global);  // the others' additions before ours
      }
#pragma unroll
      for (int c = 0; c < BwdTileSm90::consumers; ++c) {
        named_sync(kBarDqFull + c, kDqSyncThreads);
        if (lane == 0) {
          ::cuda::ptx::cp_reduce_async_bulk(::cuda::ptx::space_global, ::cuda::ptx::space_shared, ::cuda::ptx::op_add,
                                            args.dq_acc + row * kHeadDim + c * kHalfFloats, dq_smem + c * kHalfFloats,
                                            kHalfFloats * sizeof(float));
          ::cuda::ptx::cp_async_bulk_commit_group();
        }
      }
      if (ordered && lane == 0) {
        ::cuda::ptx::cp_async_bulk_wait_group(::cuda::ptx::n32_t<0>{});
        ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_global);
        sem_release(sem, turn + 1);
      }
    }
    walk.done(steps);
  }
  if (lane == 0) ::cuda::ptx::cp_async_bulk_wait_group(::cuda::ptx::n32_t<0>{});
}

}  // namespace sm90

namespace sm90 {

// Element (r, c) of a tile of `rows` rows stored as 64-column panels (hopper.cuh's layout).
__device__ __forceinline__ int panel_elem(int rows, int r, int c) {
  return (c / kPanelCols) * rows * kPanelCols + r * kPanelCols + swizzle_chunk(r, (c % kPanelCols) / 8) * 8 + c % 8;
}

// The score steps both mainloops share, on a warpgroup's transposed tiles (rows = its 64 keys,
// columns = kSTiles · 8 queries): Pᵀ = exp2(Sᵀ·scale·log2 e - lse·log2 e), 0 where masked (padding
// query rows need no test: their lse is +inf); `lse` points at the tile's first query.
template <int kSTiles>
__device__ __forceinline__ void probabilities_t(float (&s)[1][kSTiles][4], const float* lse, bool masked, const TileBand& tb,
                                                int key_row, int lane, float scale_log2) {
  if (masked) {  // the boundary tiles: masked scores to -inf first (a separate pass needs fewer registers)
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!tb.key_visible(8 * nt + 2 * (lane & 3) + (e & 1), key_row + 8 * (e / 2))) s[0][nt][e] = -INFINITY;
  }
#pragma unroll
  for (int nt = 0; nt < kSTiles; ++nt) {
    const float2 l = *reinterpret_cast<const float2*>(lse + 8 * nt + 2 * (lane & 3));
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][nt][e] = fast_exp2(fmaf(s[0][nt][e], scale_log2, -(e & 1 ? l.y : l.x)));
  }
}

// dSᵀ = Pᵀ∘(dPᵀ - D), in place of dPᵀ; `dsum` points at the tile's first query.
template <int kSTiles>
__device__ __forceinline__ void score_grads_t(float (&dp)[1][kSTiles][4], const float (&p)[1][kSTiles][4], const float* dsum, int lane) {
#pragma unroll
  for (int nt = 0; nt < kSTiles; ++nt) {
    const float2 d = *reinterpret_cast<const float2*>(dsum + 8 * nt + 2 * (lane & 3));
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[0][nt][e] = p[0][nt][e] * (dp[0][nt][e] - (e & 1 ? d.y : d.x));
  }
}

// The score modifiers of a step (kernel variant kScoreMods): softcap and ALiBi as ScoreMod and
// alibi_log2 define them, dropout by the step's keep-bit tile (keep row r: query r of the step);
// the sm80 backward's ScoreGrad evaluates the same definitions.
struct BwdMods {
  ScoreMod mod;
  float slope_log2;           // ALiBi slope · log2 e of the step's head (0 without ALiBi)
  float rescale;              // 1 / (1 - dropout p)
  const std::uint32_t* keep;  // nullptr without dropout
  int words;                  // keep words per query row

  __device__ __forceinline__ BwdMods(const detail::BwdParams& p, int b, int head, const std::uint32_t* keep_, int words_)
      : mod(p), slope_log2(detail::alibi_slope(p, b, head) * kLog2e), rescale(p.dropout_rescale),
        keep(p.dropout_p > 0.0f ? keep_ : nullptr), words(words_) {}
  __device__ __forceinline__ bool kept(int q, int k) const { return (keep[q * words + k / 32] >> (k % 32)) & 1u; }
};

// Both score steps with score modifiers, in one pass once Sᵀ and dPᵀ are in (each element needs
// its Pᵀ twice, dropped for dV and undropped for dSᵀ: a pass per step kept one of them live across
// the dPᵀ wait, 328 bytes of spills at hdim 64), each pair packed into the A fragments at once so
// that its fp32 registers die. On every tile (the band test is per element): pa gets Pᵀ after
// dropout, dsa dSᵀ = Pᵀ∘(dPᵀ_drop - D)∘(1 - tanh²) (softcap's derivative, 1 without). q0: the
// tile's first query in the step (keep row).
template <class T, int kSTiles>
__device__ __forceinline__ void score_steps_mod_t(const float (&s)[1][kSTiles][4], const float (&dp)[1][kSTiles][4],
                                                  std::uint32_t (&pa)[kSTiles / 2][4], std::uint32_t (&dsa)[kSTiles / 2][4],
                                                  const float* lse, const float* dsum, const TileBand& tb, const BwdMods& m,
                                                  int key_row, int q0, int lane) {
#pragma unroll
  for (int nt = 0; nt < kSTiles; ++nt) {
    const float2 l = *reinterpret_cast<const float2*>(lse + 8 * nt + 2 * (lane & 3));
    const float2 d = *reinterpret_cast<const float2*>(dsum + 8 * nt + 2 * (lane & 3));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float pd[2], ds[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = 2 * h + c, qi = 8 * nt + 2 * (lane & 3) + c, kj = key_row + 8 * h;
        float dscore;
        const float x = m.mod.log2_score(s[0][nt][e], dscore) + alibi_log2(m.slope_log2, tb.alibi_distance(qi, kj));
        const float pr = tb.key_visible(qi, kj) ? fast_exp2(x - (c ? l.y : l.x)) : 0.0f;
        float dpv = dp[0][nt][e];
        pd[c] = pr;
        if (m.keep != nullptr) {
          const bool kept = m.kept(q0 + qi, kj);
          pd[c] = kept ? pr * m.rescale : 0.0f;
          dpv = kept ? dpv * m.rescale : 0.0f;
        }
        ds[c] = pr * (dpv - (c ? d.y : d.x)) * dscore;
      }
      pa[nt / 2][2 * (nt % 2) + h] = pack2<T>(pd[0], pd[1]);
      dsa[nt / 2][2 * (nt % 2) + h] = pack2<T>(ds[0], ds[1]);
    }
  }
}

// Under dropout (kernel variant kMods), both consumers write the step's keep bits before its
// products (with the accumulators in flight, the Philox registers spilled): the previous step's
// reads are done, every consumer thread passed them before the dSᵀ barrier of that step.
template <bool kMods, class Smem>
__device__ __forceinline__ void keep_tile_step(const detail::BwdParams& p, const Smem& sm,
                                               const BwdWork<Smem::kBlockM, Smem::kBlockN>& w, int head, int m0) {
  if constexpr (kMods) {
    if (p.dropout_p > 0.0f) {
      dropout_keep_tile(p, head, w.si, m0, Smem::kBlockM, w.kb, Smem::kBlockN / 32, sm.keep, threadIdx.x - 128,
                        128 * BwdTileSm90::consumers);
      named_sync(kBarKeep, 128 * BwdTileSm90::consumers);
    }
  }
}

// The two score steps of a warpgroup's tile between its Sᵀ, dPᵀ products (two commit groups) and
// the dV, dK products: Pᵀ and dSᵀ as A fragments, with or without the score modifiers.
template <class T, bool kMods, int kSTiles, class Smem>
__device__ __forceinline__ void score_steps_t(float (&s)[1][kSTiles][4], float (&dp)[1][kSTiles][4], std::uint32_t (&pa)[kSTiles / 2][4],
                                              std::uint32_t (&dsa)[kSTiles / 2][4], const detail::BwdParams& p, const Smem& sm,
                                              int stage, const BwdWork<Smem::kBlockM, Smem::kBlockN>& w, int head, int m0, int q0,
                                              int key_row, int lane) {
  constexpr int kQueries = kSTiles * 8;
  const TileBand tb(w.band, m0 + q0, w.kb, kQueries, w.si.len_k - static_cast<int>(w.kb));
  const float* lse = sm.lse(stage) + q0;
  const float* dsum = sm.dsum(stage) + q0;
  if constexpr (kMods) {
    const BwdMods m(p, w.b, head, sm.keep, Smem::kBlockN / 32);
    wgmma_wait<0>();
    fence_regs(flat(s));
    fence_regs(flat(dp));
    score_steps_mod_t<T>(s, dp, pa, dsa, lse, dsum, tb, m, key_row, q0, lane);
  } else {
    const bool masked = w.band.tile_needs_mask(m0 + q0, m0 + q0 + kQueries, w.kb, w.kb + Smem::kBlockN, w.si.len_k);
    wgmma_wait<1>();
    fence_regs(flat(s));
    probabilities_t(s, lse, masked, tb, key_row, lane, p.scale_log2);
    wgmma_wait<0>();
    fence_regs(flat(dp));
    score_grads_t(dp, s, dsum, lane);
    p_fragments<T>(pa, s);
    p_fragments<T>(dsa, dp);
  }
}

// A transposed score tile's A fragments (keys × kKSteps · 16 queries, 2-byte pairs) to a (kRows,
// kBlockM) panel buffer at query column col0, where wgmma reads it (K-major as Pᵀ / dSᵀ, M-major
// as P / dS). 32-bit stores: the swizzle spreads a warp's 8 rows over the banks.
template <int kRows, int kKSteps>
__device__ __forceinline__ void store_scores_t(std::uint32_t buf, const std::uint32_t (&a)[kKSteps][4], int key_row, int col0,
                                               int lane) {
#pragma unroll
  for (int nt = 0; nt < 2 * kKSteps; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      st_shared_u32(buf + panel_elem(kRows, key_row + 8 * h, col0 + 8 * nt + 2 * (lane & 3)) * 2, a[nt / 2][2 * (nt % 2) + h]);
}

// dK = scale · Σ dSᵀ Q and dV of a warpgroup's keys (accumulator rows key_row, key_row + 8) and
// columns [col0, col0 + 8 · kDTiles), in 16-byte stores (store_row_vec16); rows past the sequence
// and columns past d are not written.
template <class T, int kDTiles, class Work>
__device__ __forceinline__ void store_dkdv(const detail::BwdParams& p, const Work& w, const float (&dk)[1][kDTiles][4],
                                           const float (&dv)[1][kDTiles][4], int key_row, int col0, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = key_row + 8 * h;
    const bool valid = r < w.keys_valid;
    const std::int64_t row = w.si.k_row0 + w.kb + (valid ? r : 0);
    store_row_vec16<T>(static_cast<T*>(p.dk) + detail::offset_of(p.dk_stride, w.b, row, w.kv_head), dk[0], h, p.scale,
                       col0, p.d, valid, lane);
    store_row_vec16<T>(static_cast<T*>(p.dv) + detail::offset_of(p.dv_stride, w.b, row, w.kv_head), dv[0], h, 1.0f,
                       col0, p.d, valid, lane);
  }
}

// Q, dO, lse and D of a stage back to the producer: lane 0 arrives for its warp, so the warp first
// converges (every lane's lse and D reads before the arrival; racecheck flagged the next bulk copy
// against them without it) and fences its generic reads against that async-proxy write.
__device__ __forceinline__ void release_stage(Barrier& empty, int lane) {
  fence_async_shared();
  __syncwarp();
  if (lane == 0) empty.arrive();
}

// The consumers' walk over a work item's steps, as a loop header:
//   for (ConsumerSteps it(sm, w, step0); it.wait_next(); it.release(lane)) { ... }
// waits for each step's Q/dO stage and hands it back after the body (which has waited for its
// wgmmas); `step` counts the block's steps (ItemWalk::step0 before this item's). (A lambda body
// made ptxas spill at hdim 64; so did the step's prologue, keep bits + products + score steps, as a
// member shared by both mainloops: 60 bytes. It stays in each.)
template <class Smem, class Work>
struct ConsumerSteps {
  const Smem& sm;
  const Work& w;
  typename Work::Cursor cur;
  int step, end;
  __device__ __forceinline__ ConsumerSteps(const Smem& sm_, const Work& w_, int step0)
      : sm(sm_), w(w_), cur(w_.first()), step(step0), end(step0 + w_.steps()) {}
  __device__ __forceinline__ int stage() const { return step % Smem::kStages; }
  __device__ __forceinline__ bool wait_next() {
    if (step >= end) return false;
    sm.q_full(stage()).wait((step / Smem::kStages) & 1);
    return true;
  }
  __device__ __forceinline__ void release(int lane) {
    release_stage(sm.q_empty(stage()), lane);
    ++step;
    w.next(cur);
  }
};

// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ of a warpgroup's 64 keys (k, v: their first row in the kKeyRows-row
// panels) and kN / 2 queries (q, dout: their first row in the kQRows-row panels), two commit
// groups, both operands K-major from shared memory.
template <class T, int kHeadDim, int kKeyRows, int kQRows, int kN>
__device__ __forceinline__ void score_products_t(float (&s)[kN], float (&dp)[kN], std::uint32_t k, std::uint32_t v, std::uint32_t q,
                                                 std::uint32_t dout) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) wgmma_ss<0, 0>(s, desc_k_major(k, kKeyRows, ks), desc_k_major(q, kQRows, ks), T{}, ks > 0);
  wgmma_commit();
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) wgmma_ss<0, 0>(dp, desc_k_major(v, kKeyRows, ks), desc_k_major(dout, kQRows, ks), T{}, ks > 0);
  wgmma_commit();
}

// The consumers up to hdim 128: each owns 64 keys of the block's 128.
template <class T, int kHeadDim, bool kMods>
__device__ __forceinline__ void bwd_consumer_key_split(const BwdKernelArgsSm90& args, const BwdSmem<T, kHeadDim>& sm, int consumer) {
  using Smem = BwdSmem<T, kHeadDim>;
  constexpr int kBlockM = Smem::kBlockM, kBlockN = Smem::kBlockN;
  constexpr int kSTiles = kBlockM / 8, kDTiles = kHeadDim / 8;
  static_assert(kHeadDim % kPanelCols == 0 && kBlockM % 64 == 0 && kBlockN == 128, "whole 64-wide panels, 64 keys per consumer");
  const detail::BwdParams& p = args.p;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // This warpgroup's keys: rows [64·consumer, 64·consumer + 64) of the K and V panels.
  const std::uint32_t k_addr = smem_addr(sm.k()), v_addr = smem_addr(sm.v()), ds_addr = smem_addr(sm.ds(0));
  const std::uint32_t k_own = k_addr + 64 * consumer * kPanelRowBytes, v_own = v_addr + 64 * consumer * kPanelRowBytes;
  // Its part of dQ (DqSplit): A the dSᵀ panel of its queries (M-major), B its columns of K
  // (N-major; at hdim 64 with 64 queries the second half starts 64 bytes into the swizzled lines,
  // an offset within the swizzle atom as the K-major k steps take).
  using Split = DqSplit<kBlockM, kHeadDim>;
  constexpr int kDqN = Split::kCols;
  const int dq_col = Split::col0(consumer);
  const std::uint32_t dq_a_off = (Split::row0(consumer) / kPanelCols) * kBlockN * kPanelRowBytes;
  const std::uint32_t dq_b = k_addr + (dq_col / kPanelCols) * kBlockN * kPanelRowBytes + (dq_col % kPanelCols) * 2;
  // Key of this thread's accumulator rows (half h: +8), relative to the block.
  const int key_row = 64 * consumer + 16 * warp + lane / 4;

  ItemWalk<Smem> walk(sm);
#pragma unroll 1
  for (int item; (item = walk.next()) >= 0;) {
    const BwdWork<kBlockM, kBlockN> w(args, item);
    float dk[1][kDTiles][4] = {};  // (64 keys, kHeadDim) per warpgroup, unscaled
    float dv[1][kDTiles][4] = {};
#pragma unroll 1
    for (ConsumerSteps it(sm, w, walk.step0()); it.wait_next(); it.release(lane)) {
      const int step = it.step, stage = it.stage(), m0 = it.cur.m_block * kBlockM;
      const std::uint32_t q_addr = smem_addr(sm.q(stage)), do_addr = smem_addr(sm.dout(stage));

      keep_tile_step<kMods>(p, sm, w, it.cur.head, m0);
      // Sᵀ (64 keys, kBlockM) = K Qᵀ and dPᵀ = V dOᵀ.
      float s[1][kSTiles][4], dp[1][kSTiles][4];
      score_products_t<T, kHeadDim, kBlockN, kBlockM>(flat(s), flat(dp), k_own, v_own, q_addr, do_addr);

      std::uint32_t pa[kSTiles / 2][4], dsa[kSTiles / 2][4];  // Pᵀ and dSᵀ as A fragments
      score_steps_t<T, kMods>(s, dp, pa, dsa, p, sm, stage, w, it.cur.head, m0, 0, key_row, lane);

      // dSᵀ to shared memory for dQ. Two buffers, by step parity, so that no barrier is needed
      // before the write: the other warpgroup read buffer step % 2 in its dQ of step - 2, which it
      // waited for before it arrived at the barrier of step - 1 that this warpgroup has passed.
      const std::uint32_t ds_buf = ds_addr + (step & 1) * Smem::kSElems * sizeof(T);
      store_scores_t<kBlockN>(ds_buf, dsa, key_row, 0, lane);

      // dV += Pᵀ dO (A from registers, B N-major) while the other warpgroup's dSᵀ comes in; then the
      // dQ part (DqSplit: 64 rows) = dS K over the block's 128 keys; then dK += dSᵀ Q, which runs
      // while the dQ part is staged. (Carrying dV, dK into the next step's Sᵀ, dPᵀ measured 8% slower
      // at hdim 128, 16k; each consumer reducing the whole dQ tile over its own keys, with no
      // barrier between the consumers, 5-24% slower: bench/NOTES.md.)
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        wgmma_rs<1>(flat(dv), pa[kk], desc_mn_major(do_addr, kBlockM, kk), T{}, 1);
      wgmma_commit();
      fence_async_shared();
      named_sync(kBarDsFull, 256);
      float dq[1][kDqN / 8][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_ss<1, 1>(flat(dq), desc_mn_major(ds_buf + dq_a_off, kBlockN, kk), desc_mn_major(dq_b, kBlockN, kk), T{}, kk > 0);
      wgmma_commit();
      wgmma_wait<1>();
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        wgmma_rs<1>(flat(dk), dsa[kk], desc_mn_major(q_addr, kBlockM, kk), T{}, 1);
      wgmma_commit();
      wgmma_wait<1>();  // dQ done; dK still runs
      fence_regs(flat(dq));

      // The dQ part to the dQ writer warp (in fragment order, conflict-free), once it has handed the
      // buffer back.
      const std::uint32_t dq_s = smem_addr(sm.dq(consumer));
      named_sync(kBarDqEmpty + consumer, kDqSyncThreads);
#pragma unroll
      for (int j = 0; j < kDqN / 8; ++j) st_shared_v4(dq_s + (j * 128 + tid) * 16, dq[0][j][0], dq[0][j][1], dq[0][j][2], dq[0][j][3]);
      fence_async_shared();
      named_arrive(kBarDqFull + consumer, kDqSyncThreads);

      wgmma_wait<0>();
      fence_regs(flat(dv));
      fence_regs(flat(dk));
    }
    sm.kv_empty().arrive();  // every product that reads K and V (and the record) is done
    store_dkdv<T>(p, w, dk, dv, key_row, 0, lane);
    walk.done(w.steps());
  }
}

// The consumers at hdim 256 (BwdTileSm90::head_split): 64 keys, 64 queries per step. Consumer w
// computes Sᵀ and dPᵀ of its 32 queries [32w, 32w + 32) over all 64 keys, and dK, dV of the
// head-dim half [128w, 128w + 128) over all 64 queries: its own queries' Pᵀ, dSᵀ from registers,
// the other's from shared memory. dQ (64 queries, its half of the columns) = dS K goes from
// registers to the accumulator with vector reductions, in the fragment order of the key-split
// consumers (DqSplit column halves), so that the convert kernel is the same.
template <class T, int kHeadDim, bool kMods>
__device__ __forceinline__ void bwd_consumer_head_split(const BwdKernelArgsSm90& args, const BwdSmem<T, kHeadDim>& sm, int consumer) {
  using Smem = BwdSmem<T, kHeadDim>;
  constexpr int kBlockM = Smem::kBlockM, kBlockN = Smem::kBlockN;
  constexpr int kQ = kBlockM / 2, kSTiles = kQ / 8;
  constexpr int kCols = kHeadDim / 2, kDTiles = kCols / 8;
  using Split = DqSplit<kBlockM, kHeadDim>;
  static_assert(kBlockM == 64 && kBlockN == 64 && kCols % kPanelCols == 0 && !Split::kByRows && Split::kCols == kCols,
                "64 queries and 64 keys per step, whole panels per head-dim half");
  const detail::BwdParams& p = args.p;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int q_own = kQ * consumer, q_other = kQ - q_own;
  const int col0 = kCols * consumer;
  const std::uint32_t k_addr = smem_addr(sm.k()), v_addr = smem_addr(sm.v());
  const std::uint32_t ds_addr = smem_addr(sm.ds(0)), pt_addr = smem_addr(sm.pt(0));
  // This warpgroup's head-dim half of Q, dO (B of dK, dV) and K (B of dQ): whole panels further.
  const std::uint32_t q_cols = (col0 / kPanelCols) * kBlockM * kPanelRowBytes, k_cols = (col0 / kPanelCols) * kBlockN * kPanelRowBytes;
  const int key_row = 16 * warp + lane / 4;

  ItemWalk<Smem> walk(sm);
#pragma unroll 1
  for (int item; (item = walk.next()) >= 0;) {
    const BwdWork<kBlockM, kBlockN> w(args, item);
    float dk[1][kDTiles][4] = {};  // (64 keys, head-dim half), unscaled
    float dv[1][kDTiles][4] = {};
    const std::int64_t prow0 = padded_row0<kBlockM>(p, w.b);
#pragma unroll 1
    for (ConsumerSteps it(sm, w, walk.step0()); it.wait_next(); it.release(lane)) {
      const int step = it.step, stage = it.stage(), m0 = it.cur.m_block * kBlockM;
      const std::uint32_t q_addr = smem_addr(sm.q(stage)), do_addr = smem_addr(sm.dout(stage));

      keep_tile_step<kMods>(p, sm, w, it.cur.head, m0);
      // Sᵀ (64 keys, its 32 queries) = K Qᵀ and dPᵀ = V dOᵀ (32 rows into a panel: whole swizzle atoms).
      float s[1][kSTiles][4], dp[1][kSTiles][4];
      score_products_t<T, kHeadDim, kBlockN, kBlockM>(flat(s), flat(dp), k_addr, v_addr, q_addr + q_own * kPanelRowBytes,
                                                      do_addr + q_own * kPanelRowBytes);

      std::uint32_t pa[kSTiles / 2][4], dsa[kSTiles / 2][4];
      score_steps_t<T, kMods>(s, dp, pa, dsa, p, sm, stage, w, it.cur.head, m0, q_own, key_row, lane);

      // Its Pᵀ and dSᵀ columns to shared memory, two buffers each by step parity (the other
      // warpgroup read buffer step % 2 in step - 2 and waited for those reads before it arrived at
      // the barrier of step - 1, which this warpgroup has passed).
      const std::uint32_t buf_off = (step & 1) * Smem::kSElems * sizeof(T);
      store_scores_t<kBlockN>(pt_addr + buf_off, pa, key_row, q_own, lane);
      store_scores_t<kBlockN>(ds_addr + buf_off, dsa, key_row, q_own, lane);

      // dV += Pᵀ dO and dK += dSᵀ Q over its own queries, from registers, while the other
      // warpgroup's columns come in.
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQ / 16; ++kk) {
        wgmma_rs<1>(flat(dv), pa[kk], desc_mn_major(do_addr + q_cols, kBlockM, q_own / 16 + kk), T{}, 1);
        wgmma_rs<1>(flat(dk), dsa[kk], desc_mn_major(q_addr + q_cols, kBlockM, q_own / 16 + kk), T{}, 1);
      }
      wgmma_commit();
      fence_async_shared();
      named_sync(kBarDsFull, 256);
      // dQ = dS K (A: the whole dSᵀ, M-major; B: its columns of K, N-major), then the other
      // warpgroup's queries of dV and dK, which run while dQ goes out.
      float dq[1][kDTiles][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_ss<1, 1>(flat(dq), desc_mn_major(ds_addr + buf_off, kBlockN, kk), desc_mn_major(k_addr + k_cols, kBlockN, kk), T{}, kk > 0);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kQ / 16; ++kk) {
        const int ks = q_other / 16 + kk;
        wgmma_ss<0, 1>(flat(dv), desc_k_major(pt_addr + buf_off, kBlockN, ks), desc_mn_major(do_addr + q_cols, kBlockM, ks), T{}, 1);
        wgmma_ss<0, 1>(flat(dk), desc_k_major(ds_addr + buf_off, kBlockN, ks), desc_mn_major(q_addr + q_cols, kBlockM, ks), T{}, 1);
      }
      wgmma_commit();
      wgmma_wait<1>();  // dQ done
      fence_regs(flat(dq));
      float* dq_g = args.dq_acc + (static_cast<std::int64_t>(it.cur.head) * args.rows + prow0 + m0) * kHeadDim;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j)
        red_add_v4(dq_g + Split::float4_index(consumer, j, tid) * 4, dq[0][j][0], dq[0][j][1], dq[0][j][2], dq[0][j][3]);

      wgmma_wait<0>();
      fence_regs(flat(dv));
      fence_regs(flat(dk));
    }
    sm.kv_empty().arrive();  // every product that reads K and V (and the record) is done
    store_dkdv<T>(p, w, dk, dv, key_row, col0, lane);
    walk.done(w.steps());
  }
}

}  // namespace sm90

namespace sm90 {

// The producer (one thread): per work item K and V once into their slots, then Q, dO, lse and D of
// each of its steps into the q_stages ring, which runs on across items.
template <class T, int kHeadDim>
__device__ __forceinline__ void bwd_producer(const BwdKernelArgsSm90& args, const BwdSmem<T, kHeadDim>& sm) {
  using Smem = BwdSmem<T, kHeadDim>;
  constexpr int kBlockM = Smem::kBlockM, kBlockN = Smem::kBlockN, kStages = Smem::kStages;
  constexpr int kPanels = kHeadDim / kPanelCols;
  const detail::BwdParams& p = args.p;
  prefetch_tensor_map(&args.tm_q);
  prefetch_tensor_map(&args.tm_do);
  // Items come from work_next in index order, each taken by a running block (so the deterministic
  // dQ's waits, for lower key blocks of the same head, are for items that run or have run), the
  // next one while this item's last steps run (the atomic's latency off the path); items without
  // keys (a varlen sequence shorter than the key block) are skipped.
  auto take = [&] {
    int item = atomicAdd(args.work_next, 1);
    while (item < args.items && BwdWork<kBlockM, kBlockN>::empty_item(args, item)) item = atomicAdd(args.work_next, 1);
    return item < args.items ? item : -1;
  };
  int item = take();
  // The block's steps so far (the Q ring's position) times 2, plus the parity of the items loaded
  // (the K/V barriers' phase): one register of the 24.
  unsigned state = 0;
#pragma unroll 1
  for (;;) {
    // K and V of the previous item are read (by every consumer) and its record too.
    sm.kv_empty().wait((state & 1) ^ 1);
    sm.record() = item;  // published by kv_full's arrival
    if (item < 0) {
      sm.kv_full().arrive();
      break;
    }
    const BwdWork<kBlockM, kBlockN> w(args, item);
    const int batch_coord = p.is_varlen() ? 0 : w.b;  // varlen tensors are one batch entry of packed rows
    // K and V once; keys past the sequence belong to the next one (or read as zeros): masked.
    const int k_row = static_cast<int>(w.si.k_row0 + w.kb);
    sm.kv_full().arrive_expect_tx(2 * Smem::kKVElems * sizeof(T));
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn) {
      tma_load(sm.k() + pn * kBlockN * kPanelCols, &args.tm_k, pn * kPanelCols, w.kv_head, k_row, batch_coord, sm.kv_full());
      tma_load(sm.v() + pn * kBlockN * kPanelCols, &args.tm_v, pn * kPanelCols, w.kv_head, k_row, batch_coord, sm.kv_full());
    }
    const std::int64_t prow0 = padded_row0<kBlockM>(p, w.b);
    auto cur = w.first();
#pragma unroll 1
    for (int j = 0; j < w.steps(); ++j, w.next(cur), state += 2) {
      const int stage = (state >> 1) % kStages;
      const std::uint32_t phase = ((state >> 1) / kStages) & 1;
      const int head = cur.head, m0 = cur.m_block * kBlockM;
      sm.q_empty(stage).wait(phase ^ 1);
      Barrier& full = sm.q_full(stage);
      full.arrive_expect_tx(2 * Smem::kQElems * sizeof(T) + 2 * kBlockM * sizeof(float));
      const int q_row = static_cast<int>(w.si.q_row0 + m0);
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn) {
        tma_load(sm.q(stage) + pn * kBlockM * kPanelCols, &args.tm_q, pn * kPanelCols, head, q_row, batch_coord, full);
        tma_load(sm.dout(stage) + pn * kBlockM * kPanelCols, &args.tm_do, pn * kPanelCols, head, q_row, batch_coord, full);
      }
      // lse and D by a tensor map too: racecheck reported the 1-D bulk copies (cp.async.bulk) into
      // the stage against the consumers' reads before the q_empty arrival (10 hazards), which the
      // tensor loads under the same barriers are not.
      tma_load(sm.lse(stage), &args.tm_rows, static_cast<int>(prow0 + m0), head, 0, full);
    }
    state ^= 1;
    item = take();
  }
}

}  // namespace sm90

// kScoreMods: the variant with softcap, ALiBi and dropout (the common one carries none of their
// registers).
template <class T, int kHeadDim, bool kScoreMods>
__global__ void __launch_bounds__(bwd_tile_sm90(kHeadDim).threads(), 1)
    bwd_kernel_sm90(const __grid_constant__ BwdKernelArgsSm90 args) {
  using namespace sm90;
  using Smem = BwdSmem<T, kHeadDim>;
  constexpr BwdTileSm90 kTile = Smem::kTile;
  static_assert(kTile.registers_fit(), "setmaxnreg targets exceed the block's launch registers");
  constexpr int kBlockM = kTile.block_m, kBlockN = kTile.block_n;

  extern __shared__ unsigned char smem_raw[];
  const Smem sm(smem_raw);
  if (threadIdx.x == 0) sm.init_barriers();
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  // Each role derives its work after its register reallocation, so that nothing computed before it
  // (for the other role) is live across it.
  if (warpgroup == 0) {
    regs_dealloc<kTile.producer_regs>();
    if constexpr (!kTile.head_split) {
      if (threadIdx.x / 32 == 1) {
        dq_writer<kBlockM, kBlockN, kHeadDim>(args, sm, sm.dq(0), threadIdx.x % 32);
        return;
      }
    }
    if (threadIdx.x == 0) bwd_producer<T, kHeadDim>(args, sm);
    return;
  }

  regs_alloc<kTile.consumer_regs>();
  if constexpr (kTile.head_split) bwd_consumer_head_split<T, kHeadDim, kScoreMods>(args, sm, warpgroup - 1);
  else bwd_consumer_key_split<T, kHeadDim, kScoreMods>(args, sm, warpgroup - 1);
}

}  // namespace flashmonoid::cuda
