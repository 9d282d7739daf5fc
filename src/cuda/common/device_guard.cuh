// Makes a device current for the duration of a call and restores the caller's device.
#pragma once

#include <cuda_runtime.h>

#include "common/check.cuh"

namespace flashmonoid::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) FM_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = 0;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace flashmonoid::cuda
