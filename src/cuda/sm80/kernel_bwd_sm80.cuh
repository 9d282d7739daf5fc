// FlashAttention-2 backward on mma.sync (sm80 and later), three kernels:
//   1. bwd_preprocess: D = rowsum(dO∘O) per (head, query row) in fp32; clears the dQ accumulator.
//   2. bwd_main: one thread block per (key block, batch, KV head). K_j and V_j stay in shared
//      memory; the block walks every query block of every query head of the GQA group that sees
//      a key of K_j, recomputing P from the forward's lse, and accumulates dK_j, dV_j in registers
//      (so the GQA reduction needs no workspace and no second pass). dQ is added into an fp32
//      accumulator: float atomics, or, when deterministic, in key-block order (semaphores).
//   3. bwd_convert_dq: dq = scale · dQ accumulator, cast to the input dtype.
//
// Scores in this kernel are computed transposed, Sᵀ = K Qᵀ (kBlockN, kBlockM), so that Pᵀ and dSᵀ,
// stored as (key, query) rows, are read back by plain ldmatrix as the A operands of dV += Pᵀ dO and
// dK += dSᵀ Q (the two larger products), and by ldmatrix.trans only for dQ = dS K.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "api/params.hpp"
#include "common/block_range.cuh"
#include "common/score_mod.cuh"
#include "common/softmax.cuh"
#include "flashmonoid/detail/mask.hpp"
#include "sm80/bwd_sm80.hpp"
#include "sm80/mma_sm80.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/warp_gemm_sm80.cuh"

namespace flashmonoid::cuda::bwd {

// Tile shapes. 8 warps; kBlockM query rows per step (a multiple of kBwdBlockM, which sizes the
// workspace's semaphores).
// Three warp grids over one (kBlockN keys, kBlockM queries) step, as FlashAttention-2 lays them
// out: Sᵀ and dPᵀ (kSWarpsN along keys × kSWarpsM along queries), dK and dV (kKVWarpsN along keys
// × kKVWarpsD along the head dim), dQ (kDqWarpsM along queries × kDqWarpsD along the head dim).
// Square-ish warp tiles reuse each ldmatrix fragment in more MMAs: at hdim 128 a 32 × 32 Sᵀ tile
// takes 4 ldmatrix.x4 per 8 MMAs per head-dim step where the v3 16 × 32 tile took 6 per 8.
// dK, dV hold 2 · kBlockN·kHeadDim / 256 threads fp32 registers: 64 at hdim 64, 128 at hdim 128
// (kBlockN 128) and 256 (kBlockN 64); these key tiles, twice the earlier 64 and 32, halve the dQ
// atomics and barriers per FLOP (measured 2.0× at hdim 128, 16k; bench/NOTES.md v4). Pᵀ and dSᵀ
// travel through shared memory to the warps that own their key rows (until v4, hdim 64 kept 16 keys
// × all queries per warp to feed dV from registers, at 5 ldmatrix.x4 per 8 Sᵀ MMAs).
template <int kHeadDim_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head-dim buckets are 64, 128, 256");
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  // 128 query rows at hdim 64 as FlashAttention-2 takes there: the (32 keys, 64 queries) Sᵀ warp
  // tile needs 6 ldmatrix.x4 per 16 MMAs per head-dim step where (32, 32) needs 4 per 8 and
  // v4's (16, 64) 5 per 8, and the two block barriers and the fixed per-step costs are spread over
  // twice the work. At hdim 128 and 256 registers hold no larger tile (dK, dV take 128 of them).
  static constexpr int kBlockM = kHeadDim == 64 ? 2 * kBwdBlockM : kBwdBlockM;
  static_assert(kBlockM % kBwdBlockM == 0, "the workspace sizes one semaphore per kBwdBlockM rows");
  static constexpr int kBlockN = kHeadDim > 128 ? 64 : 128;
  static constexpr int kSWarpsN = kBlockN / 32;
  static constexpr int kSWarpsM = kNWarps / kSWarpsN;
  static constexpr int kSWarpN = kBlockN / kSWarpsN;  // (kSWarpN, kSWarpM) Sᵀ tile per warp
  static constexpr int kSWarpM = kBlockM / kSWarpsM;
  static constexpr int kKVWarpsN = kSWarpsN;
  static constexpr int kKVWarpsD = kNWarps / kKVWarpsN;
  static constexpr int kKVWarpN = kBlockN / kKVWarpsN;  // (kKVWarpN, kKVWarpD) dK, dV tile per warp
  static constexpr int kKVWarpD = kHeadDim / kKVWarpsD;
  static constexpr int kDqWarpsM = kHeadDim == 64 ? 4 : 2;
  static constexpr int kDqWarpsD = kNWarps / kDqWarpsM;
  static constexpr int kDqWarpM = kBlockM / kDqWarpsM;  // (kDqWarpM, kDqWarpD) dQ tile per warp
  static constexpr int kDqWarpD = kHeadDim / kDqWarpsD;
  // dQ columns per pass: 32 keeps its accumulator at kDqWarpM registers next to dK and dV. hdim
  // 256 takes its whole 64-column warp tile in one pass (64 registers next to dK, dV's 128), so
  // that whole tiles take the short dQ additions (see the kernel): two passes of the general form
  // cost ~25 SASS instructions per 8-byte reduction, ~800 of the ~1700 a warp issued per step.
  static constexpr int kDqPass = kHeadDim == 256 ? 64 : 32;
  // Q/dO stages. Two at hdim 128 (162 KB, fits sm80's 163 KB), so that the next step's copy is
  // in flight during the whole step. One at hdim 64 and 256, on every device: two (164 and 208 KB,
  // sm90 only) measured 2-3 % (hdim 64) and 11-12 % (hdim 256) slower on the H100 than one (132
  // and 145 KB) at 4k and 16k, causal or not (bench/NOTES.md, backward v6). One stage overlaps the copy
  // with dQ only. A constant per head dim, so the kernel compiles one step order.
  static constexpr int kStages = kHeadDim == 128 ? 2 : 1;
  // Column passes over Sᵀ and dPᵀ (see the kernel), so that both fit next to dK and dV.
  // hdim 64 fuses the two products (kFuseSdP): each pass computes its columns of Sᵀ and dPᵀ in
  // one k loop, 2 passes (s and dp 32 registers each live where the whole Sᵀ plus a quarter of
  // dPᵀ took 80; one fused pass spilled 376 bytes). Against the whole Sᵀ first and dPᵀ in 4
  // passes (the whole 32 × 64 tile spilled 432 bytes, 2 passes 8) that is 64 instead of 72
  // ldmatrix.x4 per warp and step (V's fragments were loaded once per dPᵀ pass) and 16
  // independent MMA chains per pass instead of 4: +1-2.5 % on the H100 (bench/NOTES.md, backward v6 round 2).
  // hdim 128 keeps Sᵀ whole and dPᵀ in 2 passes (one spilled 32 bytes): fused, its 2 passes load
  // 96 instead of 80 ldmatrix.x4 and measured 5-6 % slower. hdim 256: one pass; fused it spilled
  // 4 bytes and was ~1 % slower.
  static constexpr bool kFuseSdP = kHeadDim == 64;
  // hdim 256 (sm90): the dQ reductions of a whole tile are issued during the next step's Sᵀ products
  // (see the kernel), kDeferRedsPerKk per k step in source order; ptxas places all 32 within the
  // first ~16 of the 64 MMAs either way (2 and 4 gave the same schedule shape). +1-2 % at hdim 256
  // in two calls on the H100 (bench/NOTES.md, backward v6 round 2). Not tried at 64 and 128: 16 reductions per
  // warp-step there, and at 128 the two-stage order already overlaps them with dK.
  static constexpr bool kDeferDq = kHeadDim == 256;
  static constexpr int kDeferRedsPerKk = 2;
  static constexpr int kDpPasses = kHeadDim == 256 ? 1 : 2;

