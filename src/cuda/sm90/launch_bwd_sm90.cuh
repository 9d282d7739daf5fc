// run_bwd_sm90<T, kHeadDim>: workspace, tensor maps and the three launches of the sm90 backward
// (kernel_bwd_sm90.cuh). Included only by the generated instantiation files (compiled for sm_90a).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "common/check.cuh"
#include "common/device_props.cuh"
#include "flashmonoid/error.hpp"
#include "sm90/bwd_sm90.hpp"
#include "sm90/kernel_bwd_sm90.cuh"
#include "sm90/tensor_map.hpp"
#include "sm90/tile_bwd_sm90.hpp"

namespace flashmonoid::cuda {

// The backward's block order (BwdWork). Without a causal-like mask every key block visits the same
// query blocks: key blocks fastest, so the blocks running together share one head's Q, dO and dQ rows
// in L2. Under one (window_right >= 0) the first key blocks of a head are the longest and the last
// ones a single query block; in that order the last heads' longest blocks start last and run on
// alone at the end (a greedy model of 132 multiprocessors: 5-6% of the backward at hdim 128 / 256,
// 512-8k keys). So the heads go in groups whose Q, dO and fp32 dQ rows fit a third of the H100's L2,
// key block major within a group (the same model: within 2% of the ideal). H100, causal, against
// key blocks fastest: hdim 256 +2-5% at 1k-4k, hdim 128 +2-3% at 2k-8k, equal elsewhere; hdim 64 -6%
// / -4% at 512 / 1k (its blocks are 1-4 steps long), so it keeps key blocks fastest.
inline constexpr long long kBwdGroupL2Bytes = 16ll << 20;
inline int bwd_group_heads(const detail::FwdParams& p, int head_dim_bucket) {
  if (p.window_right < 0 || head_dim_bucket < 128) return 0;
  const long long per_head = static_cast<long long>(p.h / p.h_k) * p.seqlen_q * head_dim_bucket * (2 + 2 + 4);
  const long long heads = kBwdGroupL2Bytes / (per_head > 0 ? per_head : 1);
  return heads < 1 ? 1 : static_cast<int>(heads < p.batch * p.h_k ? heads : p.batch * p.h_k);
}

// The main kernel's blocks for `items` work items: one per multiprocessor less launch.sm_margin (at
// least one), or one per item where the launch is not persistent (Context::persistent_kernels: the
// ring runs the backward so beside an exchange, so that NCCL's kernels get SMs as blocks retire);
// either way at most FLASHMONOID_SM90_BWD_BLOCKS (tests: a few blocks then walk many work items each
// on small shapes; read at every call). Every block takes its items from the counter, so the grid
// changes where an item runs, never what it computes.
inline int bwd_main_blocks(const BwdLaunch& launch, int items) {
  const int sms = launch.sm_margin < launch.num_sms ? launch.num_sms - launch.sm_margin : 1;
  int blocks = launch.persistent && sms < items ? sms : items;
  if (const char* env = std::getenv("FLASHMONOID_SM90_BWD_BLOCKS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || n < 1)
      throw Error("FLASHMONOID_SM90_BWD_BLOCKS", std::string("must be a positive integer (or unset), got '") + env + "'");
    if (n < blocks) blocks = static_cast<int>(n);
  }
  return blocks;
}

template <class T, int kHeadDim>
void run_bwd_sm90(const detail::BwdParams& p, const BwdLaunch& launch) {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "the sm90 backward takes head-dim buckets 64, 128, 256");
  constexpr BwdTileSm90 kTile = bwd_tile_sm90(kHeadDim);
  const BwdWorkspaceLayoutSm90 ws = bwd_workspace_layout_sm90(p);
  if (launch.workspace_bytes < ws.total || (ws.total > 0 && launch.workspace == nullptr))
    throw Error("context.workspace", "the CUDA backward needs " + std::to_string(ws.total) +
                                         " bytes (backward_workspace_size), got " + std::to_string(launch.workspace_bytes));
  if (p.total_q == 0 || p.batch == 0 || p.h == 0 || p.seqlen_q == 0) return;

  auto* base = static_cast<unsigned char*>(launch.workspace);
  float* lse = reinterpret_cast<float*>(base + ws.lse);
  float* dsum = reinterpret_cast<float*>(base + ws.dsum);
  float* dq_acc = reinterpret_cast<float*>(base + ws.dq_acc);
  int* dq_sem = reinterpret_cast<int*>(base + ws.dq_sem);
  int* work_next = reinterpret_cast<int*>(base + ws.work_next);

  constexpr int kRowsPerBlock = sm90::RowThread<kHeadDim>::kRowsPerBlock;
  const int padded_q = (p.seqlen_q + kTile.block_m - 1) / kTile.block_m * kTile.block_m;
  const dim3 row_grid((padded_q + kRowsPerBlock - 1) / kRowsPerBlock, p.h, p.batch);
  bwd_preprocess_sm90<T, kHeadDim><<<row_grid, 256, 0, launch.stream>>>(p, lse, dsum, dq_acc, dq_sem, work_next, ws.rows);
  FM_CUDA_CHECK_LAUNCH();

  if (p.seqlen_k > 0) {
    BwdKernelArgsSm90 args;
    args.p = p;
    args.dq_acc = dq_acc;
    args.dq_sem = dq_sem;
    args.work_next = work_next;
    args.rows = ws.rows;
    const bool varlen = p.is_varlen();
    const int batch = varlen ? 1 : p.batch;
    const std::int64_t q_rows = varlen ? p.total_q : p.seqlen_q;
    const std::int64_t k_rows = varlen ? p.total_k : p.seqlen_k;
    args.tm_q = sm90::make_tensor_map(p.q, p.d, p.h, q_rows, batch, p.q_stride, kTile.block_m);
    args.tm_do = sm90::make_tensor_map(p.dout, p.d, p.h, q_rows, batch, p.do_stride, kTile.block_m);
    args.tm_k = sm90::make_tensor_map(p.k, p.d, p.h_k, k_rows, batch, p.k_stride, kTile.block_n);
    args.tm_v = sm90::make_tensor_map(p.v, p.d, p.h_k, k_rows, batch, p.v_stride, kTile.block_n);
    if (ws.rows > 0x7fffffff) throw Error("q", "the sm90 backward takes at most 2^31 - 1 padded query rows");
    args.tm_rows = sm90::make_row_terms_map(lse, (ws.dsum - ws.lse) / sizeof(float), p.h, ws.rows, kTile.block_m);
    // Softcap, ALiBi and dropout are compiled into a second variant so the common one carries none
    // of their registers (above hdim 64: bwd_sm90_eligible).
    constexpr bool kModVariant = kHeadDim > 64;
    const bool mods = kModVariant && p.score_mods();
    auto* kernel = mods ? bwd_kernel_sm90<T, kHeadDim, kModVariant> : bwd_kernel_sm90<T, kHeadDim, false>;
    constexpr std::size_t kSmem = kTile.smem_bytes(kHeadDim);
    if (mods) allow_dynamic_smem<bwd_kernel_sm90<T, kHeadDim, kModVariant>>(kSmem, p.device.index);
    else allow_dynamic_smem<bwd_kernel_sm90<T, kHeadDim, false>>(kSmem, p.device.index);
    // One work item per (key block, batch · KV head) in BwdWork's order (bwd_group_heads), walked by
    // the blocks of bwd_main_blocks.
    args.group_heads = bwd_group_heads(p, kHeadDim);
    const std::int64_t items = static_cast<std::int64_t>((p.seqlen_k + kTile.block_n - 1) / kTile.block_n) * p.batch * p.h_k;
    if (items > 0x7fffffff - 0x10000) throw Error("k", "the sm90 backward takes at most 2^31 - 2^16 (key block, batch, KV head) items");
    args.items = static_cast<int>(items);
    kernel<<<static_cast<unsigned>(bwd_main_blocks(launch, args.items)), kTile.threads(), kSmem, launch.stream>>>(args);
    FM_CUDA_CHECK_LAUNCH();
  }

  bwd_convert_dq_sm90<T, kHeadDim><<<dim3(padded_q / kTile.block_m, p.h, p.batch), 256, 0, launch.stream>>>(p, dq_acc, ws.rows);
  FM_CUDA_CHECK_LAUNCH();
}

}  // namespace flashmonoid::cuda
