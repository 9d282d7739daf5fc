// Tile shapes of the sm90 forward, shared by the kernel (template arguments) and the host planning
// code (grid, shared memory), so both always agree.
#pragma once

#include <cstddef>

namespace flashmonoid::cuda {

struct FwdTileSm90 {
  int consumers;  // consumer warpgroups, 64 query rows each (one wgmma M)
  int block_n;    // keys per mainloop step (wgmma N of S = QKᵀ, K of O = PV)
  int stages;     // K/V ring depth
  int consumer_regs, producer_regs;  // setmaxnreg targets: 128·(producer + consumers·consumer) <= 64K

  constexpr int block_m() const { return 64 * consumers; }
  constexpr int threads() const { return 128 * (consumers + 1); }
  // Q, then `stages` K tiles and `stages` V tiles, each (rows, head_dim) of 2-byte elements, plus
  // 1 KB for the barriers and the 1024-byte alignment of the swizzled panels.
  constexpr std::size_t smem_bytes(int head_dim) const {
    return static_cast<std::size_t>(block_m() + 2 * stages * block_n) * head_dim * 2 + 2048;
  }
};

// FlashAttention-3's shapes where they fit this kernel (2 consumer warpgroups of 64 rows, 24/240
// registers): 128 keys at hdim 64 and 128; 80 keys at hdim 256 (O is 128 fp32 registers per thread).
constexpr FwdTileSm90 fwd_tile_sm90(int head_dim_bucket) {
  if (head_dim_bucket <= 64) return {2, 128, 2, 240, 24};
  if (head_dim_bucket <= 128) return {2, 128, 2, 240, 24};
  return {2, 80, 2, 240, 24};
}

}  // namespace flashmonoid::cuda
