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
  int stages;           // K/V ring depth: stages - 1 (K, V) pairs in flight while one is computed
  // K and V as separate slots of one ring (a barrier before each product), the slot count picked at
  // run time from the device's shared memory (fwd_kv_slots); `stages` is then unused.
  bool kv_slots;
  // Q, then the K/V ring of 2-byte T: `stages` (K, V) pairs, or `slots` single tiles.
  constexpr std::size_t smem_bytes(int head_dim, int slots = 0) const {
    const int ring_tiles = kv_slots ? slots : 2 * stages;
    return static_cast<std::size_t>(block_m + block_n * ring_tiles) * head_dim * 2;
  }
};

constexpr int fwd_head_dim_bucket(int d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }

// Query rows (times GQA pack) at or below which the "narrow" tile runs: decoding and short
// prompts, where a 128-row block would mostly compute padding.
inline constexpr int kFwdNarrowRows = 64;

// hdim 64 and 128: FlashAttention-2's layout, 4 warps of 32 query rows (2 m tiles), so every K/V
// fragment read from shared memory feeds two MMAs: 160-192 bytes of shared memory per MMA instead
// of 256 with 16 rows per warp (device run 1 measured 0.63-0.78x of FA2 there, shared-memory bound).
// O is kHeadDim / 2 fp32 registers per thread and 2 blocks fit per multiprocessor (255 registers).
// Q is re-read from shared memory per step (in registers it spilled 52 bytes in the score-mod
// variant at hdim 64). hdim 64 takes 64 keys (128: S 128 + O 64 spilled 160 bytes), hdim 128 32
// keys (64: O 128 + S 64 spilled 40 bytes; ptxas, 255 registers). hdim 256: O at 2 m tiles would be
// 256 registers, so 8 warps of 16 rows. 64 keys per step as FlashAttention-2 (253 registers, no
// spill since the LdsmLane addresses; 32 keys read 320 bytes of shared memory per MMA against 288
// and rescaled O twice as often, device run 2: 0.78-0.98x of FA2). A 64-key (K, V) pair is 64 KB,
// so pairs double-buffered (Q 64 KB + 128 KB) would not fit sm80's 163 KB: K and V are single 32 KB
// slots of one ring instead, 3 on sm80 (160 KB), 5 on sm90 (224 of 227 KB), waited on separately.
// The other tiles stream K/V as (K, V) pairs (one barrier per step; the next pair's copy overlaps
// the whole step): Q 32 KB + 2 · 16 KB at hdim 128, so 2 blocks per multiprocessor.
// Narrow (decoding, short prompts): 4 warps of 16 rows, at most 255 registers so that 2 blocks fit;
// 3 stages at hdim <= 128 (2 tiles, 64 KB, in flight per block: one 16 KB tile per block was under
// the ~35 KB per multiprocessor that 3 TB/s needs at ~1.5 us latency), 2 at hdim 256 (96 KB).
constexpr FwdTileSm80 fwd_tile_sm80(int head_dim_bucket, bool narrow) {
  if (narrow)
    return head_dim_bucket <= 128 ? FwdTileSm80{64, 64, 4, 2, true, 3, false} : FwdTileSm80{64, 32, 4, 2, false, 2, false};
  if (head_dim_bucket <= 64) return {128, 64, 4, 2, false, 2, false};
  if (head_dim_bucket <= 128) return {128, 32, 4, 2, false, 2, false};
  return {128, 64, 8, 1, false, 0, true};
}

// Slots of a kv_slots ring on a device with smem_optin bytes of shared memory per block: as many as
// fit, from 3 (while one tile is read the next two are in flight, as many tiles as a 2-stage pair
// ring has) to 5 (two whole steps ahead). Fewer than 3 fit nowhere this tile runs (it needs 160 KB):
// the launch then reports the device's limit.
inline int fwd_kv_slots(const FwdTileSm80& tile, int head_dim, std::size_t smem_optin) {
  const std::size_t q_bytes = tile.smem_bytes(head_dim, 0), slot_bytes = static_cast<std::size_t>(tile.block_n) * head_dim * 2;
  const std::size_t fit = smem_optin > q_bytes ? (smem_optin - q_bytes) / slot_bytes : 0;
  return fit < 3 ? 3 : (fit > 5 ? 5 : static_cast<int>(fit));
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