  static constexpr int kKVElems = kBlockN * kHeadDim;  // (kBlockN, kHeadDim) each for K, V
  static constexpr int kQElems = kBlockM * kHeadDim;   // (kBlockM, kHeadDim) each for Q, dO, per stage
  static constexpr int kSElems = kBlockN * kBlockM;    // (kBlockN, kBlockM) each for dSᵀ, Pᵀ
  // K, V, dSᵀ, Pᵀ, then lse and D per stage and the dropout keep bits, then the Q/dO stages.
  static constexpr std::size_t kFixedSmemBytes =
      (2 * kKVElems + 2 * kSElems) * 2 + 2 * kStages * kBlockM * sizeof(float) +
      kBlockM * (kBlockN / 32) * sizeof(std::uint32_t);
  static constexpr std::size_t kSmemBytes = kFixedSmemBytes + kStages * 2 * kQElems * 2;
  static_assert(kFixedSmemBytes % 128 == 0, "Q/dO stages must start 128-byte aligned for the swizzle");
  static_assert(kSWarpN % 16 == 0 && kSWarpM % 16 == 0 && kKVWarpN % 16 == 0 && kKVWarpD % 16 == 0 &&
                    kDqWarpM % 16 == 0 && kDqWarpD % kDqPass == 0,
                "warp tiles must be whole 16 × 16 MMA steps");
  static_assert(kSmemBytes <= 166912, "shared memory beyond the 163 KB an sm80 block may use");
};

// ---------------------------------------------------------------------------------------------
// 1. D = rowsum(dO∘O) and a cleared dQ accumulator. kRowLanes lanes per (query row, head), 8
// elements (16 bytes) each, so every lane of a warp loads: one warp per row left 24 (hdim 64) and
// 16 (hdim 128) of 32 lanes idle. Measured (H200, 16k tokens, hidden 2048): the whole backward
// 0.10 ms faster at hdim 64 (+2-3 % at 4k), 0.02 ms at 128, unchanged at 256.
inline constexpr int kRowKernelWarps = 8;
template <int kHeadDim>
inline constexpr int kRowLanes = kHeadDim / 8 < 32 ? kHeadDim / 8 : 32;
template <int kHeadDim>
inline constexpr int kRowsPerBlock = kRowKernelWarps * 32 / kRowLanes<kHeadDim>;

template <class T, int kHeadDim>
__global__ void __launch_bounds__(kRowKernelWarps * 32)
    bwd_preprocess(const detail::BwdParams p, float* __restrict__ dsum, float* __restrict__ dq_acc) {
  constexpr int kLanes = kRowLanes<kHeadDim>;
  const int b = blockIdx.z, head = blockIdx.y;
  const int lane = threadIdx.x % kLanes;
  const int i = blockIdx.x * kRowsPerBlock<kHeadDim> + threadIdx.x / kLanes;
  const detail::SeqInfo si = detail::seq_info(p, b);
  const bool row_ok = i < si.len_q;  // no early return: the reduction below needs every lane
  float acc = 0.0f;
  if (row_ok) {
    const T* o = static_cast<const T*>(p.out) + detail::offset_of(p.o_stride, b, si.q_row0 + i, head);
    const T* d_o = static_cast<const T*>(p.dout) + detail::offset_of(p.do_stride, b, si.q_row0 + i, head);
    for (int c = lane * 8; c < p.d; c += kLanes * 8) acc += dot8(o + c, d_o + c);  // 16-byte loads
  }
  // Within the row's kLanes lanes: the same pairings as the former 32-lane tree, whose first
  // levels only added the idle lanes' zeros.
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (!row_ok) return;
  if (lane == 0) dsum[detail::lse_index(p, b, head, si, i)] = acc;
  float4* row = reinterpret_cast<float4*>(dq_acc + (static_cast<std::int64_t>(head) * p.total_q + si.global_q_row0 + i) * p.d);
  for (int c = lane; c < p.d / 4; c += kLanes) row[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// 3. dq = scale · accumulator in the input dtype. kRowLanes lanes per (query row, head).
template <class T, int kHeadDim>
__global__ void __launch_bounds__(kRowKernelWarps * 32)
    bwd_convert_dq(const detail::BwdParams p, const float* __restrict__ dq_acc) {
  constexpr int kLanes = kRowLanes<kHeadDim>;
  const int b = blockIdx.z, head = blockIdx.y;
  const int lane = threadIdx.x % kLanes;
  const int i = blockIdx.x * kRowsPerBlock<kHeadDim> + threadIdx.x / kLanes;
  const detail::SeqInfo si = detail::seq_info(p, b);
  if (i >= si.len_q) return;
  const float* src = dq_acc + (static_cast<std::int64_t>(head) * p.total_q + si.global_q_row0 + i) * p.d;
  T* dst = static_cast<T*>(p.dq) + detail::offset_of(p.dq_stride, b, si.q_row0 + i, head);
  for (int c = lane * 8; c < p.d; c += kLanes * 8) {
    const float4 x = *reinterpret_cast<const float4*>(src + c);
    const float4 y = *reinterpret_cast<const float4*>(src + c + 4);
    uint4 out;
    out.x = pack2<T>(x.x * p.scale, x.y * p.scale);
    out.y = pack2<T>(x.z * p.scale, x.w * p.scale);
    out.z = pack2<T>(y.x * p.scale, y.y * p.scale);
    out.w = pack2<T>(y.z * p.scale, y.w * p.scale);
    *reinterpret_cast<uint4*>(dst + c) = out;
  }
}

// ---------------------------------------------------------------------------------------------
// 2. The main kernel, as its stages: the block's work (BwdKeyBlock) and shared memory (BwdSmem),
// loads, the Sᵀ and dPᵀ products, the score gradient (P, dS), dV and dK (DkDv, which is also the
// epilogue), and the dQ accumulation policy (DqAccumulator). bwd_main composes them.

// %laneid, read where it is used (volatile, so that the compiler does not reuse an earlier read).
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}

// dQ accumulator += (x, y) at r, r + 1 (8-byte aligned: even column, even row length). On sm90
// one 8-byte reduction per pair: a warp's instruction then fills whole 32-byte sectors (4 lanes x
// 8 bytes per row) instead of half-filling twice as many. Two forms of it:
// - red_dq_pair, the whole tiles' short form: red.global.add.v2.f32, which compiles to REDG
//   (no return value). The float2 atomicAdd compiles to ATOMG, a returning atomic whose result is
//   discarded; LG-throttle stalls were the largest share at hdim 256 (ncu), and REDG measured
//   +3 % (hdim 64), +4-5 % (128), +8-9 % (256) at 16k (bench/NOTES.md, backward v6).
// - add_dq_pair, the general form (edge tiles): atomicAdd. With the asm there too, ptxas spilled
//   8 bytes at hdim 256 (two reloads per step); the edge tiles are a few per row of key blocks.
__device__ __forceinline__ void red_dq_pair(float* r, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(r), "f"(x), "f"(y));
#else
  atomicAdd(r, x);
  atomicAdd(r + 1, y);
#endif
}
__device__ __forceinline__ void add_dq_pair(float* r, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(r), make_float2(x, y));
#else
  atomicAdd(r, x);
  atomicAdd(r + 1, y);
