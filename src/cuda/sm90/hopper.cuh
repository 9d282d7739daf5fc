// The sm90a vocabulary every Hopper mainloop is written in: wgmma shared-memory descriptors and
// their ordering instructions, TMA tile loads and mbarrier pipelines (through CCCL's cuda::ptx),
// named barriers and register reallocation (setmaxnreg). wgmma itself is in wgmma_ops.cuh
// (generated: cuda::ptx has no wgmma).
//
// Shared-memory tiles are "panels": (rows, 64) of 2-byte elements, one 128-byte line per row, the
// 16-byte chunks XOR-swizzled by row % 8 (common/types.cuh: swizzle_chunk), 1024-byte aligned. That
// is the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and wgmma reads with 128-byte swizzle
// descriptors. A (rows, kHeadDim) tile is kHeadDim / 64 panels one after the other.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "common/types.cuh"
#include "sm90/wgmma_ops.cuh"

namespace flashmonoid::cuda::sm90 {

inline constexpr int kPanelCols = 64;          // 2-byte elements per 128-byte swizzled row
inline constexpr int kPanelRowBytes = 128;
inline constexpr int kSwizzleAtomBytes = 1024;  // 8 rows of 128 bytes: the unit the swizzle repeats over

// The first 1024-byte-aligned byte at or after `raw` (dynamic shared memory guarantees 16): the panels'
// swizzle atoms need it. Offsetting the shared pointer itself keeps the compiler's knowledge that
// everything derived from it is shared memory (shared loads and stores, not generic ones; a generic
// dQ staging store cost the backward 2-4%, H200).
__device__ __forceinline__ unsigned char* align_smem_1024(unsigned char* raw) {
  const std::uint32_t a = smem_addr(raw);
  return raw + (((a + kSwizzleAtomBytes - 1) & ~std::uint32_t(kSwizzleAtomBytes - 1)) - a);
}

// ---- wgmma descriptors -------------------------------------------------------------------------
// Bits (PTX ISA "Matrix Descriptor Format"): 0-13 start address >> 4, 16-29 leading-dimension byte
// offset >> 4, 32-45 stride-dimension byte offset >> 4, 62-63 swizzle (1 = 128B). With 128-byte
// swizzle:
// - K-major (rows of K contiguous, e.g. Q and K for S = QKᵀ): 8-row atoms of 128-byte lines, the
//   stride offset is the step between 8-row groups (1024 B); the leading offset is unused because
//   one instruction's K = 16 stays inside a line. Step k (16 elements) starts 32 bytes further.
// - MN-major (N contiguous, e.g. V as B of O = PV, N = head dim): the leading offset is the step
//   between 64-column panels, the stride offset the step between 8-row (8 keys) groups (1024 B).
//   Step k (16 keys) starts 16 rows = 2048 bytes further.
__device__ __forceinline__ std::uint64_t make_desc(std::uint32_t smem_byte_addr, std::uint32_t lead_bytes,
                                                   std::uint32_t stride_bytes) {
  std::uint64_t d = 0;
  d |= static_cast<std::uint64_t>((smem_byte_addr & 0x3FFFF) >> 4);
  d |= static_cast<std::uint64_t>((lead_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<std::uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32;
  d |= static_cast<std::uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}
// A k step's descriptor is the tile's plus the step's byte offset / 16 in the low word (the 14-bit
// address field cannot carry: shared memory ends below 256 KB), so the tile's descriptor is built once
// and each wgmma of a product costs one add (H100: the forward's S issue block 98 / 146 / 154 -> 45 /
// 77 / 120 instructions at hdim 64 / 128 / 256).
__device__ __forceinline__ std::uint64_t desc_plus(std::uint64_t tile_desc, std::uint32_t offset_bytes) {
  return tile_desc + (offset_bytes >> 4);
}
// K-major tile (rows, K) in panels of `rows` rows: descriptor of k step `ks` (16 elements).
__device__ __forceinline__ std::uint64_t desc_k_major(std::uint32_t tile_addr, int rows, int ks) {
  const int col = ks * 16;
  const std::uint32_t offset = (col / kPanelCols) * rows * kPanelRowBytes + (col % kPanelCols) * 2;
  return desc_plus(make_desc(tile_addr, 16, kSwizzleAtomBytes), offset);
}
// MN-major tile (K rows, N columns) in panels of `rows` rows: descriptor of k step `ks` (16 rows).
__device__ __forceinline__ std::uint64_t desc_mn_major(std::uint32_t tile_addr, int rows, int ks) {
  return desc_plus(make_desc(tile_addr, rows * kPanelRowBytes, kSwizzleAtomBytes), ks * 16 * kPanelRowBytes);
}

// Registers written by ordinary instructions (accumulators rescaled, A fragments) become visible
// to the next wgmma; then a batch of wgmmas is committed as one group and waited on by count.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
template <int kN>
__device__ __forceinline__ void fence_regs(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Ordinary shared-memory stores that TMA or wgmma read next need this before the barrier.
__device__ __forceinline__ void fence_async_shared() { ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared); }

// ---- registers and barriers ---------------------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads, whole warps.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- mbarrier pipeline ---------------------------------------------------------------------------
struct Barrier {
  std::uint64_t word;
  __device__ __forceinline__ void init(unsigned count) { ::cuda::ptx::mbarrier_init(&word, count); }
  __device__ __forceinline__ void arrive() {
    (void)::cuda::ptx::mbarrier_arrive(&word);
  }
  // One arrival that also announces `bytes` of TMA transactions to wait for.
  __device__ __forceinline__ void arrive_expect_tx(std::uint32_t bytes) {
    (void)::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta, ::cuda::ptx::space_shared,
                                               &word, bytes);
  }
  __device__ __forceinline__ void wait(std::uint32_t phase) {
    while (!::cuda::ptx::mbarrier_try_wait_parity(&word, phase)) {
    }
  }
};

__device__ __forceinline__ void fence_barrier_init() { ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster); }

// A TMA tile load of a 4-d tensor map box (coordinates innermost first) into shared memory,
// completing as transactions on `bar`.
__device__ __forceinline__ void tma_load(void* smem, const void* tensor_map, int c0, int c1, int c2, int c3,
                                         Barrier& bar) {
  const std::int32_t coords[4] = {c0, c1, c2, c3};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem, tensor_map, coords,
                                  &bar.word);
}

