// Tile shapes of the sm90 backward, shared by the kernels (template arguments) and the launcher.
#pragma once

#include <cstddef>

#include "flashmonoid/detail/host_device.hpp"
#include "sm90/setmaxnreg.hpp"

namespace flashmonoid::cuda {

// Two consumer warpgroups. Up to hdim 128 they split the keys: 64 each (kBlockN = 128 keys per
// block), dK and dV of their keys over the whole head dim in fp32 registers. hdim 128 takes 64
// queries per step: Sᵀ and dPᵀ (64 keys, 64 queries) per warpgroup, dK and dV 128 of the 232
// registers, dQ (64, head dim) split in two column halves. hdim 64 takes 128 queries (FA3's tile):
// Sᵀ + dPᵀ are 128 registers, dK + dV 64, dQ (128, 64) split in two row halves; it fits the 232
// registers with the mask applied in a pass of its own before the exp. Their producer warpgroup (the
// loads and the dQ writer, walking the persistent kernel's work items) takes 40: with 24 (and the
// consumers 240) ptxas spilled 8-48 bytes at hdim 64 / 128. hdim 256 keeps 240 / 24: with 232 its
// consumers' wgmma were serialised (C7512).
//
// hdim 256 (head_split): dK and dV of 64 keys × 256 would be 256 registers per thread, so the
// consumers split the head dim instead: both own all 64 keys, each dK and dV of one 128-column
// half (128 registers), and Sᵀ, dPᵀ of one half of the step's 64 queries (N = 32), shared with the
// other consumer through shared memory (Pᵀ and dSᵀ, two buffers each). dQ goes from registers to
// the accumulator with vector reductions: a staged (64, 256) fp32 tile would not fit beside K, V
// and two Q/dO stages (227 KB).
struct BwdTileSm90 {
  int block_m;    // queries per step
  int block_n;    // keys per block
  int q_stages;   // Q / dO / lse / D ring depth
  int consumer_regs, producer_regs;
  bool head_split;

  static constexpr int consumers = 2;
  constexpr int threads() const { return 128 * (consumers + 1); }
  constexpr bool registers_fit() const { return setmaxnreg_fits(threads(), producer_regs, consumers, consumer_regs); }
  // 2-byte element buffers of (block_n, block_m): dSᵀ × 2, and with head_split Pᵀ × 2 as well.
  constexpr int score_buffers() const { return head_split ? 4 : 2; }
  // fp32 dQ staging tile (block_m, head dim) for the bulk reductions; none with head_split.
  constexpr int dq_stage_floats(int head_dim) const { return head_split ? 0 : block_m * head_dim; }
  // K, V, q_stages × (Q, dO), the score buffers in 2-byte elements; the dQ tile and q_stages ×
  // (lse, D) rows in fp32; the dropout keep bits of a step (block_m × block_n bits); the barriers
  // (at most 64 bytes) and the 1024-byte alignment of the panels.
  constexpr std::size_t smem_bytes(int head_dim) const {
    return static_cast<std::size_t>(2 * block_n * head_dim + 2 * q_stages * block_m * head_dim + score_buffers() * block_n * block_m) * 2 +
           static_cast<std::size_t>(dq_stage_floats(head_dim) + 2 * q_stages * block_m) * 4 + block_m * block_n / 8 + 1024 + 64;
  }
};

constexpr BwdTileSm90 bwd_tile_sm90(int head_dim_bucket) {
  if (head_dim_bucket > 128) return BwdTileSm90{64, 64, 2, 240, 24, true};
  return BwdTileSm90{head_dim_bucket <= 64 ? 128 : 64, 128, 2, 232, 40, false};
}

// The (key block, batch · KV head) of linear block `block` (BwdWork): with group_heads = 0 key blocks
// fastest within each batch · KV head; else groups of group_heads batch · KV heads (the last one may
// be smaller), key block major within a group (launch_bwd_sm90.cuh: bwd_group_heads says why).
// Unsigned arithmetic: signed divisions here cost the hdim-128 score-modifier kernel a 4-byte spill.
struct BwdBlockCoords {
  unsigned n_block, batch_head;
};
FM_HD constexpr BwdBlockCoords bwd_block_coords(unsigned block, unsigned n_blocks, unsigned batch_heads,
                                                              unsigned group_heads) {
  if (group_heads == 0) return {block % n_blocks, block / n_blocks};
  const unsigned group_blocks = group_heads * n_blocks, g = block / group_blocks, r = block - g * group_blocks;
  const unsigned rest = batch_heads - g * group_heads, heads = rest < group_heads ? rest : group_heads;
  const unsigned n_block = r / heads;
  return {n_block, g * group_heads + (r - n_block * heads)};
}

// Compile-time check of the order on small grids: every (key block, batch · KV head) once, and each
// head's key blocks in increasing block index (the deterministic backward's dQ turns wait only for
// lower key blocks of the same head, which must have been launched first).
constexpr bool bwd_block_order_ok(unsigned n_blocks, unsigned batch_heads, unsigned group_heads) {
  constexpr unsigned kMax = 256;
  if (n_blocks * batch_heads > kMax) return false;
  bool seen[kMax] = {};
  int last[kMax] = {};
  for (unsigned h = 0; h < batch_heads; ++h) last[h] = -1;
  for (unsigned block = 0; block < n_blocks * batch_heads; ++block) {
    const BwdBlockCoords c = bwd_block_coords(block, n_blocks, batch_heads, group_heads);
    if (c.n_block >= n_blocks || c.batch_head >= batch_heads) return false;
    const unsigned cell = c.batch_head * n_blocks + c.n_block;
    if (seen[cell] || static_cast<int>(c.n_block) <= last[c.batch_head]) return false;
    seen[cell] = true;
    last[c.batch_head] = static_cast<int>(c.n_block);
  }
  return true;
}
static_assert(bwd_block_order_ok(4, 10, 0) && bwd_block_order_ok(4, 10, 3) && bwd_block_order_ok(7, 5, 5) &&
                  bwd_block_order_ok(16, 9, 4) && bwd_block_order_ok(1, 1, 1) && bwd_block_order_ok(3, 8, 8) &&
                  bwd_block_order_ok(5, 12, 7),
              "BwdWork's block order visits every (key block, head) once, each head's key blocks in order");

static_assert(bwd_tile_sm90(256).smem_bytes(256) <= kSmemPerBlockSm90, "hdim 256 fits the H100's 227 KB per block");

}  // namespace flashmonoid::cuda