#endif
}


// Shared memory (BwdTraits::kSmemBytes): K, V, dSᵀ, Pᵀ, lse and D per stage, the dropout keep
// bits, then the Q/dO stages.
template <class T, class Tr>
struct BwdSmem {
  T* k;                 // (kBlockN, kHeadDim)
  T* v;                 // (kBlockN, kHeadDim)
  T* ds;                // (kBlockN, kBlockM) dSᵀ
  T* p;                 // (kBlockN, kBlockM) P_dropᵀ
  float* lse;           // kStages × (kBlockM)
  float* d;             // kStages × (kBlockM)
  std::uint32_t* keep;  // (kBlockM, kBlockN / 32) dropout keep bits, 32 keys a word
  T* q;                 // stage s: q + s · 2 kQElems, (kBlockM, kHeadDim)
  T* dout;              // stage s: dout + s · 2 kQElems, (kBlockM, kHeadDim)

  __device__ __forceinline__ explicit BwdSmem(unsigned char* raw)
      : k(reinterpret_cast<T*>(raw)),
        v(k + Tr::kKVElems),
        ds(v + Tr::kKVElems),
        p(ds + Tr::kSElems),
        lse(reinterpret_cast<float*>(p + Tr::kSElems)),
        d(lse + Tr::kStages * Tr::kBlockM),
        keep(reinterpret_cast<std::uint32_t*>(d + Tr::kStages * Tr::kBlockM)),
        q(reinterpret_cast<T*>(raw + Tr::kFixedSmemBytes)),
        dout(q + Tr::kQElems) {}
};

// The work of one thread block: key block n_block of (batch b, KV head hk), and the query tiles of
// every query head of the GQA group that see one of its keys, as steps it = 0 .. n_iter - 1.
template <class Tr>
struct BwdKeyBlock {
  int n_block, b, hk, group;  // group: query heads per KV head (FwdParams::group() is host-only)
  detail::SeqInfo si;
  std::int64_t kb;  // first key
  detail::Band band;
  int keys_valid;
  QueryTiles tiles;
  int n_iter;  // (query head of the group, query tile) pairs, head-major

  __device__ __forceinline__ explicit BwdKeyBlock(const detail::BwdParams& p)
      : n_block(blockIdx.x),
        b(blockIdx.y / p.h_k),
        hk(blockIdx.y % p.h_k),
        group(p.h / p.h_k),
        si(detail::seq_info(p, b)),
        kb(static_cast<std::int64_t>(n_block) * Tr::kBlockN),
        band(detail::band_of(p, si)),
        keys_valid(static_cast<int>(si.len_k - kb < Tr::kBlockN ? si.len_k - kb : Tr::kBlockN)),
        tiles(query_tiles<Tr::kBlockM>(band, kb, kb + keys_valid, si.len_q)),
        n_iter(tiles.count() * group) {}
  __device__ __forceinline__ bool empty() const { return kb >= si.len_k; }
  // Query tiles are visited last to first. Under a causal mask every key block sees the last
  // query tile, so in deterministic mode all key blocks start on the same tile and pass it on in
  // key-block order one dQ addition apart; visited first to last, key block n would wait for n
  // steps of its predecessors before its first addition (measured 24 TFLOP/s causal vs 48
  // non-causal at hdim 128, 16k).
  __device__ __forceinline__ int m_block(int it) const { return tiles.hi - 1 - it % tiles.count(); }
  __device__ __forceinline__ int head(int it) const { return hk * group + it / tiles.count(); }
};

// Load stage: K and V of the key block, once.
template <class T, class Tr>
__device__ __forceinline__ void load_key_block(const detail::BwdParams& p, const BwdKeyBlock<Tr>& blk,
                                               const BwdSmem<T, Tr>& sm) {
  const T* k_g = static_cast<const T*>(p.k) + detail::offset_of(p.k_stride, blk.b, blk.si.k_row0 + blk.kb, blk.hk);
  const T* v_g = static_cast<const T*>(p.v) + detail::offset_of(p.v_stride, blk.b, blk.si.k_row0 + blk.kb, blk.hk);
  load_rows_async_folded<Tr::kBlockN, Tr::kHeadDim, Tr::kNThreads>(sm.k, k_g, p.k_stride.row, blk.keys_valid, p.d);
  load_rows_async_folded<Tr::kBlockN, Tr::kHeadDim, Tr::kNThreads>(sm.v, v_g, p.v_stride.row, blk.keys_valid, p.d);
}

// Load stage: Q, dO, lse and D of step it into Q/dO stage `stage`, all asynchronously (plain loads
// of lse and D stalled warps 0-1 for a global round trip every step), as one commit group.
template <class T, class Tr>
__device__ __forceinline__ void load_query_tile(const detail::BwdParams& p, const BwdKeyBlock<Tr>& blk,
                                                const BwdSmem<T, Tr>& sm, const float* dsum, int it, int stage,
                                                int tid) {
  constexpr int kBlockM = Tr::kBlockM;
  const int head = blk.head(it);
  const std::int64_t r0 = static_cast<std::int64_t>(blk.m_block(it)) * kBlockM;
  const int rows_valid = static_cast<int>(blk.si.len_q - r0 < kBlockM ? blk.si.len_q - r0 : kBlockM);
  const T* q_g = static_cast<const T*>(p.q) + detail::offset_of(p.q_stride, blk.b, blk.si.q_row0 + r0, head);
  const T* do_g = static_cast<const T*>(p.dout) + detail::offset_of(p.do_stride, blk.b, blk.si.q_row0 + r0, head);
  load_rows_async_folded<kBlockM, Tr::kHeadDim, Tr::kNThreads>(sm.q + stage * 2 * Tr::kQElems, q_g, p.q_stride.row,
                                                         rows_valid, p.d);
  load_rows_async_folded<kBlockM, Tr::kHeadDim, Tr::kNThreads>(sm.dout + stage * 2 * Tr::kQElems, do_g, p.do_stride.row,
                                                         rows_valid, p.d);
  if (tid < kBlockM) {
    const bool ok = tid < rows_valid;
    const std::int64_t idx = ok ? detail::lse_index(p, blk.b, head, blk.si, r0 + tid) : 0;
    cp_async_4(sm.lse + stage * kBlockM + tid, p.lse + idx, ok);
    cp_async_4(sm.d + stage * kBlockM + tid, dsum + idx, ok);
  }
  cp_async_commit();
}

