// FlashAttention-2 backward on mma.sync (sm80 and later), three kernels:
//   1. bwd_preprocess: D = rowsum(dO∘O) per (head, query row) in fp32; clears the dQ accumulator.
//   2. bwd_main: one thread block per (key block, batch, KV head). K_j and V_j stay in shared
//      memory; the block walks every query block of every query head of the GQA group that sees
//      a key of K_j, recomputing P from the forward's lse, and accumulates dK_j, dV_j in registers
//      (so the GQA reduction needs no workspace and no second pass). dQ is added into an fp32
//      accumulator: float atomics, or, when deterministic, in key-block order (semaphores).
//   3. bwd_convert_dq: dq = scale · dQ accumulator, cast to the input dtype.
//
// Scores in this kernel are computed transposed, Sᵀ = K Qᵀ (kBlockN, kBlockM), so that a warp that
// owns 16 key rows holds Pᵀ and dSᵀ in exactly the A-operand layout of dV += Pᵀ dO and dK += dSᵀ Q.
#pragma once

#include <cmath>
#include <cstdint>

#include "api/params.hpp"
#include "common/mma_sm80.cuh"
#include "flashmonoid/detail/mask.hpp"
#include "flashmonoid/detail/philox.hpp"
#include "sm80/bwd_sm80.hpp"

namespace flashmonoid::cuda::bwd {

inline constexpr float kLog2e = 1.4426950408889634f;

// Tile shapes. 8 warps; kBlockM query rows per step (kBwdBlockM, shared with the workspace size).
// At hdim 64 each warp owns 16 key rows (kBlockN 128), all query columns of Sᵀ and all head-dim
// columns of dK, dV, so Pᵀ and dSᵀ feed the dV, dK products straight from registers. At hdim 128
// the same layout needs 2 · 16·128 fp32 accumulators / 32 lanes = 128 registers for dK, dV alone
// and ptxas spilled (56 bytes at 255 registers on sm_90), so warps split 4 along keys × 2 along
// the head dim (kBlockN 64, 64 accumulator registers) and Pᵀ, dSᵀ travel through shared memory to
// the warp pair that shares their key rows. At hdim 256, 4 × 2 still spilled (24 bytes on sm_90),
// so 2 × 4 (kBlockN 32).
template <int kHeadDim_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head-dim buckets are 64, 128, 256");
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockM = kBwdBlockM;
  static constexpr int kWarpsD = kHeadDim > 128 ? 4 : kHeadDim == 128 ? 2 : 1;  // warps sharing 16 keys
  static constexpr int kWarpsN = kNWarps / kWarpsD;
  static constexpr int kBlockN = 16 * kWarpsN;
  static constexpr int kWarpM = kBlockM / kWarpsD;   // Sᵀ columns (query rows) per warp
  static constexpr int kWarpD = kHeadDim / kWarpsD;  // dK, dV columns per warp
  // dQ tile (kBlockM, kHeadDim): 4 warps along query rows × 2 along the head dim, in passes of at
  // most 64 columns so that its accumulator stays at 32 registers next to dK and dV.
  static constexpr int kDqWarpsM = kBlockM / 16;
  static constexpr int kDqWarpsD = kNWarps / kDqWarpsM;
  static constexpr int kDqWarpD = kHeadDim / kDqWarpsD;
  static constexpr int kDqPass = kDqWarpD < 64 ? kDqWarpD : 64;
  // Q and dO tiles double-buffered while they fit next to K and V in the 163 KB an sm80 block may
  // have: 114 KB at hdim 128; at hdim 256 two stages would need 170 KB, so one.
  static constexpr int kStages = kHeadDim > 128 ? 1 : 2;
  static constexpr bool kPInSmem = kWarpsD > 1;

