// Light interface of the sm90 (wgmma + TMA) forward for src/cuda/api.cu; the kernels are in
// launch_fwd_sm90.cuh, instantiated one (dtype, head-dim bucket) per file under src/cuda/generated/
// and compiled for sm_90a only (FLASHMONOID_WITH_SM90).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "api/params.hpp"

namespace flashmonoid::cuda {

// Whether the sm90 forward runs p on a device of compute capability 9.x: prefill-shaped calls.
// Decoding-shaped ones (s_q small enough that GQA packing or split-KV pays) keep the sm80 kernels,
// which read K/V at copy speed already (bench/NOTES.md). So do KV-cache and paged calls: the sm90
// kernels read K/V through strided TMA tensor maps, not through a cache's batch index or block table.
// FLASHMONOID_SM90_MIN_ROWS: only for a probe build that times the sm90 kernels on decoding shapes
// (gpu_bench --decode-paths); not an option of the library.
#ifndef FLASHMONOID_SM90_MIN_ROWS
#define FLASHMONOID_SM90_MIN_ROWS 65
#endif
inline constexpr int kFwdSm90MinRows = FLASHMONOID_SM90_MIN_ROWS;
inline bool fwd_sm90_eligible(const detail::FwdParams& p) {
  const bool cache = p.kv.active || p.kv.block_table != nullptr;
  // A call without keys runs sm80 (out = 0, lse = -inf there): TMA has no map of zero rows.
  return p.seqlen_q >= kFwdSm90MinRows && p.total_k > 0 && !cache;
}

// How a forward is queued: its stream, how many multiprocessors the persistent grid leaves free
// (Context::sm_margin), and whether it is persistent at all (Context::persistent_kernels).
struct FwdLaunchSm90 {
  cudaStream_t stream = nullptr;
  int sm_margin = 0;
  bool persistent = true;
  // The split tail's exchange (WorkTiles, tile_fwd_sm90.hpp: fwd_tail_layout_sm90); without enough
  // bytes here the persistent grid runs its last round as it falls.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Queue the forward on launch.stream (never synchronises, never allocates). T is __half or
// __nv_bfloat16; kHeadDim is the head-dim bucket (fwd_head_dim_bucket_sm90: 64, 96, 128, 192, 256)
// that p.d <= kHeadDim pads to.
template <class T, int kHeadDim>
void run_fwd_sm90(const detail::FwdParams& p, const FwdLaunchSm90& launch);

}  // namespace flashmonoid::cuda