// Step it of the key block: query tile m_block (rows r0..) of query head `head`, its Q, dO
// (shared-window addresses), lse and D in Q/dO stage `stage`.
template <class T, class Tr>
struct BwdStep {
  int head, m_block;
  std::int64_t r0;
  std::uint32_t q, dout;
  const float *lse, *d;
  __device__ __forceinline__ BwdStep(const BwdKeyBlock<Tr>& blk, const BwdSmem<T, Tr>& sm, int it, int stage)
      : head(blk.head(it)),
        m_block(blk.m_block(it)),
        r0(static_cast<std::int64_t>(m_block) * Tr::kBlockM),
        q(smem_addr(sm.q) + stage * 2 * Tr::kQElems * 2),
        dout(smem_addr(sm.dout) + stage * 2 * Tr::kQElems * 2),
        lse(sm.lse + stage * Tr::kBlockM),
        d(sm.d + stage * Tr::kBlockM) {}
};

// Warp tiles of the three grids (see BwdTraits) and each lane's offsets into the swizzled tiles
// (SwizzledOffset): one offset per operand shape, shared by the tiles of that shape.
template <class Tr>
struct BwdWarpTiles {
  using SwD = SwizzledOffset<Tr::kHeadDim>;  // K, V, Q, dO
  using SwM = SwizzledOffset<Tr::kBlockM>;   // dSᵀ, Pᵀ
  int key0, q0;      // Sᵀ, dPᵀ tile (kSWarpN, kSWarpM): keys key0.., queries q0..
  int kv0, d0;       // dK, dV tile (kKVWarpN, kKVWarpD): keys kv0.., dims d0..
  int dq_m0, dq_d0;  // dQ tile (kDqWarpM, kDqWarpD): queries dq_m0.., dims dq_d0..
  std::uint32_t kv_a;   // K, V as A
  std::uint32_t q_b;    // Q, dO as B
  std::uint32_t q_bt;   // Q, dO as B via .trans
  std::uint32_t s_a;    // Pᵀ, dSᵀ as A
  std::uint32_t s_st;   // Sᵀ fragment stores
  std::uint32_t ds_at;  // dSᵀ as A via .trans
  std::uint32_t k_bt;   // K as B via .trans

  __device__ __forceinline__ BwdWarpTiles(int warp, int lane)
      : key0((warp % Tr::kSWarpsN) * Tr::kSWarpN),
        q0((warp / Tr::kSWarpsN) * Tr::kSWarpM),
        kv0((warp % Tr::kKVWarpsN) * Tr::kKVWarpN),
        d0((warp / Tr::kKVWarpsN) * Tr::kKVWarpD),
        dq_m0((warp % Tr::kDqWarpsM) * Tr::kDqWarpM),
        dq_d0((warp / Tr::kDqWarpsM) * Tr::kDqWarpD),
        kv_a(SwD::lane_offset(key0 + ldsm_a_row(lane), ldsm_a_chunk(lane))),
        q_b(SwD::lane_offset(q0 + ldsm_b_row(lane), ldsm_b_chunk(lane))),
        q_bt(SwD::lane_offset(ldsm_a_row(lane), d0 / 8 + ldsm_a_chunk(lane))),
        s_a(SwM::lane_offset(kv0 + ldsm_a_row(lane), ldsm_a_chunk(lane))),
        s_st(SwM::lane_offset(key0 + lane / 4, q0 / 8) + 4 * (lane % 4)),
        ds_at(SwM::lane_offset(ldsm_b_row(lane), dq_m0 / 8 + ldsm_b_chunk(lane))),
        k_bt(SwD::lane_offset(ldsm_a_row(lane), dq_d0 / 8 + ldsm_a_chunk(lane))) {}
};

// Products stage. acc (kSWarpN keys, 8·kNT queries) += A (kSWarpN, kHeadDim) · Bᵀ for query
// columns 8·t0..: Sᵀ = K Qᵀ (a_tile K, b_tile Q) or dPᵀ = V dOᵀ (V, dO). per_kk(kk) runs before k
// step kk's loads (the carried dQ reductions, see DqAccumulator).
template <class T, class Tr, int kSMT, int kNT, class PerKk>
__device__ __forceinline__ void gemm_st(float (&acc)[kSMT][kNT][4], std::uint32_t a_tile, std::uint32_t b_tile,
                                        const BwdWarpTiles<Tr>& w, int t0, PerKk&& per_kk) {
  using SwD = SwizzledOffset<Tr::kHeadDim>;
#pragma unroll
  for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
    per_kk(kk);
    std::uint32_t a[kSMT][4];
#pragma unroll
    for (int mt = 0; mt < kSMT; ++mt) ldmatrix_x4_at(a[mt], a_tile + SwD::step(w.kv_a, 16 * mt, 2 * kk));
#pragma unroll
    for (int nj = 0; nj < kNT / 2; ++nj) {
      std::uint32_t bb[4];
      ldmatrix_x4_at(bb, b_tile + SwD::step(w.q_b, 8 * t0 + 16 * nj, 2 * kk));
      const std::uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
      for (int mt = 0; mt < kSMT; ++mt) {
        mma_16816<T>(acc[mt][2 * nj], a[mt], b0);
        mma_16816<T>(acc[mt][2 * nj + 1], a[mt], b1);
      }
    }
  }
}