  static constexpr int kKVElems = kBlockN * kHeadDim;  // (kBlockN, kHeadDim) each for K, V
  static constexpr int kQElems = kBlockM * kHeadDim;   // (kBlockM, kHeadDim) each for Q, dO, per stage
  static constexpr int kSElems = kBlockN * kBlockM;    // (kBlockN, kBlockM) dSᵀ, and Pᵀ if kPInSmem
  static constexpr std::size_t kSmemBytes =
      (2 * kKVElems + 2 * kStages * kQElems + (kPInSmem ? 2 : 1) * kSElems) * 2 +
      2 * kStages * kBlockM * sizeof(float) + kBlockM * (kBlockN / 32) * sizeof(std::uint32_t);
  static_assert(kBlockM % 16 == 0 && kDqWarpsM * kDqWarpsD == kNWarps, "dQ warp grid must cover 8 warps");
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
// at hdim 256 when the compiler hoisted them out of the mainloop).
template <int kRows, int kCols, int kNThreads, class T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, std::int64_t row_stride, int rows_valid,
                                                int cols_valid, int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = kNThreads / kChunks;
  static_assert(kNThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0,
                "tile must split evenly over the threads, 8-row aligned for the swizzle");
  const int r = tid / kChunks, c = (tid % kChunks) * 8;
  T* dst = smem + tile_off<kCols>(r, c);
  const T* src = gmem + r * row_stride + c;
  const bool col_ok = c < cols_valid;
#pragma unroll
  for (int k = 0; k < kRows / kRowStep; ++k) {
    const bool pred = col_ok && r + k * kRowStep < rows_valid;
    cp_async_16(dst + k * kRowStep * kCols, pred ? src + k * kRowStep * row_stride : gmem, pred);
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
// 1. D = rowsum(dO∘O) and a cleared dQ accumulator. One warp per (query row, head).
inline constexpr int kRowKernelWarps = 8;

template <class T>
__global__ void __launch_bounds__(kRowKernelWarps * 32)
    bwd_preprocess(const detail::BwdParams p, float* __restrict__ dsum, float* __restrict__ dq_acc) {
  const int b = blockIdx.z, head = blockIdx.y;
  const int lane = threadIdx.x % 32;
  const int i = blockIdx.x * kRowKernelWarps + threadIdx.x / 32;
  const detail::SeqInfo si = detail::seq_info(p, b);
  if (i >= si.len_q) return;
  const T* o = static_cast<const T*>(p.out) + detail::offset_of(p.o_stride, b, si.q_row0 + i, head);
  const T* d_o = static_cast<const T*>(p.dout) + detail::offset_of(p.do_stride, b, si.q_row0 + i, head);
  float acc = 0.0f;
  for (int c = lane * 8; c < p.d; c += 32 * 8) {  // 16-byte loads, 8 elements
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += to_float(oe[e]) * to_float(de[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) dsum[detail::lse_index(p, b, head, si, i)] = acc;
  float4* row = reinterpret_cast<float4*>(dq_acc + (static_cast<std::int64_t>(head) * p.total_q + si.global_q_row0 + i) * p.d);
  for (int c = lane; c < p.d / 4; c += 32) row[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// 3. dq = scale · accumulator in the input dtype. One warp per (query row, head).
template <class T>
__global__ void __launch_bounds__(kRowKernelWarps * 32)
    bwd_convert_dq(const detail::BwdParams p, const float* __restrict__ dq_acc) {
  const int b = blockIdx.z, head = blockIdx.y;
  const int lane = threadIdx.x % 32;
  const int i = blockIdx.x * kRowKernelWarps + threadIdx.x / 32;
  const detail::SeqInfo si = detail::seq_info(p, b);
  if (i >= si.len_q) return;
  const float* src = dq_acc + (static_cast<std::int64_t>(head) * p.total_q + si.global_q_row0 + i) * p.d;
  T* dst = static_cast<T*>(p.dq) + detail::offset_of(p.dq_stride, b, si.q_row0 + i, head);
  for (int c = lane * 8; c < p.d; c += 32 * 8) {
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

template <class T, class Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    bwd_main(const detail::BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_acc, int* __restrict__ sem) {
  constexpr int kHeadDim = Tr::kHeadDim, kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr int kWarpM = Tr::kWarpM, kWarpD = Tr::kWarpD;
  constexpr int kSliceM = kWarpM < 32 ? kWarpM : 32;  // query columns of Sᵀ per pass (see below)
  constexpr int kSTiles = kSliceM / 8;   // n8 tiles of one pass
  static_assert(kWarpM % kSliceM == 0, "warp slice must be whole passes");
  constexpr int kDTiles = kWarpD / 8;  // n8 tiles of the warp's dK, dV slices
  constexpr int kKeepWords = kBlockN / 32;  // dropout keep bits per query row, 32 keys a word
  using SwD = Swizzled<kHeadDim>;  // K, V, Q, dO tiles
  using SwM = Swizzled<kBlockM>;   // dSᵀ, Pᵀ tiles

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);   // (kBlockN, kHeadDim)
  T* sV = sK + Tr::kKVElems;                 // (kBlockN, kHeadDim)
  T* sQ = sV + Tr::kKVElems;                 // kStages × (kBlockM, kHeadDim)
  T* sdO = sQ + Tr::kStages * Tr::kQElems;   // kStages × (kBlockM, kHeadDim)
  T* sdS = sdO + Tr::kStages * Tr::kQElems;  // (kBlockN, kBlockM) dSᵀ
  T* sP = sdS + Tr::kSElems;                 // (kBlockN, kBlockM) P_dropᵀ, only if kPInSmem
  float* sLse = reinterpret_cast<float*>(sdS + (Tr::kPInSmem ? 2 : 1) * Tr::kSElems);  // kStages × (kBlockM)
  float* sD = sLse + Tr::kStages * kBlockM;                                           // kStages × (kBlockM)
  std::uint32_t* sKeep = reinterpret_cast<std::uint32_t*>(sD + Tr::kStages * kBlockM);  // (kBlockM, kKeepWords)

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wn = warp % Tr::kWarpsN, wd = warp / Tr::kWarpsN;
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
    load_tile_async<kBlockM, kHeadDim, Tr::kNThreads>(sQ + stage * Tr::kQElems, q_g, p.q_stride.row, rows_valid, p.d, tid);
    load_tile_async<kBlockM, kHeadDim, Tr::kNThreads>(sdO + stage * Tr::kQElems, do_g, p.do_stride.row, rows_valid, p.d, tid);
    if (tid < kBlockM) {
      const bool ok = tid < rows_valid;
      const std::int64_t idx = ok ? detail::lse_index(p, b, head, si, r0 + tid) : 0;
      cp_async_4(sLse + stage * kBlockM + tid, p.lse + idx, ok);
      cp_async_4(sD + stage * kBlockM + tid, dsum + idx, ok);
    }
    cp_async_commit();
  };

  // Per-lane shared-memory offsets of every operand (see Swizzled).
  const std::uint32_t sK_a = smem_addr(sK), sV_a = smem_addr(sV), sQ_a = smem_addr(sQ), sdO_a = smem_addr(sdO);
  const std::uint32_t sdS_a = smem_addr(sdS), sP_a = smem_addr(sP);
  const int key0 = 16 * wn;    // first key row (in the block) of this warp
  const int q0 = wd * kWarpM;  // first query column of this warp's Sᵀ slice
  const std::uint32_t off_kv_a = SwD::lane_offset(key0 + a_row(lane), a_chunk(lane));             // K, V as A
  const std::uint32_t off_q_b = SwD::lane_offset(q0 + b_row(lane), b_chunk(lane));                // Q, dO as B
  const std::uint32_t off_q_bt = SwD::lane_offset(bt_row(lane), wd * kWarpD / 8 + bt_chunk(lane)); // Q, dO as Bᵀ
  const std::uint32_t off_s_a = SwM::lane_offset(key0 + a_row(lane), a_chunk(lane));              // Pᵀ, dSᵀ as A
  const std::uint32_t off_s_st = SwM::lane_offset(key0 + lane / 4, q0 / 8) + 4 * (lane % 4);      // Sᵀ fragment stores
  const int qm = warp % Tr::kDqWarpsM, qd = warp / Tr::kDqWarpsM;  // dQ warp grid
  const std::uint32_t off_ds_at = SwM::lane_offset(at_row(lane), 2 * qm + at_chunk(lane));         // dSᵀ as Aᵀ
  const std::uint32_t off_k_bt = SwD::lane_offset(bt_row(lane), qd * Tr::kDqWarpD / 8 + bt_chunk(lane));  // K as Bᵀ

  float acc_dk[kDTiles][4], acc_dv[kDTiles][4];  // (16, kWarpD) per warp: keys key0.., cols wd·kWarpD..
#pragma unroll
  for (int t = 0; t < kDTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[t][e] = acc_dv[t][e] = 0.0f;

  if (n_iter > 0) load_q_block(0, 0);
  else cp_async_commit();

  const bool has_softcap = p.softcap > 0.0f;
  const bool has_dropout = p.dropout_p > 0.0f;
  const float softcap_inv_scale = has_softcap ? p.scale / p.softcap : 0.0f;
  const float softcap_log2 = p.softcap * kLog2e;

  for (int it = 0; it < n_iter; ++it) {
    const int stage = Tr::kStages == 1 ? 0 : it % 2;
    cp_async_wait<0>();
    __syncthreads();
    if (Tr::kStages == 2 && it + 1 < n_iter) load_q_block(it + 1, (it + 1) % 2);

    const std::uint32_t q_a = sQ_a + stage * Tr::kQElems * 2, do_a = sdO_a + stage * Tr::kQElems * 2;
    const float* lse_s = sLse + stage * kBlockM;
    const float* d_s = sD + stage * kBlockM;
    const int head = hk * group + it / n_m;
    const int m_block = m_of(it);
    const std::int64_t r0 = static_cast<std::int64_t>(m_block) * kBlockM;

    // Dropout keep bits of the (kBlockM, kBlockN) tile, one Philox call per 4 keys (its 4 words)
    // rather than one per element as a per-fragment evaluation would need (a lane's fragment
    // holds keys 8 apart).
    if (has_dropout) {
      if (tid < kBlockM * kKeepWords) {
        const int qr = tid / kKeepWords, w = tid % kKeepWords;
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

    // dV += P_dropᵀ dO and dK += dSᵀ Q for 16 query rows (step kk), A operands given. dV first,
    // then dK, so that only one operand's B fragments are in flight.
    auto mma_dkdv = [&](int kk, const std::uint32_t(&ap)[4], const std::uint32_t(&ads)[4]) {
#pragma unroll
      for (int nj = 0; nj < kWarpD / 16; ++nj) {
        std::uint32_t bo[4];
        ldsm_x4_t(bo, do_a + SwD::step(off_q_bt, 16 * kk, 2 * nj));
        const std::uint32_t bo0[2] = {bo[0], bo[1]}, bo1[2] = {bo[2], bo[3]};
        mma_16816<T>(acc_dv[2 * nj], ap, bo0);
        mma_16816<T>(acc_dv[2 * nj + 1], ap, bo1);
      }
#pragma unroll
      for (int nj = 0; nj < kWarpD / 16; ++nj) {
        std::uint32_t bq[4];
        ldsm_x4_t(bq, q_a + SwD::step(off_q_bt, 16 * kk, 2 * nj));
        const std::uint32_t bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
        mma_16816<T>(acc_dk[2 * nj], ads, bq0);
        mma_16816<T>(acc_dk[2 * nj + 1], ads, bq1);
      }
    };

    const bool need_mask = band.tile_needs_mask(r0, r0 + kBlockM, kb, kb + kBlockN, si.len_k);
    const float slope = detail::alibi_slope(p, b, head);

    // The warp's (16, kWarpM) slice of Sᵀ is processed kSliceM query columns at a time: then only
    // 2 · 16 fp32 registers of Sᵀ, dPᵀ live next to the 128 of dK, dV at hdim 128 (whole
    // 64-column slices left ptxas at 255 registers with spills).
#pragma unroll
    for (int slice = 0; slice < kWarpM / kSliceM; ++slice) {
      const int qs = slice * kSliceM;  // offset of the slice from q0
      // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, (16, kSliceM) each.
      float s[kSTiles][4], dp[kSTiles][4];
#pragma unroll
      for (int t = 0; t < kSTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[t][e] = dp[t][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        std::uint32_t ak[4], av[4];
        ldsm_x4(ak, sK_a + SwD::step(off_kv_a, 0, 2 * kk));
        ldsm_x4(av, sV_a + SwD::step(off_kv_a, 0, 2 * kk));
#pragma unroll
        for (int nj = 0; nj < kSliceM / 16; ++nj) {
          std::uint32_t bq[4], bo[4];
          ldsm_x4(bq, q_a + SwD::step(off_q_b, qs + 16 * nj, 2 * kk));
          ldsm_x4(bo, do_a + SwD::step(off_q_b, qs + 16 * nj, 2 * kk));
          const std::uint32_t bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
          const std::uint32_t bo0[2] = {bo[0], bo[1]}, bo1[2] = {bo[2], bo[3]};
          mma_16816<T>(s[2 * nj], ak, bq0);
          mma_16816<T>(s[2 * nj + 1], ak, bq1);
          mma_16816<T>(dp[2 * nj], av, bo0);
          mma_16816<T>(dp[2 * nj + 1], av, bo1);
        }
      }

      // P = exp2(s·log2 e − lse·log2 e), dropout, dS = P ∘ (dP_drop − D) (∘ (1 − tanh²) under
      // softcap). Afterwards s holds P_drop and dp holds dS, both (key, query) transposed.
#pragma unroll
      for (int t = 0; t < kSTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + lane / 4 + 8 * (e / 2);
          const int qc = q0 + qs + t * 8 + 2 * (lane % 4) + (e % 2);
          const std::int64_t i = r0 + qc, j = kb + key;
          float s2, dcap = 1.0f;  // score · log2 e; d(score)/d(scale·q·k)
          if (has_softcap) {
            const float th = tanhf(s[t][e] * softcap_inv_scale);
            s2 = th * softcap_log2;
            dcap = 1.0f - th * th;
          } else {
            s2 = s[t][e] * p.scale_log2;
          }
          if (p.alibi != nullptr) s2 += detail::alibi_bias(slope, i, j, band.diag) * kLog2e;
          const bool visible = !need_mask || (j < si.len_k && band.visible(i, j));
          // Rows past the end or with no visible key (lse = -inf) get P = 0 exactly.
          const float lse = lse_s[qc];
          const bool live = visible && i < si.len_q && lse != -INFINITY;
          const float pr = live ? exp2f(s2 - lse * kLog2e) : 0.0f;
          float dpv = dp[t][e], pdrop = pr;
          if (has_dropout) {
            const bool keep = (sKeep[qc * kKeepWords + key / 32] >> (key % 32)) & 1u;
            pdrop = keep ? pr * p.dropout_rescale : 0.0f;
            dpv = keep ? dpv * p.dropout_rescale : 0.0f;
          }
          s[t][e] = pdrop;
          dp[t][e] = pr * (dpv - d_s[qc]) * dcap;
        }

      // dSᵀ (for dQ, and for dK when other warps need it) and P_dropᵀ (likewise) to shared
      // memory as T.
#pragma unroll
      for (int t = 0; t < kSTiles; ++t)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const std::uint32_t off = SwM::step(off_s_st, 8 * h2, qs / 8 + t);
          sts_b32(sdS_a + off, pack2<T>(dp[t][2 * h2], dp[t][2 * h2 + 1]));
          if constexpr (Tr::kPInSmem) sts_b32(sP_a + off, pack2<T>(s[t][2 * h2], s[t][2 * h2 + 1]));
        }

      if constexpr (!Tr::kPInSmem) {
        // The accumulator layout of n8 tiles 2kk, 2kk+1 is the A layout of a 16x16 tile.
#pragma unroll
        for (int kk = 0; kk < kSliceM / 16; ++kk) {
          const std::uint32_t ap[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                       pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                       pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
          const std::uint32_t ads[4] = {pack2<T>(dp[2 * kk][0], dp[2 * kk][1]), pack2<T>(dp[2 * kk][2], dp[2 * kk][3]),
                                        pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                        pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
          mma_dkdv((q0 + qs) / 16 + kk, ap, ads);
        }
      }
    }
    __syncthreads();

    if constexpr (Tr::kPInSmem) {
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        std::uint32_t ap[4], ads[4];
        ldsm_x4(ap, sP_a + SwM::step(off_s_a, 0, 2 * kk));
        ldsm_x4(ads, sdS_a + SwM::step(off_s_a, 0, 2 * kk));
        mma_dkdv(kk, ap, ads);
      }
    }

    // dQ partial = dS K, (kBlockM, kHeadDim) over the 4 × 2 dQ warp grid, added into the fp32
    // accumulator.
    {
      const int row = qm * 16 + lane / 4;  // and row + 8
      float* acc_row = dq_acc + (static_cast<std::int64_t>(head) * p.total_q + si.global_q_row0 + r0 + row) * p.d;
      const bool row_ok0 = r0 + row < si.len_q, row_ok1 = r0 + row + 8 < si.len_q;
      int* tile_sem = nullptr;
      int turn = 0;  // how many key blocks added to this query tile before this one
      if (p.deterministic) {
        const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
        tile_sem = sem + (static_cast<std::int64_t>(b) * p.h + head) * m_blocks + m_block;
        turn = n_block - static_cast<int>(band.key_begin(r0, si.len_k) / kBlockN);
        if (tid == 0) sem_wait(tile_sem, turn);
        __syncthreads();
      }
#pragma unroll
      for (int pass = 0; pass < Tr::kDqWarpD / Tr::kDqPass; ++pass) {
        float acc_dq[Tr::kDqPass / 8][4];  // (16, kDqPass) per warp
#pragma unroll
        for (int t = 0; t < Tr::kDqPass / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[t][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          std::uint32_t a[4];
          ldsm_x4_t(a, sdS_a + SwM::step(off_ds_at, 16 * kk, 0));
#pragma unroll
          for (int nj = 0; nj < Tr::kDqPass / 16; ++nj) {
            std::uint32_t bk[4];
            ldsm_x4_t(bk, sK_a + SwD::step(off_k_bt, 16 * kk, pass * Tr::kDqPass / 8 + 2 * nj));
            const std::uint32_t bk0[2] = {bk[0], bk[1]}, bk1[2] = {bk[2], bk[3]};
            mma_16816<T>(acc_dq[2 * nj], a, bk0);
            mma_16816<T>(acc_dq[2 * nj + 1], a, bk1);
          }
        }
#pragma unroll
        for (int t = 0; t < Tr::kDqPass / 8; ++t) {
          const int col = qd * Tr::kDqWarpD + pass * Tr::kDqPass + t * 8 + 2 * (lane % 4);
          if (col >= p.d) continue;
          float* r_0 = acc_row + col;
          float* r_1 = acc_row + 8 * p.d + col;
          if (p.deterministic) {
            if (row_ok0) {
              __stcg(r_0, __ldcg(r_0) + acc_dq[t][0]);
              __stcg(r_0 + 1, __ldcg(r_0 + 1) + acc_dq[t][1]);
            }
            if (row_ok1) {
              __stcg(r_1, __ldcg(r_1) + acc_dq[t][2]);
              __stcg(r_1 + 1, __ldcg(r_1 + 1) + acc_dq[t][3]);
            }
          } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            // One 8-byte reduction per pair: a warp's instruction then fills whole 32-byte
            // sectors (4 lanes x 8 bytes per row) instead of half-filling twice as many.
            if (row_ok0) atomicAdd(reinterpret_cast<float2*>(r_0), make_float2(acc_dq[t][0], acc_dq[t][1]));
            if (row_ok1) atomicAdd(reinterpret_cast<float2*>(r_1), make_float2(acc_dq[t][2], acc_dq[t][3]));
#else
            if (row_ok0) {
              atomicAdd(r_0, acc_dq[t][0]);
              atomicAdd(r_0 + 1, acc_dq[t][1]);
            }
            if (row_ok1) {
              atomicAdd(r_1, acc_dq[t][2]);
              atomicAdd(r_1 + 1, acc_dq[t][3]);
            }
#endif
          }
        }
      }
      if (p.deterministic) {
        __threadfence();
        __syncthreads();
        if (tid == 0) sem_release(tile_sem, turn + 1);
      }
    }

    if constexpr (Tr::kStages == 1) {
      __syncthreads();  // every warp is done with Q, dO before they are overwritten
      if (it + 1 < n_iter) load_q_block(it + 1, 0);
    }
  }
  cp_async_wait<0>();  // a block with no query rows still has K, V in flight

  // Epilogue: dK = scale · Σ dS q (dS was taken w.r.t. the score scale·q·k), dV as accumulated.
  // Rows past the end of the sequence and padded head-dim columns are not written.
  T* dk_g = static_cast<T*>(p.dk) + detail::offset_of(p.dk_stride, b, si.k_row0 + kb, hk);
  T* dv_g = static_cast<T*>(p.dv) + detail::offset_of(p.dv_stride, b, si.k_row0 + kb, hk);
#pragma unroll
  for (int t = 0; t < kDTiles; ++t) {
    const int col = wd * kWarpD + t * 8 + 2 * (lane % 4);
    if (col >= p.d) continue;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int key = key0 + lane / 4 + 8 * h2;
      if (key >= keys_valid) continue;
      *reinterpret_cast<std::uint32_t*>(dk_g + key * p.dk_stride.row + col) =
          pack2<T>(acc_dk[t][2 * h2] * p.scale, acc_dk[t][2 * h2 + 1] * p.scale);
      *reinterpret_cast<std::uint32_t*>(dv_g + key * p.dv_stride.row + col) =
          pack2<T>(acc_dv[t][2 * h2], acc_dv[t][2 * h2 + 1]);
    }
  }
}

}  // namespace flashmonoid::cuda::bwd
