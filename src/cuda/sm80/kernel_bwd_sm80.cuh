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
#include "sm80/mma_sm80.cuh"
#include "flashmonoid/detail/mask.hpp"
#include "flashmonoid/detail/philox.hpp"
#include "sm80/bwd_sm80.hpp"

namespace flashmonoid::cuda::bwd {

inline constexpr float kLog2e = 1.4426950408889634f;

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

// Element offset of (row, col) in a row-major (rows, kCols) b16 tile whose 16-byte chunks are
// XOR-swizzled by row (mma_sm80.cuh), so that ldmatrix's 8 row addresses hit 8 bank groups.
template <int kCols>
__device__ __forceinline__ int tile_off(int row, int col) {
  return row * kCols + swizzle_chunk(row, col >> 3) * 8 + (col & 7);
}

// Async copy of a (kRows, kCols) tile whose row r starts at gmem + r·row_stride; rows >= rows_valid
// and columns >= cols_valid (a multiple of 8) are zero-filled. Each thread copies the same chunk
// column of rows tid / kChunks + k · kRowStep, so its swizzle is the same for all of them and only
// one shared and one global address are live per tile (per-chunk addresses cost ~50 registers
// at hdim 256 when the compiler hoisted them out of the mainloop). The global address advances
// by one 64-bit add per copy and the shared one by an immediate: the per-copy products and
// separate row and column tests took ~16 SASS instructions per cp.async (hdim 256: 262 for the 16
// Q/dO copies of a step, now 203).
template <int kRows, int kCols, int kNThreads, class T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, std::int64_t row_stride, int rows_valid,
                                                int cols_valid, int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = kNThreads / kChunks;
  static_assert(kNThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0,
                "tile must split evenly over the threads, 8-row aligned for the swizzle");
  const int r = tid / kChunks, c = (tid % kChunks) * 8;
  const std::uint32_t dst = smem_addr(smem + tile_off<kCols>(r, c));
  const T* src = gmem + r * row_stride + c;
  const std::int64_t step = kRowStep * row_stride;
  const int rows_left = c < cols_valid ? rows_valid - r : 0;  // copy k is in the tile iff k·kRowStep < rows_left
#pragma unroll
  for (int k = 0; k < kRows / kRowStep; ++k) {
    const bool pred = k * kRowStep < rows_left;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + k * kRowStep * kCols * 2),
                 "l"(pred ? src : gmem), "r"(pred ? 16 : 0));
    src += step;
  }
}

// Shared-memory addressing of a swizzled (rows, kCols) b16 tile in bytes of the shared window.
// A lane's ldmatrix row address is computed once per operand (lane_offset); the per-step offset
// of a fragment (dr rows, dc chunks further) is then an XOR and an add of constants, instead of a
// fresh swizzle per address: with the whole mainloop unrolled, per-address swizzles kept ~100
// addresses live and spilled at hdim 128 (ptxas, 255 registers, 160 bytes of stack).
template <int kCols>
struct Swizzled {
  static constexpr int kRowBytes = kCols * 2;  // a multiple of 128, so bits 4-6 are the chunk
  __device__ static __forceinline__ std::uint32_t lane_offset(int row, int chunk) {
    return row * kRowBytes + (chunk & ~7) * 16 + (((chunk ^ row) & 7) << 4);
  }
  // Offset of (row + dr, chunk + dc) from lane_offset(row, chunk): dr a multiple of 8 and the low
  // three bits of dc disjoint from those of chunk, so adding dc to the chunk is an XOR.
  __device__ static __forceinline__ std::uint32_t step(std::uint32_t off, int dr, int dc) {
    return (off ^ ((dc & 7) << 4)) + dr * kRowBytes + (dc & ~7) * 16;
  }
};

// Lane row/chunk of the four 8x8 matrices of one ldmatrix.x4, per operand shape:
//   A (16x16 rows x k) from a (row, k) tile:         (rows 0-7, k 0-7) (8-15, 0-7) (0-7, 8-15) (8-15, 8-15)
//   B (two n8 tiles x k16) from an (n, k) tile:      regs {0,1} n 0-7, {2,3} n 8-15
//   B via .trans from a (k, n) tile, and A via .trans from a (k, m) tile.
__device__ __forceinline__ int a_row(int lane) { return (lane & 7) + 8 * ((lane >> 3) & 1); }
__device__ __forceinline__ int a_chunk(int lane) { return lane >> 4; }
__device__ __forceinline__ int b_row(int lane) { return (lane & 7) + 8 * (lane >> 4); }
__device__ __forceinline__ int b_chunk(int lane) { return (lane >> 3) & 1; }
__device__ __forceinline__ int bt_row(int lane) { return a_row(lane); }
__device__ __forceinline__ int bt_chunk(int lane) { return a_chunk(lane); }
__device__ __forceinline__ int at_row(int lane) { return b_row(lane); }
__device__ __forceinline__ int at_chunk(int lane) { return b_chunk(lane); }

