// Tile shapes of the sm90 backward, shared by the kernels (template arguments) and the launcher.
#pragma once

#include <cstddef>

namespace flashmonoid::cuda {

// Two consumer warpgroups of 64 keys each (kBlockN = 128 keys per block). hdim 128 takes 64
// queries per step: Sᵀ and dPᵀ (64 keys, 64 queries) per warpgroup, dK and dV (64 keys, head dim)
// in fp32 registers (128 of the 240), dQ (64, head dim) split in two column halves. hdim 64 takes
// 128 queries (FA3's tile): Sᵀ + dPᵀ are 128 registers, dK + dV 64, dQ (128, 64) split in two row
// halves; it fits the 240 registers with the mask applied in a pass of its own before the exp.
struct BwdTileSm90 {
  int block_m;    // queries per step
  int block_n;    // keys per block: 64 per consumer warpgroup
  int q_stages;   // Q / dO / lse / D ring depth
  int consumer_regs, producer_regs;

  static constexpr int consumers = 2;
  constexpr int threads() const { return 128 * (consumers + 1); }
  // K, V, q_stages × (Q, dO), two dSᵀ (block_n, block_m) buffers in 2-byte elements; the dQ tile
  // and q_stages × (lse, D) rows in fp32; the barriers and the 1024-byte alignment of the panels.
  constexpr std::size_t smem_bytes(int head_dim) const {
    return static_cast<std::size_t>(2 * block_n * head_dim + 2 * q_stages * block_m * head_dim + 2 * block_n * block_m) * 2 +
           static_cast<std::size_t>(block_m * head_dim + 2 * q_stages * block_m) * 4 + 2048;
  }
};

constexpr BwdTileSm90 bwd_tile_sm90(int head_dim_bucket) {
  return BwdTileSm90{head_dim_bucket <= 64 ? 128 : 64, 128, 2, 240, 24};
}

}  // namespace flashmonoid::cuda
