// Checked CUDA runtime calls: a failure becomes flashmonoid::DeviceError naming the call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashmonoid/error.hpp"

#define FM_CUDA_CHECK(call)                                                                          \
  do {                                                                                               \
    cudaError_t fm_err_ = (call);                                                                    \
    if (fm_err_ != cudaSuccess)                                                                      \
      throw ::flashmonoid::DeviceError(std::string("flashmonoid: CUDA error in ") + #call + ": " + \
                                       cudaGetErrorString(fm_err_));                                 \
  } while (0)

// After a launch: report a bad configuration immediately (no synchronisation).
#define FM_CUDA_CHECK_LAUNCH() FM_CUDA_CHECK(cudaGetLastError())

namespace flashmonoid::cuda {

// This thread's CUDA calls in relaxed stream-capture mode while it lives. Setup a call needs once
// (instantiating a cached graph, a kernel's shared-memory attribute on its first launch) is
// "potentially unsafe" while any thread captures a stream in global mode (torch.cuda.graph's
// default): it would fail and invalidate that capture.
struct RelaxedCaptureMode {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  RelaxedCaptureMode() { FM_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode)); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
};

}  // namespace flashmonoid::cuda