__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// 4-byte global -> shared copy, zero-filled when !pred (cp.async.cg only takes 16 bytes).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void sts_b32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}

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
// 2. The main kernel.

// Deterministic dQ: the key blocks that see query tile m form a contiguous range [n_first, ..)
// (a band mask's visible keys per row are an interval that moves right by one per row), and each
// adds its dQ partial only after the previous one has: sem counts the additions done. Key block n
// waits for blocks < n of the same (batch, head), which the hardware launched before it
// (lower linear block index), so the wait cannot deadlock.
__device__ __forceinline__ void sem_wait(const int* sem, int value) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
  } while (seen != value);
}
__device__ __forceinline__ void sem_release(int* sem, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(sem), "r"(value) : "memory");
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

// 2^x on the MUFU unit (ex2.approx.ftz: 2 ulp, exp2(-inf) = +0), without exp2f's range handling.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <class T, class Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    bwd_main(const detail::BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_acc, int* __restrict__ sem) {
  constexpr int kHeadDim = Tr::kHeadDim, kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr int kSMT = Tr::kSWarpN / 16, kSNT = Tr::kSWarpM / 8;     // Sᵀ: m16 (keys) × n8 (queries) tiles
  constexpr int kKVMT = Tr::kKVWarpN / 16, kKVNT = Tr::kKVWarpD / 8;  // dK, dV: m16 (keys) × n8 (dims)
  constexpr int kDqMT = Tr::kDqWarpM / 16, kDqNT = Tr::kDqPass / 8;   // dQ pass: m16 (queries) × n8 (dims)
  constexpr int kKeepWords = kBlockN / 32;  // dropout keep bits per query row, 32 keys a word
  using SwD = Swizzled<kHeadDim>;  // K, V, Q, dO tiles
  using SwM = Swizzled<kBlockM>;   // dSᵀ, Pᵀ tiles

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);   // (kBlockN, kHeadDim)
  T* sV = sK + Tr::kKVElems;                 // (kBlockN, kHeadDim)
  T* sdS = sV + Tr::kKVElems;                // (kBlockN, kBlockM) dSᵀ
  T* sP = sdS + Tr::kSElems;                 // (kBlockN, kBlockM) P_dropᵀ
  float* sLse = reinterpret_cast<float*>(sP + Tr::kSElems);                              // kStages × (kBlockM)
  float* sD = sLse + Tr::kStages * kBlockM;                                              // kStages × (kBlockM)
  std::uint32_t* sKeep = reinterpret_cast<std::uint32_t*>(sD + Tr::kStages * kBlockM);  // (kBlockM, kKeepWords)
  T* sQ = reinterpret_cast<T*>(smem_raw + Tr::kFixedSmemBytes);  // stage s: sQ + s · 2 kQElems, (kBlockM, kHeadDim)
  T* sdO = sQ + Tr::kQElems;                                      // stage s: sdO + s · 2 kQElems, (kBlockM, kHeadDim)
  constexpr int stages = Tr::kStages;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n_block = blockIdx.x;
  const int b = blockIdx.y / p.h_k, hk = blockIdx.y % p.h_k;
  const int group = p.h / p.h_k;  // query heads per KV head (FwdParams::group() is host-only)
  const detail::SeqInfo si = detail::seq_info(p, b);
  const std::int64_t kb = static_cast<std::int64_t>(n_block) * kBlockN;
  if (kb >= si.len_k) return;
  const detail::Band band = detail::band_of(p, si);
  const int keys_valid = static_cast<int>(si.len_k - kb < kBlockN ? si.len_k - kb : kBlockN);

  // Query rows that see at least one key of [kb, kb + keys_valid): row i sees
  // [i + diag - left, i + diag + right].
  std::int64_t row_lo = band.right < 0 ? 0 : kb - band.diag - band.right;
  std::int64_t row_hi = band.left < 0 ? si.len_q : kb + keys_valid - band.diag + band.left;
  row_lo = row_lo < 0 ? 0 : row_lo;
  row_hi = row_hi > si.len_q ? si.len_q : row_hi;
  const int m_lo = static_cast<int>(row_lo / kBlockM);
  const int m_hi = row_hi > row_lo ? static_cast<int>((row_hi + kBlockM - 1) / kBlockM) : m_lo;
  const int n_m = m_hi - m_lo;
  const int n_iter = n_m * group;  // (query head of the group, query block) pairs, head-major

  const T* k_g = static_cast<const T*>(p.k) + detail::offset_of(p.k_stride, b, si.k_row0 + kb, hk);
  const T* v_g = static_cast<const T*>(p.v) + detail::offset_of(p.v_stride, b, si.k_row0 + kb, hk);
  load_tile_async<kBlockN, kHeadDim, Tr::kNThreads>(sK, k_g, p.k_stride.row, keys_valid, p.d, tid);
  load_tile_async<kBlockN, kHeadDim, Tr::kNThreads>(sV, v_g, p.v_stride.row, keys_valid, p.d, tid);

  // Issue the loads of iteration it into stage `stage`: Q, dO, lse and D, all asynchronously (plain
  // loads of lse and D stalled warps 0-1 for a global round trip every iteration).
  // Query blocks are visited last to first. Under a causal mask every key block sees the last
  // query block, so in deterministic mode all key blocks start on the same tile and pass it on
  // in key-block order one dQ addition apart; visited first to last, key block n would wait for
  // n iterations of its predecessors before its first addition (measured 24 TFLOP/s causal vs
  // 48 non-causal at hdim 128, 16k).
  auto m_of = [&](int it) { return m_hi - 1 - it % n_m; };
  auto load_q_block = [&](int it, int stage) {
    const int head = hk * group + it / n_m;
    const std::int64_t r0 = static_cast<std::int64_t>(m_of(it)) * kBlockM;
    const int rows_valid = static_cast<int>(si.len_q - r0 < kBlockM ? si.len_q - r0 : kBlockM);
    const T* q_g = static_cast<const T*>(p.q) + detail::offset_of(p.q_stride, b, si.q_row0 + r0, head);
    const T* do_g = static_cast<const T*>(p.dout) + detail::offset_of(p.do_stride, b, si.q_row0 + r0, head);
    load_tile_async<kBlockM, kHeadDim, Tr::kNThreads>(sQ + stage * 2 * Tr::kQElems, q_g, p.q_stride.row, rows_valid, p.d, tid);
    load_tile_async<kBlockM, kHeadDim, Tr::kNThreads>(sdO + stage * 2 * Tr::kQElems, do_g, p.do_stride.row, rows_valid, p.d, tid);
    if (tid < kBlockM) {
      const bool ok = tid < rows_valid;
      const std::int64_t idx = ok ? detail::lse_index(p, b, head, si, r0 + tid) : 0;
      cp_async_4(sLse + stage * kBlockM + tid, p.lse + idx, ok);
      cp_async_4(sD + stage * kBlockM + tid, dsum + idx, ok);
    }
    cp_async_commit();
  };

  // Warp tiles of the three grids (see BwdTraits) and per-lane shared-memory offsets of every
  // operand (see Swizzled).
  const int key0 = (warp % Tr::kSWarpsN) * Tr::kSWarpN;  // Sᵀ tile: keys key0.., queries q0..
  const int q0 = (warp / Tr::kSWarpsN) * Tr::kSWarpM;
  const int kv0 = (warp % Tr::kKVWarpsN) * Tr::kKVWarpN;  // dK, dV tile: keys kv0.., dims d0..
  const int d0 = (warp / Tr::kKVWarpsN) * Tr::kKVWarpD;
  const int dq_m0 = (warp % Tr::kDqWarpsM) * Tr::kDqWarpM;  // dQ tile: queries dq_m0.., dims dq_d0..
  const int dq_d0 = (warp / Tr::kDqWarpsM) * Tr::kDqWarpD;
  const std::uint32_t sK_a = smem_addr(sK), sV_a = smem_addr(sV), sQ_a = smem_addr(sQ), sdO_a = smem_addr(sdO);
  const std::uint32_t sdS_a = smem_addr(sdS), sP_a = smem_addr(sP);
  const std::uint32_t off_kv_a = SwD::lane_offset(key0 + a_row(lane), a_chunk(lane));           // K, V as A
  const std::uint32_t off_q_b = SwD::lane_offset(q0 + b_row(lane), b_chunk(lane));              // Q, dO as B
  const std::uint32_t off_q_bt = SwD::lane_offset(bt_row(lane), d0 / 8 + bt_chunk(lane));       // Q, dO as Bᵀ
  const std::uint32_t off_s_a = SwM::lane_offset(kv0 + a_row(lane), a_chunk(lane));             // Pᵀ, dSᵀ as A
  const std::uint32_t off_s_st = SwM::lane_offset(key0 + lane / 4, q0 / 8) + 4 * (lane % 4);    // Sᵀ fragment stores
  const std::uint32_t off_ds_at = SwM::lane_offset(at_row(lane), dq_m0 / 8 + at_chunk(lane));   // dSᵀ as Aᵀ
  const std::uint32_t off_k_bt = SwD::lane_offset(bt_row(lane), dq_d0 / 8 + bt_chunk(lane));    // K as Bᵀ

  float acc_dk[kKVMT][kKVNT][4], acc_dv[kKVMT][kKVNT][4];  // (kKVWarpN, kKVWarpD) per warp
