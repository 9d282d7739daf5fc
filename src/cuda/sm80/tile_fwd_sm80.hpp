// Tile shapes of the sm80 forward, shared by the kernels (as template arguments) and the host
// planning code (grid size, split heuristic), so both always agree.
#pragma once

#include <cstddef>

#include "api/params.hpp"

namespace flashmonoid::cuda {

struct FwdTileSm80 {
  int block_m;  // query rows per block: 16 per m tile, kMTiles tiles per warp
  int block_n;  // keys per mainloop step
  int warps;
  int min_blocks;  // blocks per multiprocessor to keep resident: caps registers at 64K / (threads · this)
  bool q_in_registers;  // Q's A fragments loaded once (head_dim / 4 registers) instead of every step
  constexpr std::size_t smem_bytes(int head_dim) const {
    return static_cast<std::size_t>(block_m + 2 * block_n) * head_dim * 2;  // Q, K, V tiles of 2-byte T
  }
};

constexpr int fwd_head_dim_bucket(int d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }

// Query rows (times GQA pack) at or below which the "narrow" tile runs: decoding and short
// prompts, where a 128-row block would mostly compute padding.
inline constexpr int kFwdNarrowRows = 64;

// Every warp owns 16 query rows (one m16 tile), 8 warps a block. Two m tiles per warp
// (FlashAttention-2's layout) would let each K/V fragment feed two MMAs, but O (128) + S (64) fp32
// registers at hdim 128 plus addressing spilled under the 255-register cap (ptxas: 356 bytes).
// With one m tile the warp keeps its Q fragments in registers (hdim / 4 of them) up to hdim 128,
// so only K and V are read from shared memory. ptxas then uses 227-253 registers, so one 8-warp
// block per multiprocessor; capping at 128 registers for two blocks spilled 40-300 bytes.
// hdim 64 takes 128 keys per step to halve the per-step softmax and barrier cost; hdim 256 takes
// 32 (64 spilled 40 bytes next to its 128-register O). Narrow: 4 warps for decoding and short
// prompts, at most 255 registers so that 2 blocks fit; 32 keys at hdim 256 (64 spilled 88 bytes).
constexpr FwdTileSm80 fwd_tile_sm80(int head_dim_bucket, bool narrow) {
  if (narrow) return {64, head_dim_bucket <= 128 ? 64 : 32, 4, 2, head_dim_bucket <= 128};
  if (head_dim_bucket <= 64) return {128, 128, 8, 1, true};
  if (head_dim_bucket <= 128) return {128, 64, 8, 1, true};
  return {128, 32, 8, 1, false};
}

// How a call maps onto blocks: the tile, GQA packing, and the grid (x: query blocks · splits,
// y: heads / pack, z: batch).
struct FwdPlanSm80 {
  bool narrow = false;
  FwdTileSm80 tile{};
  int pack = 1;
  int num_m_blocks = 0;
  int grid_heads = 0;
};

// Pack the query heads of a KV head into one block's rows when s_q alone would fill less than a
// narrow tile (decoding): K and V are then read once per KV head instead of once per query head.
inline FwdPlanSm80 plan_fwd_sm80(const detail::FwdParams& p) {
  FwdPlanSm80 plan;
  plan.pack = p.group() > 1 && p.seqlen_q < kFwdNarrowRows ? p.group() : 1;
  const int rows = p.seqlen_q * plan.pack;
  plan.narrow = rows <= kFwdNarrowRows;
  plan.tile = fwd_tile_sm80(fwd_head_dim_bucket(p.d), plan.narrow);
  plan.num_m_blocks = (rows + plan.tile.block_m - 1) / plan.tile.block_m;
  plan.grid_heads = p.h / plan.pack;
  return plan;
}

}  // namespace flashmonoid::cuda