// Fused form (kFuseSdP): Sᵀ columns 8·t0.. (kNT n8 tiles, into s[.][t0..]) and dPᵀ (dp[.][0..]) in
// one k loop over K, Qᵀ, V, dOᵀ fragments.
template <class T, class Tr, int kSMT, int kSNT, int kNT>
__device__ __forceinline__ void gemm_st_dpt(float (&s)[kSMT][kSNT][4], float (&dp)[kSMT][kNT][4],
                                            const BwdSmem<T, Tr>& sm, const BwdStep<T, Tr>& st,
                                            const BwdWarpTiles<Tr>& w, int t0) {
  using SwD = SwizzledOffset<Tr::kHeadDim>;
  const std::uint32_t k_tile = smem_addr(sm.k), v_tile = smem_addr(sm.v);
#pragma unroll
  for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
    std::uint32_t ak[kSMT][4], av[kSMT][4];
#pragma unroll
    for (int mt = 0; mt < kSMT; ++mt) {
      ldmatrix_x4_at(ak[mt], k_tile + SwD::step(w.kv_a, 16 * mt, 2 * kk));
      ldmatrix_x4_at(av[mt], v_tile + SwD::step(w.kv_a, 16 * mt, 2 * kk));
    }
#pragma unroll
    for (int nj = 0; nj < kNT / 2; ++nj) {
      std::uint32_t bq[4], bd[4];
      ldmatrix_x4_at(bq, st.q + SwD::step(w.q_b, 8 * t0 + 16 * nj, 2 * kk));
      ldmatrix_x4_at(bd, st.dout + SwD::step(w.q_b, 8 * t0 + 16 * nj, 2 * kk));
      const std::uint32_t bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
      const std::uint32_t bd0[2] = {bd[0], bd[1]}, bd1[2] = {bd[2], bd[3]};
#pragma unroll
      for (int mt = 0; mt < kSMT; ++mt) {
        mma_16816<T>(s[mt][t0 + 2 * nj], ak[mt], bq0);
        mma_16816<T>(dp[mt][2 * nj], av[mt], bd0);
        mma_16816<T>(s[mt][t0 + 2 * nj + 1], ak[mt], bq1);
        mma_16816<T>(dp[mt][2 * nj + 1], av[mt], bd1);
      }
    }
  }
}

// Score-gradient stage on (key, query) fragments (FragCoords<true>): P = exp2(score − lse·log2 e)
// from the forward's lse, dropout, dS = P ∘ (dP_drop − D) (∘ (1 − tanh²) under softcap). After it s
// holds P_drop and dp holds dS. The plain form (no mask, softcap, ALiBi or dropout, every query row
// in the sequence: every tile but the diagonal and the edges at 16k) costs one FFMA and one MUFU
// per P. The general form evaluates every score modifier of common/score_mod.cuh.
template <class Tr>
struct ScoreGrad {
  FragCoords<true> at;  // (key, query) of the warp's Sᵀ fragments, tile-local
  int q0, lane;
  const float *lse, *d;
  float scale_log2;
  // General form only:
  TileBand band;
  ScoreMod mod;
  float slope_log2;
  bool dropout;
  float dropout_rescale;
  const std::uint32_t* keep;

  template <class T>
  __device__ __forceinline__ ScoreGrad(const detail::BwdParams& p, const BwdKeyBlock<Tr>& blk,
                                       const BwdStep<T, Tr>& st, const BwdWarpTiles<Tr>& w, const std::uint32_t* keep_,
                                       int lane)
      : at(w.key0, w.q0, lane),
        q0(w.q0),
        lane(lane),
        lse(st.lse),
        d(st.d),
        scale_log2(p.scale_log2),
        band(blk.band, st.r0, blk.kb,
             static_cast<int>(blk.si.len_q - st.r0 < Tr::kBlockM ? blk.si.len_q - st.r0 : Tr::kBlockM),
             blk.keys_valid),
        mod(p),
        slope_log2(detail::alibi_slope(p, blk.b, st.head) * kLog2e),
        dropout(p.dropout_p > 0.0f),
        dropout_rescale(p.dropout_rescale),
        keep(keep_) {}

  // at.query(mt, n, e), summed in the order that fits each target's registers: as FragCoords
  // holds it (q0 + 2·(lane%4) in one register) on sm90; from q0 and the lane on sm80, where the
  // held sum spilled 8 bytes at hdim 64 (and this order spilled 12 on sm90; ptxas, 255 registers).
  __device__ __forceinline__ int query(int mt, int n, int e) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return at.query(mt, n, e);
#else
    return q0 + n * 8 + 2 * (lane % 4) + (e % 2);
#endif
  }

  // Query columns 8·t0.. of s and the kDpNT n8 tiles of dp (one dPᵀ pass).
  template <bool kPlain, int kSMT, int kSNT, int kDpNT>
  __device__ __forceinline__ void operator()(float (&s)[kSMT][kSNT][4], float (&dp)[kSMT][kDpNT][4], int t0) const {
    constexpr int kKeepWords = Tr::kBlockN / 32;
#pragma unroll
    for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
      for (int t = 0; t < kDpNT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& sv = s[mt][t0 + t][e];
          if constexpr (kPlain) {
            const int qc = query(mt, t0 + t, e);
            const float pr = fast_exp2(fmaf(sv, scale_log2, -lse[qc] * kLog2e));
            sv = pr;
            dp[mt][t][e] = pr * (dp[mt][t][e] - d[qc]);
          } else {
            const int qc = query(mt, t0 + t, e);
            const int key = at.key(mt, t0 + t, e);
            float dscore;  // d(score)/d(scale·q·k)
            float s2 = mod.log2_score(sv, dscore);
            // Unconditional (slope_log2 = 0 without ALiBi): under `if` ptxas kept the flag in a
            // uniform predicate and copied it before each of the 4 predicated instructions.
            s2 += alibi_log2(slope_log2, band.alibi_distance(qc, key));
            // Rows past the end or with no visible key (lse = -inf) get P = 0 exactly. One && chain:
            // as band.visible(qc, key) && (lse test) the hdim-64 loop took 5930 SASS instructions
            // instead of 5591 (sm_90).
            const float lse_q = lse[qc];
            const bool live = band.key_visible(qc, key) && band.query_valid(qc) && lse_q != -INFINITY;
            const float pr = live ? fast_exp2(s2 - lse_q * kLog2e) : 0.0f;
            float dpv = dp[mt][t][e], pdrop = pr;
            if (dropout) {
              const bool kept = (keep[qc * kKeepWords + key / 32] >> (key % 32)) & 1u;
              pdrop = kept ? pr * dropout_rescale : 0.0f;
              dpv = kept ? dpv * dropout_rescale : 0.0f;
            }
            sv = pdrop;
            dp[mt][t][e] = pr * (dpv - d[qc]) * dscore;
          }
        }
  }
};

// dK and dV of the warp's (kKVWarpN keys, kKVWarpD dims) tile, in fp32 registers for the whole
// kernel: the key block's sums over every query tile and every query head of the GQA group (so the
// GQA reduction needs no workspace and no second pass).
template <class T, class Tr>
struct DkDv {
  static constexpr int kKVMT = Tr::kKVWarpN / 16, kKVNT = Tr::kKVWarpD / 8;  // m16 (keys) × n8 (dims)
  float dk[kKVMT][kKVNT][4], dv[kKVMT][kKVNT][4];

