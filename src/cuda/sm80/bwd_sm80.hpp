// Light interface of the sm80 (mma.sync) backward: what src/cuda/api.cu needs to size the
// workspace and launch, without pulling in the kernels. The kernels live in launch_bwd_sm80.cuh
// and are instantiated one (dtype, head-dim bucket) per file under src/cuda/generated/.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "api/params.hpp"

namespace flashmonoid::cuda {

// Everything the launcher needs besides the call description. workspace must be at least
// bwd_workspace_bytes(params) bytes of device memory on params.device, 256-byte aligned; its
// contents on entry do not matter (the launcher clears what it accumulates into).
struct BwdLaunch {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  int num_sms = 0;  // of params.device; sizes nothing today, kept for a future persistent grid
};

// fp32 workspace of the backward: D = rowsum(dO∘O) per (head, query row), dQ accumulator, and, in
// deterministic mode, one dQ partial per key block instead of the shared accumulator.
std::size_t bwd_workspace_bytes(const detail::BwdParams& params);

// Queue the backward on launch.stream (never synchronises, never allocates). T is __half or
// __nv_bfloat16; kHeadDim is the head-dim bucket (64, 128, 256) that params.d <= kHeadDim pads to.
template <class T, int kHeadDim>
void run_bwd_sm80(const detail::BwdParams& params, const BwdLaunch& launch);

}  // namespace flashmonoid::cuda