#pragma unroll
  for (int mt = 0; mt < kKVMT; ++mt)
#pragma unroll
    for (int t = 0; t < kKVNT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[mt][t][e] = acc_dv[mt][t][e] = 0.0f;

  if (n_iter > 0) load_q_block(0, 0);
  else cp_async_commit();

  const bool has_softcap = p.softcap > 0.0f;
  const bool has_dropout = p.dropout_p > 0.0f;
  const float softcap_inv_scale = has_softcap ? p.scale / p.softcap : 0.0f;
  const float softcap_log2 = p.softcap * kLog2e;

  // kDeferDq on sm90 only: on sm80 (not timed here) ptxas spilled 4 bytes at hdim 256.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kDeferDq = Tr::kDeferDq;
#else
  constexpr bool kDeferDq = false;
#endif
  // kDeferDq: a whole tile's dQ partial (kDqWarpM, kDqWarpD) is kept in registers and reduced
  // into the accumulator during the next step's Sᵀ products (kDeferRedsPerKk pairs per k step),
  // so that the reductions drain while the tensor pipe works instead of in one burst before the
  // step's closing barrier. dq_carry_row: this lane's address in the carried tile, 0 when none
  // is pending (one register fewer than a separate flag: with the flag ptxas spilled 4 bytes).
  constexpr int kCarryMT = kDeferDq ? kDqMT : 1, kCarryNT = kDeferDq ? kDqNT : 1;
  // (nvcc's front end warns that dq_carry may be read before it is set: carry_red runs only while
  // dq_carry_row != 0, which is set together with dq_carry. Left uninitialised so the registers
  // stay as measured.)
  float dq_carry[kCarryMT][kCarryNT][4];
  std::uintptr_t dq_carry_row = 0;
  // Reduction pair j (of kDqMT·kDqNT·2) of the carried tile.
  auto carry_red = [&](int j) {
    const int mt = j / (2 * kCarryNT), t = j / 2 % kCarryNT, h2 = j % 2;
    float* r = reinterpret_cast<float*>(dq_carry_row + 4 * ((16 * mt + 8 * h2) * kHeadDim + t * 8));
    red_dq_pair(r, dq_carry[mt][t][2 * h2], dq_carry[mt][t][2 * h2 + 1]);
  };

  for (int it = 0; it < n_iter; ++it) {
    const int stage = stages == 1 ? 0 : it % 2;
    cp_async_wait<0>();
    __syncthreads();  // Q, dO of this step landed; every warp is done with the last step's Pᵀ, dSᵀ
    if (stages == 2 && it + 1 < n_iter) load_q_block(it + 1, (it + 1) % 2);

    const std::uint32_t q_a = sQ_a + stage * 2 * Tr::kQElems * 2, do_a = sdO_a + stage * 2 * Tr::kQElems * 2;
    const float* lse_s = sLse + stage * kBlockM;
    const float* d_s = sD + stage * kBlockM;
    const int head = hk * group + it / n_m;
    const int m_block = m_of(it);
    const std::int64_t r0 = static_cast<std::int64_t>(m_block) * kBlockM;

    // Dropout keep bits of the (kBlockM, kBlockN) tile, one Philox call per 4 keys (its 4 words)
    // rather than one per element as a per-fragment evaluation would need (a lane's fragment
    // holds keys 8 apart).
    if (has_dropout) {
#pragma unroll 1
      for (int word = tid; word < kBlockM * kKeepWords; word += Tr::kNThreads) {  // 512 words at hdim 64
        const int qr = word / kKeepWords, w = word % kKeepWords;
        std::uint32_t bits = 0;
        if (r0 + qr < si.len_q) {
          const std::uint32_t row_id = detail::dropout_row_id(p, head, si, r0 + qr);
          const std::uint32_t group0 = static_cast<std::uint32_t>((kb + 32 * w) / 4);
#pragma unroll 1
          for (int g = 0; g < 8; ++g) {
            const detail::Philox4 r = detail::dropout_words(p.seed, p.offset, row_id, group0 + g);
#pragma unroll
            for (int c = 0; c < 4; ++c) bits |= static_cast<std::uint32_t>(r.x[c] >= p.dropout_threshold) << (4 * g + c);
          }
        }
        sKeep[qr * kKeepWords + w] = bits;
      }
      __syncthreads();
    }

    // dV += P_dropᵀ dO (mma_dv) and dK += dSᵀ Q (mma_dk) over 16 query rows (step kk) for the
    // warp's (kKVWarpN, kKVWarpD) tile, A operands given.
    auto mma_dv = [&](int kk, const std::uint32_t(&ap)[kKVMT][4]) {
#pragma unroll
      for (int nj = 0; nj < kKVNT / 2; ++nj) {
        std::uint32_t bo[4];
        ldsm_x4_t(bo, do_a + SwD::step(off_q_bt, 16 * kk, 2 * nj));
        const std::uint32_t bo0[2] = {bo[0], bo[1]}, bo1[2] = {bo[2], bo[3]};
#pragma unroll
        for (int mt = 0; mt < kKVMT; ++mt) {
          mma_16816<T>(acc_dv[mt][2 * nj], ap[mt], bo0);
          mma_16816<T>(acc_dv[mt][2 * nj + 1], ap[mt], bo1);
        }
      }
    };
    auto mma_dk = [&](int kk, const std::uint32_t(&ads)[kKVMT][4]) {
#pragma unroll
      for (int nj = 0; nj < kKVNT / 2; ++nj) {
        std::uint32_t bq[4];
        ldsm_x4_t(bq, q_a + SwD::step(off_q_bt, 16 * kk, 2 * nj));
        const std::uint32_t bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
#pragma unroll
        for (int mt = 0; mt < kKVMT; ++mt) {
          mma_16816<T>(acc_dk[mt][2 * nj], ads[mt], bq0);
          mma_16816<T>(acc_dk[mt][2 * nj + 1], ads[mt], bq1);
        }
      }
    };

    // acc (kSWarpN, kNT·8) += A (kSWarpN, kHeadDim) · B (kHeadDim, query columns from 8·t0).
    auto gemm_s = [&](auto& acc, std::uint32_t a_base, std::uint32_t b_base, int t0, auto&& per_kk) {
      constexpr int kNT = sizeof(acc[0]) / sizeof(acc[0][0]);
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        per_kk(kk);
        std::uint32_t a[kSMT][4];
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) ldsm_x4(a[mt], a_base + SwD::step(off_kv_a, 16 * mt, 2 * kk));
#pragma unroll
        for (int nj = 0; nj < kNT / 2; ++nj) {
          std::uint32_t bb[4];
          ldsm_x4(bb, b_base + SwD::step(off_q_b, 8 * t0 + 16 * nj, 2 * kk));
          const std::uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
            mma_16816<T>(acc[mt][2 * nj], a[mt], b0);
            mma_16816<T>(acc[mt][2 * nj + 1], a[mt], b1);
          }
        }
      }
    };

    // P = exp2(s·scale·log2 e − lse·log2 e), dropout, dS = P ∘ (dP_drop − D) (∘ (1 − tanh²) under
    // softcap). Afterwards s holds P_drop and dp holds dS, both (key, query) transposed. A tile
    // with no mask, softcap, ALiBi or dropout and all its query rows in the sequence (every tile
    // but the diagonal and the edges at 16k) takes the short form: one FFMA and one MUFU per P.
    const bool need_mask = band.tile_needs_mask(r0, r0 + kBlockM, kb, kb + kBlockN, si.len_k);
    const bool plain = !need_mask && r0 + kBlockM <= si.len_q && !has_softcap && !has_dropout && p.alibi == nullptr;
    // Sᵀ = K Qᵀ (kSWarpN, kSWarpM), then dPᵀ = V dOᵀ in kDpPasses column passes, each followed by
    // its P, dS and their stores: one product at a time keeps only its fragments live next to
    // the accumulators and dK, dV (whole 32 × 32 dPᵀ at hdim 128: 32 bytes of spills). Under
    // kFuseSdP each pass computes its Sᵀ columns together with its dPᵀ (gemm_sdp) instead.
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
      if (kDeferDq && dq_carry_row != 0) {
        gemm_s(s, sK_a, q_a, 0, [&](int kk) {
#pragma unroll
          for (int j = kk * Tr::kDeferRedsPerKk; j < (kk + 1) * Tr::kDeferRedsPerKk; ++j)
            if (j < kDqMT * kDqNT * 2) carry_red(j);
        });
      } else {
        gemm_s(s, sK_a, q_a, 0, [](int) {});
      }
    }
    // Fused form: Sᵀ columns 8·t0.. (kNT n8 tiles, into s[.][t0..]) and dPᵀ (dp[.][0..]) in one k
    // loop over K, Qᵀ, V, dOᵀ fragments.
    auto gemm_sdp = [&](auto& acc_dp, int t0) {
      constexpr int kNT = sizeof(acc_dp[0]) / sizeof(acc_dp[0][0]);
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        std::uint32_t ak[kSMT][4], av[kSMT][4];
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) {
          ldsm_x4(ak[mt], sK_a + SwD::step(off_kv_a, 16 * mt, 2 * kk));
          ldsm_x4(av[mt], sV_a + SwD::step(off_kv_a, 16 * mt, 2 * kk));
        }
