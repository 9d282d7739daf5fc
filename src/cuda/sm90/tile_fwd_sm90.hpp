// Tile shapes of the sm90 forward, shared by the kernel (template arguments) and the host planning
// code (grid, shared memory), so both always agree.
#pragma once

#include <cstddef>

#ifndef FM_SM90_D64_CONSUMERS
#define FM_SM90_D64_CONSUMERS 2
#endif
#ifndef FM_SM90_D64_BLOCK_N
#define FM_SM90_D64_BLOCK_N 128
#endif

namespace flashmonoid::cuda {

struct FwdTileSm90 {
  int consumers;  // consumer warpgroups, 64 query rows each (one wgmma M)
  int block_n;    // keys per mainloop step (wgmma N of S = QKᵀ, K of O = PV)
  int stages;     // K/V ring depth
  int consumer_regs, producer_regs;  // setmaxnreg targets: 128·(producer + consumers·consumer) <= 64K
  int q_stages;  // Q buffers: with 2 the next work tile's Q loads while this one's epilogue runs

  constexpr int block_m() const { return 64 * consumers; }
  constexpr int threads() const { return 128 * (consumers + 1); }
  // q_stages Q tiles, then `stages` K tiles and `stages` V tiles, each (rows, head_dim) of 2-byte
  // elements, plus the barriers and the 1024-byte alignment of the swizzled panels.
  constexpr std::size_t smem_bytes(int head_dim) const {
    return static_cast<std::size_t>(q_stages * block_m() + 2 * stages * block_n) * head_dim * 2 + 2048;
  }
};

// FlashAttention-3's shapes where they fit this kernel (consumer warpgroups of 64 rows, 240 registers
// each with 2 consumers, 160 with 3): 128 keys at hdim 64 and 128; 80 keys at hdim 256 (O is 128
// fp32 registers per thread; no score-modifier variant there, see fwd_sm90_eligible). Two Q buffers
// where they fit (hdim 256: Q 64 KB + K/V 160 KB).
constexpr FwdTileSm90 fwd_tile_sm90(int head_dim_bucket) {
  if (head_dim_bucket <= 64) return {FM_SM90_D64_CONSUMERS, FM_SM90_D64_BLOCK_N, 2, FM_SM90_D64_CONSUMERS == 3 ? 160 : 240, 24, 2};
  if (head_dim_bucket <= 128) return {2, 128, 2, 240, 24, 2};
  return {2, 80, 2, 240, 24, 1};
}

}  // namespace flashmonoid::cuda
