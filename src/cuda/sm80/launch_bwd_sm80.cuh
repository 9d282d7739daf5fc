// Launcher of the sm80 backward (kernel_bwd_sm80.cuh): carves the workspace, then queues
// preprocess -> main -> convert on the caller's stream. Included by the generated instantiation
// files src/cuda/generated/bwd_sm80_<dtype>_hdim<D>.cu, one (dtype, head-dim bucket) each.
#pragma once

#include <string>

#include "common/check.cuh"
#include "common/device_props.cuh"
#include "flashmonoid/error.hpp"
#include "sm80/bwd_sm80.hpp"
#include "sm80/kernel_bwd_sm80.cuh"

namespace flashmonoid::cuda {

template <class T, int kHeadDim>
void run_bwd_sm80(const detail::BwdParams& p, const BwdLaunch& launch) {
  using Tr = bwd::BwdTraits<kHeadDim>;
  if (p.d > kHeadDim || p.d % 8 != 0)
    throw NotSupported("q", "head dim " + std::to_string(p.d) + " must be a multiple of 8 and at most " +
                                std::to_string(kHeadDim) + " for this kernel");
  const BwdWorkspaceLayout ws = bwd_workspace_layout(p);
  if (launch.workspace_bytes < ws.total || (ws.total > 0 && launch.workspace == nullptr))
    throw Error("context.workspace", "the CUDA backward needs " + std::to_string(ws.total) +
                                         " bytes (backward_workspace_size), got " +
                                         std::to_string(launch.workspace_bytes));
  if (p.total_q == 0 || p.batch == 0 || p.h == 0) return;

  auto* base = static_cast<unsigned char*>(launch.workspace);
  float* dsum = reinterpret_cast<float*>(base + ws.dsum);
  float* dq_acc = reinterpret_cast<float*>(base + ws.dq_acc);
  int* sem = reinterpret_cast<int*>(base + ws.sem);
  if (ws.sem_bytes > 0) FM_CUDA_CHECK(cudaMemsetAsync(sem, 0, ws.sem_bytes, launch.stream));

  constexpr int kRows = bwd::kRowsPerBlock<kHeadDim>;
  const dim3 row_grid((p.seqlen_q + kRows - 1) / kRows, p.h, p.batch);
  const dim3 row_block(bwd::kRowKernelWarps * 32);
  bwd::bwd_preprocess<T, kHeadDim><<<row_grid, row_block, 0, launch.stream>>>(p, dsum, dq_acc);
  FM_CUDA_CHECK_LAUNCH();

  if (p.seqlen_k > 0) {
    const std::size_t smem = Tr::kSmemBytes;
    auto kernel = bwd::bwd_main<T, Tr>;
    allow_dynamic_smem<bwd::bwd_main<T, Tr>>(smem, p.device.index);
    const dim3 grid((p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN, p.batch * p.h_k);
    kernel<<<grid, Tr::kNThreads, smem, launch.stream>>>(p, dsum, dq_acc, sem);
    FM_CUDA_CHECK_LAUNCH();
  }

  bwd::bwd_convert_dq<T, kHeadDim><<<row_grid, row_block, 0, launch.stream>>>(p, dq_acc);
  FM_CUDA_CHECK_LAUNCH();
}

}  // namespace flashmonoid::cuda
