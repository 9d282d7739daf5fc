// Split-KV planning for the sm80 forward: how many splits, and the workspace they need.
#include <algorithm>
#include <cstdint>

#include "sm80/fwd_sm80.hpp"
#include "sm80/tile_fwd_sm80.hpp"

namespace flashmonoid::cuda {
namespace {

constexpr std::size_t kAlign = 256;
constexpr std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A split should still stream several key tiles, so that its fixed cost (Q load, partial write,
// its share of the combine) stays small next to the K/V it reads: 4 tiles = 256 keys.
constexpr int kMinTilesPerSplit = 4;
// Partials grow with the split count (num_splits · h · s_q · d fp32); past 128 splits the combine's
// reads of them start to rival the K/V bytes of short decoding rows.
constexpr int kMaxSplits = 128;

}  // namespace

std::size_t fwd_split_workspace_bytes(const detail::FwdParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  const std::size_t rows = static_cast<std::size_t>(num_splits) * p.h * p.total_q;
  return align_up(rows * p.d * sizeof(float)) + align_up(rows * sizeof(float));
}

void fwd_split_buffers(const detail::FwdParams& p, int num_splits, void* workspace, float** out_partial,
                       float** lse_partial) {
  const std::size_t rows = static_cast<std::size_t>(num_splits) * p.h * p.total_q;
  *out_partial = static_cast<float*>(workspace);
  *lse_partial = reinterpret_cast<float*>(static_cast<char*>(workspace) + align_up(rows * p.d * sizeof(float)));
}

// Split only when the unsplit grid cannot give every multiprocessor a block (decoding, short
// prompts with few heads); then fill the blocks that stay resident per multiprocessor (the tile's
// min_blocks: 2 for the narrow tile), one wave at most (rounded down: blocks past one wave stream
// with a fraction of the chip's copies in flight), without giving any split fewer than
// kMinTilesPerSplit key tiles. Example, decoding b = 1, h = 32, h_k = 8 on 132 SMs: 8 packed
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
  if (num_sms <= 0 || blocks >= num_sms) return 1;
  const int key_tiles = (p.seqlen_k + plan.tile.block_n - 1) / plan.tile.block_n;
  // Blocks per SM: the tile's min_blocks where its shared memory lets them (a kv_slots ring counted at
  // its least, 2 slots); sm80's 164 KB holds one narrow block at hdim 128.
  const std::size_t block_smem = plan.tile.smem_bytes(head_dim_bucket(p.d), 2) + kSmemReservedPerBlock;
  const std::int64_t per_sm =
      smem_per_sm > 0 ? std::clamp<std::int64_t>(static_cast<std::int64_t>(smem_per_sm / block_smem), 1, plan.tile.min_blocks)
                      : plan.tile.min_blocks;
  const std::int64_t resident = static_cast<std::int64_t>(num_sms) * per_sm;
  const std::int64_t splits = std::min<std::int64_t>({resident / blocks, key_tiles / kMinTilesPerSplit,
                                                      kMaxSplits});
  return splits > 1 ? static_cast<int>(splits) : 1;
}

}  // namespace flashmonoid::cuda
