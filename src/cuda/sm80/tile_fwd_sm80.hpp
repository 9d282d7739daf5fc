// Tile shapes of the sm80 forward, shared by the kernels (as template arguments) and the host
// planning code (grid size, split heuristic), so both always agree.
#pragma once

#include <algorithm>
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
  // Key tiles of block_n per (K, V) pair stage (pair rings): the copy and the barrier cover `sub`
  // tiles, while the scores and the softmax still run one block_n tile at a time (registers).
  int sub = 1;
  // The warps side by side along each key tile instead of down the rows (the decode tile): every
  // warp computes all block_m rows over its block_n / warps keys with an online softmax of its own,
  // and the warps' states are merged (the monoid's merge) after the mainloop.
  bool warps_on_keys = false;
  // Q, then the K/V ring of 2-byte T: `stages` (K, V) pairs of `sub` tiles, or `slots` single tiles.
  constexpr std::size_t smem_bytes(int head_dim, int slots = 0) const {
    const int ring_tiles = kv_slots ? slots : 2 * stages * sub;
    return static_cast<std::size_t>(block_m + block_n * ring_tiles) * head_dim * 2;
  }
};

// The head-dim buckets of every kernel family (d pads up to its bucket inside the kernels).
constexpr int head_dim_bucket(int d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }

// Query rows (times GQA pack) at or below which the "narrow" tile runs: decoding and short
// prompts, where a 128-row block would mostly compute padding.
inline constexpr int kFwdNarrowRows = 64;

// Which tile a launch uses: wide (prefill, training), narrow (decoding, short prompts), or the wide
// tile for devices whose multiprocessors hold two larger blocks (fwd_large_smem_tile: sm90's 228 KB).
// decode: at most 16 query rows (times GQA pack), hdim <= 128, no dropout: the narrow tile's ring
// with its 4 warps splitting each 64-key tile (warps_on_keys).
enum class FwdTileKind : int { wide, narrow, wide_large_smem, decode };
// The tiles that read K/V through a KV cache's batch index or block table and may run under an
// append (pdl.cuh): narrow and decode.
constexpr bool fwd_cache_tile(FwdTileKind kind) { return kind == FwdTileKind::narrow || kind == FwdTileKind::decode; }