// The same for a 3-d tensor map.
__device__ __forceinline__ void tma_load(void* smem, const void* tensor_map, int c0, int c1, int c2, Barrier& bar) {
  const std::int32_t coords[3] = {c0, c1, c2};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem, tensor_map, coords,
                                  &bar.word);
}

// A TMA tile store of a 4-d box from shared memory (the copy engine reads it after the issuing
// thread's fence_async_shared-ordered writes), in the issuing thread's bulk group: commit, then
// wait for the reads before the buffer is written again and for completion before the block exits.
// Elements outside the tensor (head-dim padding, rows past the end) are not written.
__device__ __forceinline__ void tma_store(const void* tensor_map, const void* smem, int c0, int c1, int c2, int c3) {
  const std::int32_t coords[4] = {c0, c1, c2, c3};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_global, ::cuda::ptx::space_shared, tensor_map, coords, smem);
}
__device__ __forceinline__ void tma_store_commit() { ::cuda::ptx::cp_async_bulk_commit_group(); }
__device__ __forceinline__ void tma_store_wait_read() { ::cuda::ptx::cp_async_bulk_wait_group_read(::cuda::ptx::n32_t<0>{}); }
__device__ __forceinline__ void tma_store_wait_all() { ::cuda::ptx::cp_async_bulk_wait_group(::cuda::ptx::n32_t<0>{}); }

__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}

// ---- global reductions -------------------------------------------------------------------------
// dst[0..3] += (a, b, c, d) in L2, one 16-byte vector reduction (sm_90; cuda::atomic_ref has no
// vector form). dst is 16-byte aligned.
__device__ __forceinline__ void red_add_v4(float* dst, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// ---- fragments ------------------------------------------------------------------------------------
// A warpgroup accumulator (64, 8·kNTiles) as the A operand of the next wgmma (P of the forward's
// P·V, Pᵀ and dSᵀ of the backward's dV and dK): k step kk (16 columns) is accumulator tiles 2·kk
// and 2·kk + 1, the m16n8k16 A layout.
template <class T, int kNTiles>
__device__ __forceinline__ void p_fragments(std::uint32_t (&a)[kNTiles / 2][4], const float (&s)[1][kNTiles][4]) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    a[kk][0] = pack2<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
    a[kk][1] = pack2<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
    a[kk][2] = pack2<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    a[kk][3] = pack2<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

// O·(1/l) of a warpgroup's (64, kHeadDim) accumulator into a tile of 128-byte-swizzled panels, the
// layout a TMA store reads: each warp writes its 16 rows, a quad of lanes one 16-byte chunk of a row
// per 8 columns, so the 8 rows of a store land in 8 different chunks (no bank conflicts).
template <class T, int kHeadDim>
__device__ __forceinline__ void stage_output_panels(T* so, const float (&o)[1][kHeadDim / 8][4], const float (&inv_l)[2],
                                                    int warp_row0, int lane) {
  const std::uint32_t base = smem_addr(so);
#pragma unroll
  for (int di = 0; di < kHeadDim / 8; ++di)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + half * 8 + lane / 4, col = di * 8 + 2 * (lane & 3);
      const int elem = (col / kPanelCols) * 64 * kPanelCols + swizzled<kPanelCols>(row, col % kPanelCols);
      st_shared_u32(base + 2 * elem, pack2<T>(o[0][di][2 * half] * inv_l[half], o[0][di][2 * half + 1] * inv_l[half]));
    }
}

template <int kRows, int kCols>
__device__ __forceinline__ float (&flat(float (&x)[kRows][kCols][4]))[kRows * kCols * 4] {
  return reinterpret_cast<float (&)[kRows * kCols * 4]>(x);
}

}  // namespace flashmonoid::cuda::sm90