  __device__ __forceinline__ DkDv() {
#pragma unroll
    for (int mt = 0; mt < kKVMT; ++mt)
#pragma unroll
      for (int t = 0; t < kKVNT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[mt][t][e] = dv[mt][t][e] = 0.0f;
  }

  // acc += Aᵀ (kKVWarpN keys, 16 queries of step kk) · B (16 queries, kKVWarpD dims), B read by
  // ldmatrix.trans from b_tile (dO for dV, Q for dK).
  __device__ static __forceinline__ void mma_step(float (&acc)[kKVMT][kKVNT][4], int kk,
                                                  const std::uint32_t (&a)[kKVMT][4], std::uint32_t b_tile,
                                                  const BwdWarpTiles<Tr>& w) {
#pragma unroll
    for (int nj = 0; nj < kKVNT / 2; ++nj) {
      std::uint32_t bb[4];
      ldmatrix_x4_trans_at(bb, b_tile + SwizzledOffset<Tr::kHeadDim>::step(w.q_bt, 16 * kk, 2 * nj));
      const std::uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
      for (int mt = 0; mt < kKVMT; ++mt) {
        mma_16816<T>(acc[mt][2 * nj], a[mt], b0);
        mma_16816<T>(acc[mt][2 * nj + 1], a[mt], b1);
      }
    }
  }
  // acc += (Pᵀ or dSᵀ from a_tile) · (dO or Q from b_tile) over the step's kBlockM queries.
  __device__ static __forceinline__ void add(float (&acc)[kKVMT][kKVNT][4], std::uint32_t a_tile,
                                             std::uint32_t b_tile, const BwdWarpTiles<Tr>& w) {
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockM / 16; ++kk) {
      std::uint32_t a[kKVMT][4];
#pragma unroll
      for (int mt = 0; mt < kKVMT; ++mt)
        ldmatrix_x4_at(a[mt], a_tile + SwizzledOffset<Tr::kBlockM>::step(w.s_a, 16 * mt, 2 * kk));
      mma_step(acc, kk, a, b_tile, w);
    }
  }
  __device__ __forceinline__ void add_dv(const BwdSmem<T, Tr>& sm, const BwdStep<T, Tr>& st, const BwdWarpTiles<Tr>& w) {
    add(dv, smem_addr(sm.p), st.dout, w);  // dV += P_dropᵀ dO
  }
  __device__ __forceinline__ void add_dk(const BwdSmem<T, Tr>& sm, const BwdStep<T, Tr>& st, const BwdWarpTiles<Tr>& w) {
    add(dk, smem_addr(sm.ds), st.q, w);  // dK += dSᵀ Q
  }

  // Epilogue: dK = scale · Σ dS q (dS was taken w.r.t. the score scale·q·k), dV as accumulated.
  // Rows past the end of the sequence and padded head-dim columns are not written. The sequence's
  // first key row is read again rather than kept from the start: held across the mainloop it was
  // the one register ptxas spilled (4 bytes) at hdim 256.
  __device__ __forceinline__ void store(const detail::BwdParams& p, const BwdKeyBlock<Tr>& blk,
                                        const BwdWarpTiles<Tr>& w, int lane) const {
    const std::int64_t k_row = detail::seq_info(p, blk.b).k_row0 + blk.kb;
    T* dk_g = static_cast<T*>(p.dk) + detail::offset_of(p.dk_stride, blk.b, k_row, blk.hk);
    T* dv_g = static_cast<T*>(p.dv) + detail::offset_of(p.dv_stride, blk.b, k_row, blk.hk);
#pragma unroll
    for (int mt = 0; mt < kKVMT; ++mt)
#pragma unroll
      for (int t = 0; t < kKVNT; ++t) {
        const int col = w.d0 + t * 8 + 2 * (lane % 4);
        if (col >= p.d) continue;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int key = w.kv0 + 16 * mt + lane / 4 + 8 * h2;
          if (key >= blk.keys_valid) continue;
          *reinterpret_cast<std::uint32_t*>(dk_g + key * p.dk_stride.row + col) =
              pack2<T>(dk[mt][t][2 * h2] * p.scale, dk[mt][t][2 * h2 + 1] * p.scale);
          *reinterpret_cast<std::uint32_t*>(dv_g + key * p.dv_stride.row + col) =
              pack2<T>(dv[mt][t][2 * h2], dv[mt][t][2 * h2 + 1]);
        }
      }
  }
};

// The dQ stage: dQ partial = dS K, (kBlockM, kHeadDim) over the dQ warp grid in passes of kDqPass
// columns, added into the fp32 accumulator of the query tile by one of three policies:
// - reduction (whole tiles, default mode: every row in the sequence, p.d == kHeadDim): a short
//   form compiled apart, red_dq_pair at constant offsets from one address per lane, no bounds
//   tests. The general form wraps each 8-byte reduction in a branch region with 64-bit bounds
//   compares and the deterministic test (SASS: ~10-25 instructions and 2-4 branches each, 16 per
//   warp and step at hdim 64 and 128, 32 at 256). Only with one dQ pass (every head dim now): with
//   two passes at hdim 256 the short form spilled 16-20 bytes on sm_90. Under kDeferDq (hdim 256,
//   sm90) the whole tile is carried in registers and reduced during the next step's Sᵀ products,
//   kDeferRedsPerKk pairs per k step, so that the reductions drain while the tensor pipe works
//   instead of in one burst before the step's closing barrier.
// - atomic (edge tiles): bounds-checked add_dq_pair.
// - deterministic: in key-block order behind the query tile's semaphore (dq_turn, sem_wait), plain
//   loads and stores.
template <class T, class Tr, bool kDeferDq>
struct DqAccumulator {
  static constexpr int kDqMT = Tr::kDqWarpM / 16, kDqNT = Tr::kDqPass / 8;  // pass: m16 (queries) × n8 (dims)
  static constexpr bool kShortAdds = Tr::kDqWarpD == Tr::kDqPass;
  static constexpr int kCarryMT = kDeferDq ? kDqMT : 1, kCarryNT = kDeferDq ? kDqNT : 1;
  // The carried tile, left uninitialised (carry_red runs only while carry_row != 0, which is set
  // together with it). carry_row: this lane's address in it, 0 when none is pending (one register
  // fewer than a separate flag: with the flag ptxas spilled 4 bytes).
  float carry[kCarryMT][kCarryNT][4];
  std::uintptr_t carry_row = 0;

  __device__ __forceinline__ bool pending() const { return kDeferDq && carry_row != 0; }
  // Reduction pair j (of kDqMT·kDqNT·2) of the carried tile.
  __device__ __forceinline__ void carry_red(int j) const {
    const int mt = j / (2 * kCarryNT), t = j / 2 % kCarryNT, h2 = j % 2;
    float* r = reinterpret_cast<float*>(carry_row + 4 * ((16 * mt + 8 * h2) * Tr::kHeadDim + t * 8));
    red_dq_pair(r, carry[mt][t][2 * h2], carry[mt][t][2 * h2 + 1]);
  }
  // The carried reductions of k step kk of the Sᵀ products.
  __device__ __forceinline__ void carry_step(int kk) const {
#pragma unroll
    for (int j = kk * Tr::kDeferRedsPerKk; j < (kk + 1) * Tr::kDeferRedsPerKk; ++j)
      if (j < kDqMT * kDqNT * 2) carry_red(j);
  }
  __device__ __forceinline__ void flush() const {
    if (pending()) {
#pragma unroll
      for (int j = 0; j < kDqMT * kDqNT * 2; ++j) carry_red(j);
    }
  }