#pragma unroll
        for (int nj = 0; nj < kNT / 2; ++nj) {
          std::uint32_t bq[4], bd[4];
          ldsm_x4(bq, q_a + SwD::step(off_q_b, 8 * t0 + 16 * nj, 2 * kk));
          ldsm_x4(bd, do_a + SwD::step(off_q_b, 8 * t0 + 16 * nj, 2 * kk));
          const std::uint32_t bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
          const std::uint32_t bd0[2] = {bd[0], bd[1]}, bd1[2] = {bd[2], bd[3]};
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
            mma_16816<T>(s[mt][t0 + 2 * nj], ak[mt], bq0);
            mma_16816<T>(acc_dp[mt][2 * nj], av[mt], bd0);
            mma_16816<T>(s[mt][t0 + 2 * nj + 1], ak[mt], bq1);
            mma_16816<T>(acc_dp[mt][2 * nj + 1], av[mt], bd1);
          }
        }
      }
    };

    // The dPᵀ passes are compiled twice, short and full form, and picked per tile before their
    // products: a branch between a pass's products and its elementwise code splits them into
    // basic blocks that ptxas schedules apart (in the forward that cost 7-10 %, NOTES v3), so one
    // pass's exp2 could not overlap the last MMAs of its dPᵀ or the next pass's.
    auto scores = [&](auto plain_tag) {
      constexpr bool kPlain = decltype(plain_tag)::value;
      // Per-tile 32-bit forms of the band test and the ALiBi distance: for key `key` and query
      // column qc of this tile, i + diag - j = qc - key + tile_diag. The 64-bit per-element
      // indices they replace cost ptxas 64 bytes of spills at hdim 128.
      const float slope = detail::alibi_slope(p, b, head);
      const std::int64_t tile_diag64 = r0 + band.diag - kb;
      auto clamp32 = [](std::int64_t x) {
        return static_cast<int>(x > INT32_MAX ? INT32_MAX : x < INT32_MIN ? INT32_MIN : x);
      };
      const int tile_diag = clamp32(tile_diag64);
      const int dk_hi = band.right < 0 ? INT32_MAX : clamp32(tile_diag64 + band.right);  // key - qc <= dk_hi
      const int dk_lo = band.left < 0 ? INT32_MIN : clamp32(tile_diag64 - band.left);   // key - qc >= dk_lo
      const int rows_valid = static_cast<int>(si.len_q - r0 < kBlockM ? si.len_q - r0 : kBlockM);

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
        if constexpr (Tr::kFuseSdP) gemm_sdp(dp, t0);
        else gemm_s(dp, sV_a, do_a, t0, [](int) {});

        if constexpr (kPlain) {
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
            for (int t = 0; t < kDpNT; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int qc = q0 + (t0 + t) * 8 + 2 * (lane % 4) + (e % 2);
                const float pr = fast_exp2(fmaf(s[mt][t0 + t][e], p.scale_log2, -lse_s[qc] * kLog2e));
                s[mt][t0 + t][e] = pr;
                dp[mt][t][e] = pr * (dp[mt][t][e] - d_s[qc]);
              }
        } else {
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
            for (int t = 0; t < kDpNT; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int key = key0 + 16 * mt + lane / 4 + 8 * (e / 2);
                const int qc = q0 + (t0 + t) * 8 + 2 * (lane % 4) + (e % 2);
                float& sv = s[mt][t0 + t][e];
                float s2, dcap = 1.0f;  // score · log2 e; d(score)/d(scale·q·k)
                if (has_softcap) {
                  const float th = tanhf(sv * softcap_inv_scale);
                  s2 = th * softcap_log2;
                  dcap = 1.0f - th * th;
                } else {
                  s2 = sv * p.scale_log2;
                }
                if (p.alibi != nullptr) {
                  const int dist = qc - key + tile_diag;
                  s2 -= slope * static_cast<float>(dist < 0 ? -dist : dist) * kLog2e;
                }
                const bool visible = key < keys_valid && key - qc <= dk_hi && key - qc >= dk_lo;
                // Rows past the end or with no visible key (lse = -inf) get P = 0 exactly.
                const float lse = lse_s[qc];
                const bool live = visible && qc < rows_valid && lse != -INFINITY;
                const float pr = live ? fast_exp2(s2 - lse * kLog2e) : 0.0f;
                float dpv = dp[mt][t][e], pdrop = pr;
                if (has_dropout) {
                  const bool keep = (sKeep[qc * kKeepWords + key / 32] >> (key % 32)) & 1u;
                  pdrop = keep ? pr * p.dropout_rescale : 0.0f;
                  dpv = keep ? dpv * p.dropout_rescale : 0.0f;
                }
                sv = pdrop;
                dp[mt][t][e] = pr * (dpv - d_s[qc]) * dcap;
              }
        }

        // dSᵀ (for dK and dQ) and P_dropᵀ (for dV) to shared memory as T, for the warps of the other
        // two grids.
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt)
#pragma unroll
          for (int t = 0; t < kDpNT; ++t)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
              const std::uint32_t off = SwM::step(off_s_st, 16 * mt + 8 * h2, t0 + t);
              sts_b32(sdS_a + off, pack2<T>(dp[mt][t][2 * h2], dp[mt][t][2 * h2 + 1]));
              sts_b32(sP_a + off, pack2<T>(s[mt][t0 + t][2 * h2], s[mt][t0 + t][2 * h2 + 1]));
            }
      }
    };
    if (plain) scores(std::true_type{});
    else scores(std::false_type{});
    __syncthreads();  // Pᵀ, dSᵀ complete

