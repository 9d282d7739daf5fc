// Light interface of the sm90 (wgmma + TMA) backward for src/cuda/api.cu: which calls it runs, its
// workspace, and the launcher (launch_bwd_sm90.cuh, instantiated one (dtype, head-dim bucket) per
// file under src/cuda/generated/, compiled for sm_90a only).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "api/params.hpp"
#include "sm80/bwd_sm80.hpp"
#include "sm80/tile_fwd_sm80.hpp"
#include "sm90/tile_bwd_sm90.hpp"

namespace flashmonoid::cuda {

// No KV cache, deterministic only up to hdim 128 (above it dQ is added with unordered vector
// reductions), softcap/ALiBi/dropout above hdim 64 (at 64 the 128-query tile's modifier variant
// spills): the rest runs the sm80 backward.
inline bool bwd_sm90_eligible(const detail::BwdParams& p) {
  const bool cache = p.kv.active || p.kv.block_table != nullptr;
  return p.d <= 256 && !cache && !(p.deterministic && p.d > 128) && !(p.score_mods() && p.d <= 64);
}

// The workspace, fp32, each part 256-byte aligned. Query rows are padded per sequence to whole
// blocks of block_m rows (`rows` per head covers them all: sequence b starts at block
// cu_seqlens_q[b] / block_m + b, see kernel_bwd_sm90.cuh's padded_row0):
//   lse    (h, rows)  lse·log2(e) of each query row; +inf on padding rows and rows that saw no key,
//                     so that their P = exp2(s - lse) is 0
//   dsum   (h, rows)  D = rowsum(dO∘O), 0 on padding rows
//   dq_acc (h, rows, bucket)  dQ of each query block in the consumers' fragment order (the
//                     convert kernel undoes it), added to by the key blocks with bulk reductions
//   dq_sem (h, rows / block_m) int32: in the deterministic mode, how many key blocks have added
//                     into each query block's dQ so far (they add in increasing key-block order)
//   work_next  int32: the persistent main kernel's next work item (cleared by the pre-pass, taken
//                     with atomicAdd)
struct BwdWorkspaceLayoutSm90 {
  std::int64_t rows = 0;
  int dq_cols = 0;
  std::size_t lse = 0, dsum = 0, dq_acc = 0, dq_sem = 0, work_next = 0, total = 0;
};

inline BwdWorkspaceLayoutSm90 bwd_workspace_layout_sm90(const detail::BwdParams& p) {
  auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
  BwdWorkspaceLayoutSm90 w;
  w.dq_cols = head_dim_bucket(p.d);
  const std::int64_t block_m = bwd_tile_sm90(w.dq_cols).block_m;
  w.rows = (static_cast<std::int64_t>(p.total_q) + block_m * (p.batch + 1) + block_m - 1) / block_m * block_m;
  const std::size_t n = static_cast<std::size_t>(p.h) * static_cast<std::size_t>(w.rows);
  w.lse = 0;
  w.dsum = align(n * sizeof(float));
  w.dq_acc = w.dsum + align(n * sizeof(float));
  w.dq_sem = w.dq_acc + align(n * static_cast<std::size_t>(w.dq_cols) * sizeof(float));
  w.work_next = w.dq_sem + align(n / static_cast<std::size_t>(block_m) * sizeof(int));
  w.total = w.work_next + align(sizeof(int));
  return w;
}

// Queue the backward on launch.stream (never synchronises, never allocates). kHeadDim is 64, 128 or 256.
template <class T, int kHeadDim>
void run_bwd_sm90(const detail::BwdParams& params, const BwdLaunch& launch);

}  // namespace flashmonoid::cuda