  // acc_dq (kDqWarpM, kDqPass) of pass `pass` into the accumulator rows from acc_row.
  template <bool kWhole>
  __device__ __forceinline__ static void add(const float (&acc_dq)[kDqMT][kDqNT][4], float* acc_row, int pass,
                                             const detail::BwdParams& p, const BwdKeyBlock<Tr>& blk,
                                             const BwdStep<T, Tr>& st, int row, const BwdWarpTiles<Tr>& w,
                                             int lane) {
#pragma unroll
    for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
      for (int t = 0; t < kDqNT; ++t) {
        if constexpr (kWhole) {
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2)
            red_dq_pair(acc_row + w.dq_d0 + 2 * (lane % 4) + (16 * mt + 8 * h2) * Tr::kHeadDim + pass * Tr::kDqPass +
                            t * 8,
                        acc_dq[mt][t][2 * h2], acc_dq[mt][t][2 * h2 + 1]);
        } else {
          const int col = w.dq_d0 + pass * Tr::kDqPass + t * 8 + 2 * (lane % 4);
          if (col >= p.d) continue;
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            if (st.r0 + row + 16 * mt + 8 * h2 >= blk.si.len_q) continue;
            float* r = acc_row + (16 * mt + 8 * h2) * p.d + col;
            const float x = acc_dq[mt][t][2 * h2], y = acc_dq[mt][t][2 * h2 + 1];
            if (p.deterministic) {
              __stcg(r, __ldcg(r) + x);
              __stcg(r + 1, __ldcg(r + 1) + y);
            } else {
              add_dq_pair(r, x, y);
            }
          }
        }
      }
  }

  // The step's dQ partial dS K into the accumulator (dSᵀ of the step in shared memory).
  __device__ __forceinline__ void accumulate(const detail::BwdParams& p, const BwdKeyBlock<Tr>& blk,
                                             const BwdStep<T, Tr>& st, const BwdSmem<T, Tr>& sm,
                                             const BwdWarpTiles<Tr>& w, float* dq_acc, int* sem, int tid,
                                             int kernel_lane) {
    constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
    // Under kDeferDq the lane id is read again (S2R) instead of taken from the kernel: the lane's dQ
    // column, held across the step next to the carried tile, was the one register ptxas spilled
    // (4 bytes, hdim 256, sm_90). Elsewhere the re-read costs the spill (sm_80, hdim 256).
    const int lane = kDeferDq ? lane_id() : kernel_lane;
    int* tile_sem = nullptr;
    int turn = 0;  // how many key blocks added to this query tile before this one
    if (p.deterministic) {
      const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
      tile_sem = sem + (static_cast<std::int64_t>(blk.b) * p.h + st.head) * m_blocks + st.m_block;
      turn = dq_turn<kBlockN>(blk.band, blk.n_block, st.r0, blk.si.len_k);
      if (tid == 0) sem_wait(tile_sem, turn);
      __syncthreads();
    }
    const bool whole = !p.deterministic && p.d == Tr::kHeadDim && st.r0 + kBlockM <= blk.si.len_q;
    const std::uint32_t ds_tile = smem_addr(sm.ds), k_tile = smem_addr(sm.k);
#pragma unroll
    for (int pass = 0; pass < Tr::kDqWarpD / Tr::kDqPass; ++pass) {
      float acc_dq[kDqMT][kDqNT][4];  // (kDqWarpM, kDqPass) per warp
#pragma unroll
      for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
        for (int t = 0; t < kDqNT; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[mt][t][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        std::uint32_t a[kDqMT][4];
#pragma unroll
        for (int mt = 0; mt < kDqMT; ++mt)
          ldmatrix_x4_trans_at(a[mt], ds_tile + SwizzledOffset<kBlockM>::step(w.ds_at, 16 * kk, 2 * mt));
#pragma unroll
        for (int nj = 0; nj < kDqNT / 2; ++nj) {
          std::uint32_t bk[4];
          ldmatrix_x4_trans_at(
              bk, k_tile + SwizzledOffset<Tr::kHeadDim>::step(w.k_bt, 16 * kk, pass * Tr::kDqPass / 8 + 2 * nj));
          const std::uint32_t bk0[2] = {bk[0], bk[1]}, bk1[2] = {bk[2], bk[3]};
#pragma unroll
          for (int mt = 0; mt < kDqMT; ++mt) {
            mma_16816<T>(acc_dq[mt][2 * nj], a[mt], bk0);
            mma_16816<T>(acc_dq[mt][2 * nj + 1], a[mt], bk1);
          }
        }
      }
      // The accumulator rows of this lane, after the products: computed before them, the 64-bit
      // address stayed live through them and spilled 4 bytes at hdim 256.
      const int row = w.dq_m0 + lane / 4;  // of m tile 0 half 0; + 16·mt + 8·half
      float* acc_row =
          dq_acc + (static_cast<std::int64_t>(st.head) * p.total_q + blk.si.global_q_row0 + st.r0 + row) * p.d;
      if constexpr (kDeferDq) {
        static_assert(kShortAdds, "the carried tile is one whole dQ pass");
        carry_row = whole ? reinterpret_cast<std::uintptr_t>(acc_row + w.dq_d0 + 2 * (lane % 4)) : 0;
        if (whole) {
#pragma unroll
          for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
            for (int t = 0; t < kDqNT; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) carry[mt][t][e] = acc_dq[mt][t][e];
        } else {
          add<false>(acc_dq, acc_row, pass, p, blk, st, row, w, lane);
          // Defined on every path, so that the carried registers are dead from the reductions in
          // the Sᵀ products to here (left as they were, they stayed live through the whole step
          // on this path: 236 bytes of spills).
#pragma unroll
          for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
            for (int t = 0; t < kDqNT; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) carry[mt][t][e] = 0.0f;
        }
      } else if constexpr (kShortAdds) {
        if (whole) add<true>(acc_dq, acc_row, pass, p, blk, st, row, w, lane);
        else add<false>(acc_dq, acc_row, pass, p, blk, st, row, w, lane);
      } else {
        add<false>(acc_dq, acc_row, pass, p, blk, st, row, w, lane);
      }
    }
    if (p.deterministic) {
      __threadfence();
      __syncthreads();
      if (tid == 0) sem_release(tile_sem, turn + 1);
    }
  }
};

