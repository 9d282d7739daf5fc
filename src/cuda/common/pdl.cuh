// Programmatic dependent launch (PDL, sm_90 and later): a kernel launched with programmatic stream
// serialization may start while the kernel before it in the stream is still running, once every
// block of that kernel has called pdl_launch_dependents() or exited. It must call pdl_wait() before
// it reads anything the earlier kernel writes (the wait returns when that kernel has completed and
// its writes are visible). Both are no-ops below sm_90; kernels call them only when a kernel
// argument says they were (or their dependents are) launched programmatically.
// Used for the chains of one call: forward_kvcache's append -> forward, and forward -> the split-KV
// combine, where the next kernel's launch and prologue overlap the previous kernel's tail instead of
// following it: +5-8% at b = 1 32k and b = 8 4k decoding with append and rotary, calls without an
// append unchanged (H200, graph-replayed; bench/NOTES.md, issue 10). And between calls: a call's
// first kernel (the append, or the cache tiles' forward without one) launches under whatever kernel
// precedes it and waits for it first thing; the forward and the combine let the next kernel launch
// early, so back-to-back decoding calls overlap that launch with the last call's tail: +1-2% at the
// 134 MB shapes, +5% at b = 1 1-4k (H100).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "common/check.cuh"
#include "common/device_props.cuh"
#include "common/launch_batch.hpp"

namespace flashmonoid::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// Whether a device runs programmatic launches (compute capability 9.0 and later).
inline bool pdl_available(const DeviceProps& props) { return props.major >= 9; }

// The configuration of a launch with programmatic stream serialization (attr: its storage).
inline cudaLaunchConfig_t programmatic_config(dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                                              cudaLaunchAttribute (&attr)[1]) {
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// `programmatic` (callers pass it only on devices of compute capability 9.0 and later, and only
// when the kernel before it in the stream is one of the same call's); the launch is checked.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                   bool programmatic, Args&&... args) {
  if (!programmatic) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    FM_CUDA_CHECK_LAUNCH();
    return;
  }
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t config = programmatic_config(grid, block, smem, stream, attr);
  FM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// launch_kernel, or the same kernel added to `batch` (launch_batch.hpp) when there is one.
template <class... Params, class... Args>
void launch_kernel(LaunchBatch* batch, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                   cudaStream_t stream, bool programmatic, Args&&... args) {
  if (batch != nullptr) batch->add(kernel, grid, block, smem, programmatic, std::forward<Args>(args)...);
  else launch_kernel(kernel, grid, block, smem, stream, programmatic, std::forward<Args>(args)...);
}

}  // namespace flashmonoid::cuda
