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
// prompts with few heads); then give each multiprocessor one block, num_sms blocks at most (rounded
// down: blocks past one wave stream with a fraction of the chip's copies in flight), without giving
// any split fewer than kMinTilesPerSplit key tiles. Example, decoding b = 1, h = 32, h_k = 8 on
// 132 SMs: 8 packed blocks, 132 / 8 = 16 splits. One block per SM rather than the 2 that fit: a
// sweep of forced split counts (H100, hdim 128, graph-replayed, TB/s of K/V) gave at b = 1 32k
// 2.50 for 16 splits against 2.47 for 33 (2 per SM), 2.48 for 12, 2.27-2.40 for 20-28; at 128k
// 2.98 against 2.94; at b = 8 (64 packed blocks) 32k 3.04 for 2 splits against 3.01 for 4, 2.93
// for 32; 128k 3.12 against 3.08. Fewer, longer splits also leave the combine fewer partials.
int fwd_choose_num_splits(const detail::FwdParams& p, int num_sms, std::size_t smem_per_sm) {
  const FwdPlanSm80 plan = plan_fwd_sm80(p, smem_per_sm);
  const std::int64_t blocks = static_cast<std::int64_t>(plan.num_m_blocks) * plan.grid_heads * p.batch;
  if (num_sms <= 0 || blocks >= num_sms) return 1;
  const int key_tiles = (p.seqlen_k + plan.tile.block_n - 1) / plan.tile.block_n;
  const std::int64_t splits = std::min<std::int64_t>({num_sms / blocks, key_tiles / kMinTilesPerSplit,
                                                      kMaxSplits});
  return splits > 1 ? static_cast<int>(splits) : 1;
}

}  // namespace flashmonoid::cuda
