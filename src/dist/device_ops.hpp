// The two elementwise operations the ring needs besides attention and merge: a strided copy with
// dtype conversion (optionally accumulating, for fp32 gradient sums) and a fill. CpuOps runs them
// inline; CudaOps (device_ops_cuda.cu) queues kernels on the compute stream.
#pragma once

#include <cstdint>

#include "flashmonoid/detail/host_device.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid::dist {

// A view padded on the left to 4 dimensions: the index arithmetic both implementations share.
struct View4 {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t shape[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0};

  explicit View4(const TensorView& t) : data(t.data), dtype(t.dtype) {
    for (int i = 0; i < t.ndim; ++i) {
      shape[4 - t.ndim + i] = t.shape[i];
      stride[4 - t.ndim + i] = t.stride[i];
    }
  }
  FM_HD std::int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  // Element offset of the linear (row-major) index i.
  FM_HD std::int64_t offset(std::int64_t i) const {
    std::int64_t off = 0;
    for (int d = 3; d >= 0; --d) {
      off += (i % shape[d]) * stride[d];
      i /= shape[d];
    }
    return off;
  }
};

// Throws flashmonoid::Error unless dst and src have equal shapes of at most 4 float dims.
void check_copy(const TensorView& dst, const TensorView& src);

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  // dst <- src, or dst <- dst + src when accumulate; equal shapes (at most 4 dims), any strides,
  // any float dtypes (computed in fp32).
  virtual void copy(const TensorView& dst, const TensorView& src, bool accumulate) = 0;
  virtual void fill(const TensorView& dst, float value) = 0;
};

class CpuOps final : public DeviceOps {
 public:
  void copy(const TensorView& dst, const TensorView& src, bool accumulate) override;
  void fill(const TensorView& dst, float value) override;
};

// Kernels queued on `stream` (a cudaStream_t); defined in device_ops_cuda.cu (flashmonoid::dist).
class CudaOps final : public DeviceOps {
 public:
  explicit CudaOps(void* stream) : stream_(stream) {}
  void copy(const TensorView& dst, const TensorView& src, bool accumulate) override;
  void fill(const TensorView& dst, float value) override;

 private:
  void* stream_;
};

}  // namespace flashmonoid::dist
