// run_fwd_sm90<T, kHeadDim>: tensor maps, grid and launch of the sm90 forward kernel. Included only
// by the generated instantiation files (compiled for sm_90a).
#pragma once

#include <cuda_runtime.h>

#include "common/check.cuh"
#include "sm90/fwd_sm90.hpp"
#include "sm90/kernel_fwd_sm90.cuh"
#include "sm90/tensor_map.hpp"
#include "sm90/tile_fwd_sm90.hpp"

namespace flashmonoid::cuda {

template <class T, int kHeadDim, bool kScoreMods>
void launch_fwd_sm90(const FwdKernelArgsSm90& args, cudaStream_t stream) {
  constexpr FwdTileSm90 kTile = fwd_tile_sm90(kHeadDim);
  auto* kernel = fwd_kernel_sm90<T, kHeadDim, kScoreMods>;
  constexpr std::size_t kSmem = kTile.smem_bytes(kHeadDim);
  FM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(args.num_m_blocks, args.p.h, args.p.batch);
  kernel<<<grid, kTile.threads(), kSmem, stream>>>(args);
  FM_CUDA_CHECK_LAUNCH();
}

template <class T, int kHeadDim>
void run_fwd_sm90(const detail::FwdParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head-dim buckets are 64, 128, 256");
  constexpr FwdTileSm90 kTile = fwd_tile_sm90(kHeadDim);
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
  args.num_m_blocks = (p.seqlen_q + kTile.block_m() - 1) / kTile.block_m();
  const bool score_mods = p.softcap > 0.0f || p.alibi != nullptr || p.dropout_p > 0.0f;
  if (score_mods)
    launch_fwd_sm90<T, kHeadDim, true>(args, stream);
  else
    launch_fwd_sm90<T, kHeadDim, false>(args, stream);
}

}  // namespace flashmonoid::cuda
