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
