// run_fwd_sm90<T, kHeadDim>: tensor maps, grid and launch of the sm90 forward kernel. Included only
// by the generated instantiation files (compiled for sm_90a).
#pragma once

#include <cuda_runtime.h>

#include <climits>

#include "common/check.cuh"
#include "common/device_props.cuh"
#include "common/launch_epoch.hpp"
#include "sm90/fwd_sm90.hpp"
#include "sm90/kernel_fwd_sm90.cuh"
#include "sm90/tensor_map.hpp"
#include "sm90/tile_fwd_sm90.hpp"

namespace flashmonoid::cuda {

template <class T, int kHeadDim, FwdVariantSm90 kVariant>
void launch_fwd_sm90(const detail::FwdParams& p, const FwdLaunchSm90& launch) {
  constexpr FwdTileSm90 kTile = fwd_tile_sm90(kHeadDim, kVariant);
  FwdKernelArgsSm90 args;
  args.p = p;
  const bool varlen = p.is_varlen();
  const int batch = varlen ? 1 : p.batch;
  const std::int64_t q_rows = varlen ? p.total_q : p.seqlen_q;
  // Rows past a varlen sequence's end belong to the next one (or are past total_k and read as zeros):
  // the kernel masks them.
  const std::int64_t k_rows = varlen ? p.total_k : p.seqlen_k;
  args.tm_q = sm90::make_tensor_map(p.q, p.d, p.h, q_rows, batch, p.q_stride, 64);
  args.tm_k = sm90::make_tensor_map(p.k, p.d, p.h_k, k_rows, batch, p.k_stride, kTile.block_n);
  args.tm_v = sm90::make_tensor_map(p.v, p.d, p.h_k, k_rows, batch, p.v_stride, kTile.block_n);
  if constexpr (kTile.store == FwdStore::tma)
    if (!varlen) args.tm_o = sm90::make_tensor_map(p.out, p.d, p.h, q_rows, batch, p.o_stride, 64);
  auto* kernel = fwd_kernel_sm90<T, kHeadDim, kVariant>;
  constexpr std::size_t kSmem = kTile.smem_bytes(kHeadDim);
  allow_dynamic_smem<fwd_kernel_sm90<T, kHeadDim, kVariant>>(kSmem, p.device.index);
  // Persistent: one block per multiprocessor (the shared memory admits no second one), less the
  // caller's margin; otherwise one block per work unit.
  const int num_sms = device_props(p.device.index).num_sms;
  const int blocks_max = !launch.persistent ? INT_MAX : launch.sm_margin < num_sms ? num_sms - launch.sm_margin : 1;
  const int num_m_blocks = (p.seqlen_q + kTile.block_m() - 1) / kTile.block_m();
  args.work = WorkTiles{num_m_blocks, p.h, p.batch, p.window_right >= 0};
  const int units = args.work.units();
  if (units == 0) return;
  int grid = units < blocks_max ? units : blocks_max;
  // A partial last round (tile_fwd_sm90.hpp: fwd_split_tail): the split tail where the workspace
  // holds its exchange (varlen units are of unequal lengths, so not there), or the balanced grid.
  if (launch.persistent && !fwd_split_tail(kHeadDim, kVariant) && p.seqlen_k <= kBalancedGridKeys) grid = balanced_grid(units, grid);
  const FwdTailLayoutSm90 tail = fwd_tail_layout_sm90(kTile, kHeadDim, grid);
  if (launch.persistent && fwd_split_tail(kHeadDim, kVariant) && !varlen && launch.workspace != nullptr &&
      launch.workspace_bytes >= tail.total) {
    args.work.tail_units = split_tail_units(units, grid);
    char* ws = static_cast<char*>(launch.workspace);
    args.tail.o = reinterpret_cast<float*>(ws + tail.o);
    args.tail.lse = reinterpret_cast<float*>(ws + tail.lse);
    args.tail.flag = reinterpret_cast<unsigned long long*>(ws + tail.flag);
    args.tail.epoch = next_launch_epoch();
  }
  kernel<<<grid, kTile.threads(), kSmem, launch.stream>>>(args);
  FM_CUDA_CHECK_LAUNCH();
}

// The one choice among a head-dim bucket's variants (tile_fwd_sm90.hpp: fwd_variant_sm90).
template <class T, int kHeadDim>
void run_fwd_sm90(const detail::FwdParams& p, const FwdLaunchSm90& launch) {
  static_assert(kHeadDim == fwd_head_dim_bucket_sm90(kHeadDim), "head-dim buckets are 64, 96, 128, 192, 256");
  using V = FwdVariantSm90;
  switch (fwd_variant_sm90(p, kHeadDim)) {
    case V::score_mods: return launch_fwd_sm90<T, kHeadDim, V::score_mods>(p, launch);
    case V::short_band: return launch_fwd_sm90<T, kHeadDim, V::short_band>(p, launch);
    case V::long_keys:
      if constexpr (kHeadDim == 128) return launch_fwd_sm90<T, kHeadDim, V::long_keys>(p, launch);
      break;
    case V::plain: break;
  }
  launch_fwd_sm90<T, kHeadDim, V::plain>(p, launch);
}

}  // namespace flashmonoid::cuda
