// Device copies of host test tensors for the CUDA tests, and the skip without a GPU.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "test_util.hpp"

namespace fmtest {

#define SKIP_WITHOUT_GPU() \
  if (!flashmonoid::cuda_available()) GTEST_SKIP() << "no CUDA device of compute capability >= 8.0 is visible"

inline void cuda_ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

// Device copy of a host tensor with the same shape and strides (poison included).
struct DeviceTensor {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  TensorView view;
  explicit DeviceTensor(const HostTensor& h) : bytes(h.buf.size()), view(h.view) {
    if (!h.view.defined()) return;
    cuda_ok(cudaMalloc(&ptr, bytes));
    cuda_ok(cudaMemcpy(ptr, h.buf.data(), bytes, cudaMemcpyHostToDevice));
    view.data = ptr;
    view.device = flashmonoid::Device::cuda(0);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(ptr); }
  void copy_to(HostTensor& h) const { cuda_ok(cudaMemcpy(h.buf.data(), ptr, bytes, cudaMemcpyDeviceToHost)); }
  void copy_from(const HostTensor& h) const {
    cuda_ok(cudaMemcpy(ptr, h.buf.data(), bytes, cudaMemcpyHostToDevice));
  }
};

struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DeviceBuffer(std::size_t n) : bytes(n) {
    if (n) cuda_ok(cudaMalloc(&ptr, n));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
};

}  // namespace fmtest