// hdim 64 and 128: FlashAttention-2's layout, 4 warps of 32 query rows (2 m tiles), so every K/V
// fragment read from shared memory feeds two MMAs: 160-192 bytes of shared memory per MMA instead
// of 256 with 16 rows per warp (device run 1 measured 0.63-0.78x of FA2 there, shared-memory bound).
// O is kHeadDim / 2 fp32 registers per thread and 2 blocks fit per multiprocessor (255 registers).
// Q is re-read from shared memory per step (in registers it spilled 52 bytes in the score-mod
// variant at hdim 64). hdim 64 takes 64 keys (128: S 128 + O 64 spilled 160 bytes), hdim 128 32
// keys (64: O 128 + S 64 spilled 40 bytes; ptxas, 255 registers). hdim 256: O at 2 m tiles would be
// 256 registers, so warps of 16 rows, 64 keys per step as FlashAttention-2.
// - wide_large_smem (sm90): 64 rows, 4 warps, 2 blocks per multiprocessor, each with Q 32 KB and a
//   2-slot K/V ring (96 KB): V's copy overlaps Q·Kᵀ and the next K's overlaps softmax and P·V. Two
//   independent 4-warp blocks instead of one 8-warp block: one block's barriers no longer stall every
//   warp of the SM. FlashAttention-2 runs this tile on H100 (ncu, 4k: 1.65 ms against our 8-warp
//   128-row block's 1.92 ms, both 16k tokens, hidden 2048).
// - wide (sm80): 128 rows, 8 warps, one block per multiprocessor. A 64-key (K, V) pair is 64 KB, so
//   pairs double-buffered (Q 64 KB + 128 KB) would not fit sm80's 163 KB: K and V are single 32 KB
//   slots of one ring instead, 3 on sm80 (160 KB), waited on separately (253 registers, no spill).
// The other tiles stream K/V as (K, V) pairs (one barrier per step; the next pair's copy overlaps
// the whole step): Q 32 KB + 2 · 16 KB at hdim 128, so 2 blocks per multiprocessor; hdim 128's
// wide_large_smem tile puts two 32-key tiles in each stage (96 KB, see fwd_large_smem_tile).
// Narrow (decoding, short prompts): 4 warps of 16 rows, at most 255 registers so that 2 blocks fit;
// 3 stages at hdim <= 128 (2 tiles, 64 KB, in flight per block: one 16 KB tile per block was under
// the ~35 KB per multiprocessor that 3 TB/s needs at ~1.5 us latency), 2 at hdim 256 (96 KB).
// Decode: 16 rows, 4 warps of 16 keys each per 64-key tile, the narrow tile's 3 stages. In decoding
// (4-16 packed rows) the narrow tile's warps 1-3 hold no row and wait at its barriers while warp 0
// runs every product of a tile; cuDNN's decoding kernel splits its tiles' keys over its warps
// (1x4x1) and its forward ran 11.6 us against the narrow tile's 15.4 at b = 1, 4k keys (H100, ncu).
// Measured against the narrow tile (H100, graph-replayed): +8-13% at b = 1 4k, +3-5% at the 134 MB
// shapes, +1-3% from 537 MB. 128-key tiles (2 stages, 1 block per multiprocessor) were within 1.5%
// of it on contiguous caches and 2-6% slower on paged ones; 8 warps of 16 keys 5-14% slower at b = 1.
// hdim 256 keeps the narrow tile: a decode block there (139-205 KB, or 2 warps on 32-key tiles) fits
// once per multiprocessor, and lost up to 16% on paged caches and 7% at s_q 4 (H100).
inline constexpr int kFwdDecodeRows = 16;
constexpr FwdTileSm80 fwd_tile_sm80(int head_dim_bucket, FwdTileKind kind) {
  if (kind == FwdTileKind::decode && head_dim_bucket <= 128) return FwdTileSm80{16, 64, 4, 2, true, 3, false, 1, true};
  if (kind == FwdTileKind::narrow || kind == FwdTileKind::decode)
    return head_dim_bucket <= 128 ? FwdTileSm80{64, 64, 4, 2, true, 3, false} : FwdTileSm80{64, 32, 4, 2, false, 2, false};
  const bool large = kind == FwdTileKind::wide_large_smem;
  if (head_dim_bucket <= 64) return {128, 64, 4, 2, false, 2, false};
  if (head_dim_bucket <= 128) return {128, 32, 4, 2, false, 2, false, large ? 2 : 1};
  return large ? FwdTileSm80{64, 64, 4, 2, false, 0, true} : FwdTileSm80{128, 64, 8, 1, false, 0, true};
}

// The runtime reserves 1 KB of shared memory per resident block.
inline constexpr std::size_t kSmemReservedPerBlock = 1024;

