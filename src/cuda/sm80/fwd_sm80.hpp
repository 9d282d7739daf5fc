// Light interface of the sm80 (mma.sync) forward: what src/cuda/api.cu needs to size the split-KV
// workspace and launch, without pulling in the kernels (launch_fwd_sm80.cuh, instantiated one
// (dtype, head-dim bucket) per file under src/cuda/generated/).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "api/params.hpp"

namespace flashmonoid::cuda {

class LaunchBatch;

// Everything the launcher needs besides the call description.
struct FwdLaunch {
  cudaStream_t stream = nullptr;
  // Split-KV: 1 = off; > 1 = that many KV splits, whose fp32 partials go to out_partial
  // (num_splits, h, total_q, d) and lse_partial (num_splits, h, total_q) before a combine kernel
  // merges them. Both buffers come from the caller (see fwd_split_workspace_bytes).
  int num_splits = 1;
  float* out_partial = nullptr;
  float* lse_partial = nullptr;
  // fwd_split_counters(p) words after them: the narrow tile's shared key tiles (SharedKeyTiles), which
  // the combine sets back to 0.
  unsigned long long* tile_counters = nullptr;
  int num_sms = 0;  // of params.device, for the split heuristic
  std::size_t smem_optin = 0;  // shared memory per block of params.device (opt-in limit), for ring depths
  std::size_t smem_per_sm = 0;  // shared memory per multiprocessor of params.device: tile choice, ring depths
  // Programmatic dependent launch (common/pdl.cuh) where the device has it (compute capability 9.0+):
  // a split-KV combine starts under the forward, and the forward under the kernel before it in the
  // stream when that one is the same call's (after_own_kernel: forward_kvcache's append).
  bool pdl = false;
  bool after_own_kernel = false;
  LaunchBatch* batch = nullptr;  // where the kernels go instead of the stream (launch_batch.hpp), if set
};

// Bytes of workspace that num_splits partials of p need (out and lse, then the tile counters, each
// 256-byte aligned).
std::size_t fwd_split_workspace_bytes(const detail::FwdParams& p, int num_splits);

// Whether the split blocks of p share their key tiles (SharedKeyTiles; the definition has the numbers).
bool fwd_split_shares_tiles(const detail::FwdParams& p, int num_splits);

// Counters of a split launch of p: one per (query block, head group, batch) of the narrow tile, whose
// split blocks share their key tiles; 0 for the other tiles (fixed splits).
int fwd_split_counters(const detail::FwdParams& p);

// The number of KV splits worth running p with on a device of num_sms multiprocessors (1 = none).
// Splitting pays when the unsplit grid leaves multiprocessors idle and each split still gets
// several key tiles; see the definition for the numbers.
int fwd_choose_num_splits(const detail::FwdParams& p, int num_sms, std::size_t smem_per_sm);

// Carve the partial buffers out of a workspace of fwd_split_workspace_bytes(p, num_splits).
void fwd_split_buffers(const detail::FwdParams& p, int num_splits, void* workspace, float** out_partial,
                       float** lse_partial, unsigned long long** tile_counters);

// Queue the forward on launch.stream (never synchronises, never allocates). T is __half or
// __nv_bfloat16; kHeadDim is the head-dim bucket (64, 128, 256) that p.d <= kHeadDim pads to.
template <class T, int kHeadDim>
void run_fwd_sm80(const detail::FwdParams& p, const FwdLaunch& launch);

}  // namespace flashmonoid::cuda
