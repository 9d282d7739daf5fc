// Split-KV planning for the sm80 forward: how many splits, and the workspace they need.
#include <algorithm>
#include <cstdint>

#include "sm80/fwd_sm80.hpp"
#include "sm80/tile_fwd_sm80.hpp"

namespace flashmonoid::cuda {
namespace {

constexpr std::size_t kAlign = 256;
constexpr std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The fewest key tiles a split streams: enough that its partial (rows · d fp32, written, then read by
// the combine) stays at most a quarter of the K/V it reads (2 · block_n · d 2-byte values per tile),
// so ceil(4 · rows / block_n), at most kMinTilesPerSplit. Decoding's packed rows (4-16 of the narrow
// tile's 64) then take 1 tile per split, so a short cache fills the resident blocks too: against 4
// tiles per split (H100, graph-replayed, b = 1, plain, append, page 16 and s_q 4) 1k keys +15-29% (plain
// 0.165 against 0.134 of copy), 2k +7-21%, 4k +4-14%.
// Full 64-row and wide tiles keep 4 tiles (256 keys): there a partial is as large as the K/V tile
// it sums.
constexpr int kMinTilesPerSplit = 4;

int min_tiles_per_split(const detail::FwdParams& p, const FwdPlanSm80& plan) {
  const int rows = std::min(p.seqlen_q * plan.pack, plan.tile.block_m);
  return std::clamp((4 * rows + plan.tile.block_n - 1) / plan.tile.block_n, 1, kMinTilesPerSplit);
}

// Split blocks share their row block's key tiles (SharedKeyTiles) where each split would stream at
// least this many. H100, graph-replayed, x copy against fixed splits, contiguous caches: 64-128
// tiles per split +2-3.5% (b = 1 128k 1.018 against 0.990, b = 8 32k 1.038 against 1.010, s_q 4
// +2-3%; blocks alone on a multiprocessor no longer end up to 80 us before the others); 16 tiles
// (b = 1 32k, b = 8 4k) -0.5 to -1.5%: positions are taken ~6 steps before they are read and the
// first kAhead are fixed, so a 16-tile split has little left to balance, and the first take costs a
// round trip. Paged caches keep fixed splits: shared, page 16 and 64 lost 4% at 134 MB and 1% at
// 537 MB (page 64 too, whose tiles are one strided copy as a contiguous cache's; not the block
// table's latency: an L2 prefetch of its lines two or four steps ahead changed nothing).
constexpr int kMinTilesPerSharedSplit = 32;
// Partials grow with the split count (num_splits · h · s_q · d fp32); past 128 splits the combine's
// reads of them start to rival the K/V bytes of short decoding rows.
constexpr int kMaxSplits = 128;

}  // namespace

bool fwd_split_shares_tiles(const detail::FwdParams& p, int num_splits) {
  const FwdPlanSm80 plan = plan_fwd_sm80(p, 0);
  // The shared variant is compiled for the decoding kernels only: hdim <= 128 without score modifiers.
  // Which tiles a block takes, and so the order of its partial's sums, varies run to run: not under
  // Options::deterministic.
  if (num_splits <= 1 || !fwd_cache_tile(plan.kind) || p.kv.block_table != nullptr || p.score_mods() ||
      head_dim_bucket(p.d) > 128 || p.deterministic)
    return false;
  const std::int64_t key_tiles = (static_cast<std::int64_t>(p.seqlen_k) + plan.tile.block_n - 1) / plan.tile.block_n;
  return key_tiles >= static_cast<std::int64_t>(kMinTilesPerSharedSplit) * num_splits;
}

int fwd_split_counters(const detail::FwdParams& p) {
  // The narrow tile's choice does not depend on the device's shared memory (plan_fwd_sm80).
  const FwdPlanSm80 plan = plan_fwd_sm80(p, 0);
  return fwd_cache_tile(plan.kind) ? plan.num_m_blocks * plan.grid_heads * p.batch : 0;
}

std::size_t fwd_split_workspace_bytes(const detail::FwdParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  const std::size_t rows = static_cast<std::size_t>(num_splits) * p.h * p.total_q;
  return align_up(rows * p.d * sizeof(float)) + align_up(rows * sizeof(float)) +
         align_up(static_cast<std::size_t>(fwd_split_counters(p)) * sizeof(unsigned long long));
}

void fwd_split_buffers(const detail::FwdParams& p, int num_splits, void* workspace, float** out_partial,
                       float** lse_partial, unsigned long long** tile_counters) {
  const std::size_t rows = static_cast<std::size_t>(num_splits) * p.h * p.total_q;
  char* base = static_cast<char*>(workspace);
  *out_partial = reinterpret_cast<float*>(base);
  *lse_partial = reinterpret_cast<float*>(base + align_up(rows * p.d * sizeof(float)));
  *tile_counters = reinterpret_cast<unsigned long long*>(base + align_up(rows * p.d * sizeof(float)) +
                                                         align_up(rows * sizeof(float)));
}

// Split only when the unsplit grid cannot give every multiprocessor a block (decoding, short
// prompts with few heads); then fill the blocks that stay resident per multiprocessor (the tile's
// min_blocks: 2 for the narrow tile), one wave at most (rounded down: blocks past one wave stream
// with a fraction of the chip's copies in flight), without giving any split fewer than
// min_tiles_per_split key tiles. Example, decoding b = 1, h = 32, h_k = 8 on 132 SMs: 8 packed
// blocks, 2 · 132 / 8 = 33 splits. Two blocks per SM rather than one: a paged cache's row gather
// issues its copies from the warps that do the products, and one block per SM left page 16 at
// 0.60-0.67x of contiguous (H200, graph-replayed, TB/s of K/V, b <= 8; the same with the pages in
// pool order, so not the scattering); two resident blocks interleave one's copies with the other's
// products: page 16 at 0.89-0.98x, and contiguous +2-4% on the H200 (b = 1 32k 0.649 against 0.627
// of copy, b = 8 128k 1.039 against 1.012). The H100 had measured contiguous 1% the other way
// (b = 1 32k 2.47 against 2.50 TB/s).
int fwd_choose_num_splits(const detail::FwdParams& p, int num_sms, std::size_t smem_per_sm) {
  const FwdPlanSm80 plan = plan_fwd_sm80(p, smem_per_sm);
  const std::int64_t blocks = static_cast<std::int64_t>(plan.num_m_blocks) * plan.grid_heads * p.batch;
  // No block (no query row: the call writes nothing) splits nothing, and divides nothing below.
  if (num_sms <= 0 || blocks <= 0 || blocks >= num_sms) return 1;
  const int key_tiles = (p.seqlen_k + plan.tile.block_n - 1) / plan.tile.block_n;
  // Blocks per SM: the tile's min_blocks where its shared memory lets them (a kv_slots ring counted at
  // its least, 2 slots); sm80's 164 KB holds one narrow block at hdim 128.
  const std::size_t block_smem = plan.tile.smem_bytes(head_dim_bucket(p.d), 2) + kSmemReservedPerBlock;
  const std::int64_t per_sm =
      smem_per_sm > 0 ? std::clamp<std::int64_t>(static_cast<std::int64_t>(smem_per_sm / block_smem), 1, plan.tile.min_blocks)
                      : plan.tile.min_blocks;
  const std::int64_t resident = static_cast<std::int64_t>(num_sms) * per_sm;
  const std::int64_t splits =
      std::min<std::int64_t>({resident / blocks, key_tiles / min_tiles_per_split(p, plan), kMaxSplits});
  return splits > 1 ? static_cast<int>(splits) : 1;
}

}  // namespace flashmonoid::cuda