// Whether a call takes the wide_large_smem tile: the device keeps min_blocks of its blocks resident
// (smem_per_sm bytes per multiprocessor; hdim 256: Q + 2 slots), and at hdim 128 the blocks visit
// enough keys. hdim 128's tile is the wide one with 2 key tiles of 32 per stage (96 KB): one barrier
// per 64 keys. Measured on H100 (bf16, 16k tokens, TFLOP/s, against the 1-tile stage in the same
// run): +1.7-2.0% at s >= 4k non-causal (16k: 353 vs 347), +1-2% causal at 2k-16k, equal at 2k
// non-causal, but -1% at 512-1k and -10% causal at 512 (137 vs 152: a longer pipeline fill on
// 4-16 key tiles per block), hence s_k >= 2048. hdim 64 (64-key tiles, 2 per stage) lost 1-16%
// everywhere and keeps its one-tile stages.
inline constexpr int kFwdLargeSmemMinKeysHdim128 = 2048;
inline bool fwd_large_smem_tile(int head_dim_bucket, std::size_t smem_per_sm, int seqlen_k) {
  if (head_dim_bucket == 64 || (head_dim_bucket == 128 && seqlen_k < kFwdLargeSmemMinKeysHdim128)) return false;
  const FwdTileSm80 t = fwd_tile_sm80(head_dim_bucket, FwdTileKind::wide_large_smem);
  return smem_per_sm >= t.min_blocks * (t.smem_bytes(head_dim_bucket, 2) + kSmemReservedPerBlock);
}

// Slots of a kv_slots ring: as many as fit in a block's share of the multiprocessor (min_blocks
// resident) and the per-block opt-in limit, at most 5 (two whole steps ahead). One resident block
// needs 3 (while one tile is read the next two are in flight, as many tiles as a 2-stage pair ring
// has); with two resident blocks 2 suffice, since the other block's copies overlap this one's waits.
// A device below that minimum gets it anyway and the launch reports the device's limit.
inline int fwd_kv_slots(const FwdTileSm80& tile, int head_dim, std::size_t smem_optin, std::size_t smem_per_sm) {
  const std::size_t q_bytes = tile.smem_bytes(head_dim, 0), slot_bytes = static_cast<std::size_t>(tile.block_n) * head_dim * 2;
  std::size_t budget = smem_optin;
  if (smem_per_sm > 0) budget = std::min(budget, smem_per_sm / tile.min_blocks - kSmemReservedPerBlock);
  const std::size_t fit = budget > q_bytes ? (budget - q_bytes) / slot_bytes : 0;
  const std::size_t least = tile.min_blocks >= 2 ? 2 : 3;
  return static_cast<int>(std::clamp<std::size_t>(fit, least, 5));
}

// How a call maps onto blocks: the tile, GQA packing, and the grid (x: query blocks · splits,
// y: heads / pack, z: batch).
struct FwdPlanSm80 {
  FwdTileKind kind = FwdTileKind::wide;
  FwdTileSm80 tile{};
  int pack = 1;
  int num_m_blocks = 0;
  int grid_heads = 0;
};

// Pack the query heads of a KV head into one block's rows when s_q alone would fill less than a
// narrow tile (decoding): K and V are then read once per KV head instead of once per query head.
// smem_per_sm (the device's shared memory per multiprocessor) decides between the two wide tiles.
inline FwdPlanSm80 plan_fwd_sm80(const detail::FwdParams& p, std::size_t smem_per_sm) {
  FwdPlanSm80 plan;
  plan.pack = p.group() > 1 && p.seqlen_q < kFwdNarrowRows ? p.group() : 1;
  const int rows = p.seqlen_q * plan.pack;
  const int bucket = head_dim_bucket(p.d);
  // KV caches (batch index, pages) are read by the narrow tile only (kernel_fwd_sm80.cuh:
  // load_keys), long query blocks too (paged prefill, chunked prefill).
  if (rows <= kFwdNarrowRows || p.kv.active || p.kv.block_table != nullptr)
    plan.kind = rows <= kFwdDecodeRows && bucket <= 128 && p.dropout_p == 0.0f ? FwdTileKind::decode : FwdTileKind::narrow;
  else if (fwd_large_smem_tile(bucket, smem_per_sm, p.seqlen_k))
    plan.kind = FwdTileKind::wide_large_smem;
  plan.tile = fwd_tile_sm80(bucket, plan.kind);
  plan.num_m_blocks = (rows + plan.tile.block_m - 1) / plan.tile.block_m;
  plan.grid_heads = p.h / plan.pack;
  return plan;
}

}  // namespace flashmonoid::cuda