// Sᵀ, then per dPᵀ pass its products, score gradient and the stores of P_dropᵀ and dSᵀ for the
// warps of the other two grids. kPlain: see ScoreGrad. Compiled twice, short and full form, and
// picked per tile before the dPᵀ products: a branch between a pass's products and its elementwise
// code splits them into basic blocks that ptxas schedules apart (in the forward that cost 7-10 %,
// NOTES v3), so one pass's exp2 could not overlap the last MMAs of its dPᵀ or the next pass's.
// One product at a time keeps only its fragments live next to the accumulators and dK, dV (whole
// 32 × 32 dPᵀ at hdim 128: 32 bytes of spills).
template <bool kPlain, class T, class Tr, int kSMT, int kSNT>
__device__ __forceinline__ void score_passes(float (&s)[kSMT][kSNT][4], const detail::BwdParams& p,
                                             const BwdKeyBlock<Tr>& blk, const BwdStep<T, Tr>& st,
                                             const BwdSmem<T, Tr>& sm, const BwdWarpTiles<Tr>& w, int lane) {
  using SwM = SwizzledOffset<Tr::kBlockM>;
  const ScoreGrad<Tr> grad(p, blk, st, w, sm.keep, lane);
  const std::uint32_t ds_tile = smem_addr(sm.ds), p_tile = smem_addr(sm.p);
  constexpr int kDpNT = kSNT / Tr::kDpPasses;  // n8 tiles of dPᵀ per pass
#pragma unroll
  for (int pass = 0; pass < Tr::kDpPasses; ++pass) {
    const int t0 = pass * kDpNT;
    float dp[kSMT][kDpNT][4];
#pragma unroll
    for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
      for (int t = 0; t < kDpNT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dp[mt][t][e] = 0.0f;
          if constexpr (Tr::kFuseSdP) s[mt][t0 + t][e] = 0.0f;
        }
    if constexpr (Tr::kFuseSdP) gemm_st_dpt(s, dp, sm, st, w, t0);
    else gemm_st<T, Tr>(dp, smem_addr(sm.v), st.dout, w, t0, [](int) {});

    grad.template operator()<kPlain>(s, dp, t0);

#pragma unroll
    for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
      for (int t = 0; t < kDpNT; ++t)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const std::uint32_t off = SwM::step(w.s_st, 16 * mt + 8 * h2, t0 + t);
          st_shared_b32(ds_tile + off, pack2<T>(dp[mt][t][2 * h2], dp[mt][t][2 * h2 + 1]));
          st_shared_b32(p_tile + off, pack2<T>(s[mt][t0 + t][2 * h2], s[mt][t0 + t][2 * h2 + 1]));
        }
  }
}

template <class T, class Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    bwd_main(const detail::BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_acc, int* __restrict__ sem) {
  constexpr int kSMT = Tr::kSWarpN / 16, kSNT = Tr::kSWarpM / 8;  // Sᵀ: m16 (keys) × n8 (queries) tiles
  constexpr int stages = Tr::kStages;
  // kDeferDq on sm90 only: on sm80 (not timed here) ptxas spilled 4 bytes at hdim 256.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kDeferDq = Tr::kDeferDq;
#else
  constexpr bool kDeferDq = false;
#endif

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const BwdSmem<T, Tr> sm(smem_raw);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const BwdKeyBlock<Tr> blk(p);
  if (blk.empty()) return;

  load_key_block(p, blk, sm);
  const BwdWarpTiles<Tr> w(warp, lane);
  DkDv<T, Tr> dkdv;
  if (blk.n_iter > 0) load_query_tile(p, blk, sm, dsum, 0, 0, tid);
  else cp_async_commit();
  DqAccumulator<T, Tr, kDeferDq> dq;

  for (int it = 0; it < blk.n_iter; ++it) {
    const int stage = stages == 1 ? 0 : it % 2;
    cp_async_wait<0>();
    __syncthreads();  // Q, dO of this step landed; every warp is done with the last step's Pᵀ, dSᵀ
    if (stages == 2 && it + 1 < blk.n_iter) load_query_tile(p, blk, sm, dsum, it + 1, (it + 1) % 2, tid);
    const BwdStep<T, Tr> st(blk, sm, it, stage);

    if (p.dropout_p > 0.0f) {
      dropout_keep_tile(p, st.head, blk.si, st.r0, Tr::kBlockM, blk.kb, Tr::kBlockN / 32, sm.keep, tid, Tr::kNThreads);
      __syncthreads();
    }

    const bool need_mask =
        blk.band.tile_needs_mask(st.r0, st.r0 + Tr::kBlockM, blk.kb, blk.kb + Tr::kBlockN, blk.si.len_k);
    const bool plain = !need_mask && st.r0 + Tr::kBlockM <= blk.si.len_q && !(p.softcap > 0.0f) &&
                       !(p.dropout_p > 0.0f) && p.alibi == nullptr;
    // Sᵀ = K Qᵀ (kSWarpN, kSWarpM) whole, then the dPᵀ passes (score_passes); under kFuseSdP each
    // pass computes its Sᵀ columns together with its dPᵀ instead.
    float s[kSMT][kSNT][4];
    if constexpr (!Tr::kFuseSdP) {
#pragma unroll
      for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
        for (int t = 0; t < kSNT; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][t][e] = 0.0f;
      // Two copies, with and without the carried reductions, each one basic block: reductions
      // under a predicate made ptxas branch around each of them, one block per k step.
      if (dq.pending()) gemm_st<T, Tr>(s, smem_addr(sm.k), st.q, w, 0, [&](int kk) { dq.carry_step(kk); });
      else gemm_st<T, Tr>(s, smem_addr(sm.k), st.q, w, 0, [](int) {});
    }
    if (plain) score_passes<true>(s, p, blk, st, sm, w, lane);
    else score_passes<false>(s, p, blk, st, sm, w, lane);
    __syncthreads();  // Pᵀ, dSᵀ complete

    dkdv.add_dv(sm, st, w);
    // Order after dV: with two stages dQ comes before dK, as FlashAttention-2 orders them, so that
    // the dK products overlap the dQ reductions in flight instead of the next step's barrier
    // waiting on them. With one stage dK comes first, so that Q and dO are free and the next
    // step's copy overlaps dQ.
    if constexpr (stages == 1) {
      dkdv.add_dk(sm, st, w);
      __syncthreads();
      if (it + 1 < blk.n_iter) load_query_tile(p, blk, sm, dsum, it + 1, 0, tid);
      dq.accumulate(p, blk, st, sm, w, dq_acc, sem, tid, lane);
    } else {
      dq.accumulate(p, blk, st, sm, w, dq_acc, sem, tid, lane);
      dkdv.add_dk(sm, st, w);
    }
  }
  cp_async_wait<0>();  // a block with no query rows still has K, V in flight
  dq.flush();
  dkdv.store(p, blk, w, lane);
}

}  // namespace flashmonoid::cuda::bwd