#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      std::uint32_t ap[kKVMT][4];
#pragma unroll
      for (int mt = 0; mt < kKVMT; ++mt) ldsm_x4(ap[mt], sP_a + SwM::step(off_s_a, 16 * mt, 2 * kk));
      mma_dv(kk, ap);
    }
    auto dk_products = [&] {
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        std::uint32_t ads[kKVMT][4];
#pragma unroll
        for (int mt = 0; mt < kKVMT; ++mt) ldsm_x4(ads[mt], sdS_a + SwM::step(off_s_a, 16 * mt, 2 * kk));
        mma_dk(kk, ads);
      }
    };

    // dQ partial = dS K, (kBlockM, kHeadDim) over the dQ warp grid in passes of kDqPass columns,
    // added into the fp32 accumulator.
    auto dq_products = [&] {
      const int row = dq_m0 + lane / 4;  // of m tile 0 half 0; + 16·mt + 8·half
      float* acc_row = dq_acc + (static_cast<std::int64_t>(head) * p.total_q + si.global_q_row0 + r0 + row) * p.d;
      int* tile_sem = nullptr;
      int turn = 0;  // how many key blocks added to this query tile before this one
      if (p.deterministic) {
        const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
        tile_sem = sem + (static_cast<std::int64_t>(b) * p.h + head) * m_blocks + m_block;
        turn = n_block - static_cast<int>(band.key_begin(r0, si.len_k) / kBlockN);
        if (tid == 0) sem_wait(tile_sem, turn);
        __syncthreads();
      }
      // acc_dq (kDqWarpM, kDqPass) of pass `pass` into the accumulator. Whole tiles of the atomic
      // path (every row in the sequence, p.d == kHeadDim, so acc_row's rows are kHeadDim long) take
      // a short form compiled apart: reductions at constant offsets from one address per lane, no
      // bounds tests. The general form wraps each 8-byte reduction in a branch region with 64-bit
      // bounds compares and the deterministic test (SASS: ~10-25 instructions and 2-4 branches
      // each, 16 per warp and step at hdim 64, 128, 32 at 256). Only with one dQ pass (every head
      // dim now): with two passes at hdim 256 the short form spilled 16-20 bytes on sm_90.
      constexpr bool kShortAdds = Tr::kDqWarpD == Tr::kDqPass;
      const bool whole = !p.deterministic && p.d == kHeadDim && r0 + kBlockM <= si.len_q;
      auto add_dq = [&](const auto& acc_dq, int pass, auto whole_tag) {
        constexpr bool kWhole = decltype(whole_tag)::value;
#pragma unroll
        for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
          for (int t = 0; t < kDqNT; ++t) {
            if constexpr (kWhole) {
#pragma unroll
              for (int h2 = 0; h2 < 2; ++h2)
                red_dq_pair(acc_row + dq_d0 + 2 * (lane % 4) + (16 * mt + 8 * h2) * kHeadDim +
                                pass * Tr::kDqPass + t * 8,
                            acc_dq[mt][t][2 * h2], acc_dq[mt][t][2 * h2 + 1]);
            } else {
              const int col = dq_d0 + pass * Tr::kDqPass + t * 8 + 2 * (lane % 4);
              if (col >= p.d) continue;
#pragma unroll
              for (int h2 = 0; h2 < 2; ++h2) {
                if (r0 + row + 16 * mt + 8 * h2 >= si.len_q) continue;
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
      };
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
          for (int mt = 0; mt < kDqMT; ++mt) ldsm_x4_t(a[mt], sdS_a + SwM::step(off_ds_at, 16 * kk, 2 * mt));
#pragma unroll
          for (int nj = 0; nj < kDqNT / 2; ++nj) {
            std::uint32_t bk[4];
            ldsm_x4_t(bk, sK_a + SwD::step(off_k_bt, 16 * kk, pass * Tr::kDqPass / 8 + 2 * nj));
            const std::uint32_t bk0[2] = {bk[0], bk[1]}, bk1[2] = {bk[2], bk[3]};
#pragma unroll
            for (int mt = 0; mt < kDqMT; ++mt) {
              mma_16816<T>(acc_dq[mt][2 * nj], a[mt], bk0);
              mma_16816<T>(acc_dq[mt][2 * nj + 1], a[mt], bk1);
            }
          }
        }
        if constexpr (kDeferDq) {
          static_assert(kShortAdds, "the carried tile is one whole dQ pass");
          dq_carry_row = whole ? reinterpret_cast<std::uintptr_t>(acc_row + dq_d0 + 2 * (lane % 4)) : 0;
          if (whole) {
#pragma unroll
            for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
              for (int t = 0; t < kDqNT; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) dq_carry[mt][t][e] = acc_dq[mt][t][e];
          } else {
            add_dq(acc_dq, pass, std::false_type{});
            // Defined on every path, so that the carried registers are dead from the reductions
            // in the Sᵀ products to here (left as they were, they stayed live through the whole
            // step on this path: 236 bytes of spills).
#pragma unroll
            for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
              for (int t = 0; t < kDqNT; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) dq_carry[mt][t][e] = 0.0f;
          }
        } else if constexpr (kShortAdds) {
          if (whole) add_dq(acc_dq, pass, std::true_type{});
          else add_dq(acc_dq, pass, std::false_type{});
        } else {
          add_dq(acc_dq, pass, std::false_type{});
        }
      }
      if (p.deterministic) {
        __threadfence();
        __syncthreads();
        if (tid == 0) sem_release(tile_sem, turn + 1);
      }
    };
    // Order after dV: with two stages dQ comes before dK, as FlashAttention-2 orders them, so that
    // the dK products overlap the dQ reductions in flight instead of the next step's barrier
    // waiting on them. With one stage dK comes first, so that Q and dO are free and the next
    // step's copy overlaps dQ.
    if constexpr (stages == 1) {
      dk_products();
      __syncthreads();
      if (it + 1 < n_iter) load_q_block(it + 1, 0);
      dq_products();
    } else {
      dq_products();
      dk_products();
    }
  }
  cp_async_wait<0>();  // a block with no query rows still has K, V in flight
  if (kDeferDq && dq_carry_row != 0) {
#pragma unroll
    for (int j = 0; j < kDqMT * kDqNT * 2; ++j) carry_red(j);
  }

  // Epilogue: dK = scale · Σ dS q (dS was taken w.r.t. the score scale·q·k), dV as accumulated.
  // Rows past the end of the sequence and padded head-dim columns are not written.
  // The sequence's first key row is read again rather than kept from the start: held across the
  // mainloop it was the one register ptxas spilled (4 bytes) at hdim 256.
  const std::int64_t k_row = detail::seq_info(p, b).k_row0 + kb;
  T* dk_g = static_cast<T*>(p.dk) + detail::offset_of(p.dk_stride, b, k_row, hk);
  T* dv_g = static_cast<T*>(p.dv) + detail::offset_of(p.dv_stride, b, k_row, hk);
#pragma unroll
  for (int mt = 0; mt < kKVMT; ++mt)
#pragma unroll
    for (int t = 0; t < kKVNT; ++t) {
      const int col = d0 + t * 8 + 2 * (lane % 4);
      if (col >= p.d) continue;
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int key = kv0 + 16 * mt + lane / 4 + 8 * h2;
        if (key >= keys_valid) continue;
        *reinterpret_cast<std::uint32_t*>(dk_g + key * p.dk_stride.row + col) =
            pack2<T>(acc_dk[mt][t][2 * h2] * p.scale, acc_dk[mt][t][2 * h2 + 1] * p.scale);
        *reinterpret_cast<std::uint32_t*>(dv_g + key * p.dv_stride.row + col) =
            pack2<T>(acc_dv[mt][t][2 * h2], acc_dv[mt][t][2 * h2 + 1]);
      }
    }
}

}  // namespace flashmonoid::cuda::bwd
