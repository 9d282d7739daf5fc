// run_fwd_sm80<T, kHeadDim>: picks the tile (plan_fwd_sm80), launches the forward kernel and, for a
// split-KV launch, the combine. Included only by the generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "common/check.cuh"
#include "common/combine.cuh"
#include "common/device_props.cuh"
#include "common/launch_epoch.hpp"
#include "common/pdl.cuh"
#include "sm80/fwd_sm80.hpp"
#include "sm80/kernel_fwd_sm80.cuh"
#include "sm80/tile_fwd_sm80.hpp"

namespace flashmonoid::cuda {

template <class T, int kHeadDim, FwdTileKind kKind, bool kScoreMods, bool kShareTiles = false, bool kPaged = false>
void launch_fwd_tile_sm80(const FwdKernelArgs& args, const FwdPlanSm80& plan, const FwdLaunch& launch) {
  constexpr FwdTileSm80 kTile = fwd_tile_sm80(kHeadDim, kKind);
  auto* kernel = fwd_kernel_sm80<T, kHeadDim, kKind, kScoreMods, kShareTiles, kPaged>;
  const std::size_t smem = kTile.smem_bytes(kHeadDim, args.kv_slots);
  // Above 48 KB a block needs the opt-in limit (up to 227 KB on sm90, 163 KB on sm80).
  if (smem > 48 * 1024) allow_dynamic_smem<fwd_kernel_sm80<T, kHeadDim, kKind, kScoreMods, kShareTiles, kPaged>>(
      smem, args.p.device.index);
  const dim3 grid(plan.num_m_blocks * args.num_splits, plan.grid_heads, args.p.batch);
  launch_kernel(launch.batch, kernel, grid, dim3(kTile.warps * 32), smem, launch.stream,
                args.programmatic || args.wait_at_entry, args);
}

template <class T, int kHeadDim>
void run_fwd_sm80(const detail::FwdParams& p, const FwdLaunch& launch) {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head-dim buckets are 64, 128, 256");
  const FwdPlanSm80 plan = plan_fwd_sm80(p, launch.smem_per_sm);
  FwdKernelArgs args;
  args.p = p;
  args.pack = plan.pack;
  args.num_m_blocks = plan.num_m_blocks;
  args.num_splits = launch.num_splits > 1 ? launch.num_splits : 1;
  args.out_partial = launch.out_partial;
  args.lse_partial = launch.lse_partial;
  const bool share_tiles = fwd_split_shares_tiles(p, args.num_splits);
  const int num_counters = share_tiles ? fwd_split_counters(p) : 0;
  if (num_counters > 0) {
    args.tile_counters = launch.tile_counters;
    args.counter_tag = (next_launch_epoch() & 0xffffffffull) << 32;
  }
  // Only the cache tiles (every KV-cache call's, and decoding's) wait where pdl.cuh requires; the
  // others never start early.
  args.programmatic = launch.pdl && launch.after_own_kernel && fwd_cache_tile(plan.kind);
  args.wait_at_entry = launch.pdl && !launch.after_own_kernel && fwd_cache_tile(plan.kind);
  // The kernel after this one (the combine, or the next call's append) may launch once every block's
  // mainloop is done.
  args.programmatic_dependents = launch.pdl;
  args.kv_slots = plan.tile.kv_slots ? fwd_kv_slots(plan.tile, kHeadDim, launch.smem_optin, launch.smem_per_sm) : 0;
  // Softcap, ALiBi and dropout are compiled into a second variant so the common path carries none
  // of their registers (tanhf and 10-round Philox per element would otherwise crowd out O and S).
  const bool score_mods = p.score_mods();
  // A block table: the cache tiles' paged variant (plan_fwd_sm80 gives every paged call a cache tile).
  const bool paged = p.kv.block_table != nullptr;
  auto launch_kind = [&](auto kind) {
    constexpr FwdTileKind kKind = decltype(kind)::value;
    auto with_mods = [&](auto mods) {
      if constexpr (fwd_cache_tile(kKind)) {
        if (paged) return launch_fwd_tile_sm80<T, kHeadDim, kKind, decltype(mods)::value, false, true>(args, plan, launch);
      }
      launch_fwd_tile_sm80<T, kHeadDim, kKind, decltype(mods)::value, false>(args, plan, launch);
    };
    if (score_mods) with_mods(std::true_type{});
    else with_mods(std::false_type{});
  };
  using K = FwdTileKind;
  if (share_tiles) {
    // fwd_split_shares_tiles: the narrow or decode tile at hdim <= 128 without score modifiers.
    if constexpr (kHeadDim <= 128) {
      if (plan.kind == K::decode) launch_fwd_tile_sm80<T, kHeadDim, K::decode, false, true>(args, plan, launch);
      else launch_fwd_tile_sm80<T, kHeadDim, K::narrow, false, true>(args, plan, launch);
    }
  } else if (plan.kind == K::decode) {
    // plan_fwd_sm80 picks decode at hdim <= 128 only; above, its tile is the narrow one (fwd_tile_sm80).
    launch_kind(std::integral_constant<K, kHeadDim <= 128 ? K::decode : K::narrow>{});
  } else if (plan.kind == K::narrow) launch_kind(std::integral_constant<K, K::narrow>{});
  else if (plan.kind == K::wide_large_smem) launch_kind(std::integral_constant<K, K::wide_large_smem>{});
  else launch_kind(std::integral_constant<K, K::wide>{});
  if (args.num_splits > 1) {
    const unsigned blocks = combine_blocks(static_cast<std::int64_t>(p.h) * p.total_q, args.num_splits);
    launch_kernel(launch.batch, args.num_splits <= kCombineBatch ? combine_rows_kernel<T> : combine_splits_kernel<T>,
                  dim3(blocks), dim3(kCombineWarps * 32), 0, launch.stream, args.programmatic_dependents, p, args.num_splits,
                  static_cast<const float*>(args.out_partial), static_cast<const float*>(args.lse_partial),
                  args.tile_counters, num_counters, args.programmatic_dependents);
  }
}

}  // namespace flashmonoid::cuda
