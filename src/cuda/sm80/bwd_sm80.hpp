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
  int num_sms = 0;  // of params.device
  // The sm90 backward's persistent grid (Context::sm_margin, Context::persistent_kernels): SMs left
  // free, or one block per work item instead. sm80's grid is one block per work item anyway.
  int sm_margin = 0;
  bool persistent = true;
};

// Query rows per tile of the backward at hdim 128 and 256; hdim 64 takes twice as many. The
// workspace sizes the deterministic semaphores by this smallest tile, so that its size does not
// depend on the head-dim bucket (hdim 64 needs about half of them).
inline constexpr int kBwdBlockM = 64;

// Layout of the fp32 workspace, in bytes from its start, each part 256-byte aligned:
//   dsum   (h, total_q)         D = rowsum(dO∘O), indexed like lse
//   dq_acc (h, total_q, d)      dQ accumulated over key blocks before the scale and dtype cast
//   sem    (b, h, m blocks)     deterministic mode only: how many key blocks have added their
//                               dQ to each query tile (orders the additions, see the kernel)
struct BwdWorkspaceLayout {
  std::size_t dsum = 0, dq_acc = 0, sem = 0, sem_bytes = 0, total = 0;
};

inline BwdWorkspaceLayout bwd_workspace_layout(const detail::BwdParams& p) {
  auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
  const std::size_t rows = static_cast<std::size_t>(p.h) * static_cast<std::size_t>(p.total_q);
  BwdWorkspaceLayout w;
  w.dsum = 0;
  w.dq_acc = align(rows * sizeof(float));
  w.sem = w.dq_acc + align(rows * static_cast<std::size_t>(p.d) * sizeof(float));
  const std::size_t m_blocks = (static_cast<std::size_t>(p.seqlen_q) + kBwdBlockM - 1) / kBwdBlockM;
  w.sem_bytes = p.deterministic ? static_cast<std::size_t>(p.batch) * p.h * m_blocks * sizeof(int) : 0;
  w.total = w.sem + align(w.sem_bytes);
  return w;
}

inline std::size_t bwd_workspace_bytes(const detail::BwdParams& params) {
  return bwd_workspace_layout(params).total;
}

// Queue the backward on launch.stream (never synchronises, never allocates). T is __half or
// __nv_bfloat16; kHeadDim is the head-dim bucket (64, 128, 256) that params.d <= kHeadDim pads to.
template <class T, int kHeadDim>
void run_bwd_sm80(const detail::BwdParams& params, const BwdLaunch& launch);

}  // namespace flashmonoid::cuda
