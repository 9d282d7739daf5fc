// CudaOps: one grid-stride elementwise kernel for copy / accumulate / fill over <= 4-dim views.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/common/check.cuh"
#include "dist/device_ops.hpp"

namespace flashmonoid::dist {
namespace {

__device__ __forceinline__ float load(const void* p, DType t, std::int64_t i) {
  if (t == DType::bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (t == DType::f16) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void store(void* p, DType t, std::int64_t i, float x) {
  if (t == DType::bf16)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else if (t == DType::f16)
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  else
    static_cast<float*>(p)[i] = x;
}

enum class Mode { copy, accumulate, fill };

__global__ void elementwise_kernel(View4 dst, View4 src, Mode mode, float value) {
  const std::int64_t n = dst.numel();
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t od = dst.offset(i);
    float x = value;
    if (mode != Mode::fill) x = load(src.data, src.dtype, src.offset(i));
    if (mode == Mode::accumulate) x += load(dst.data, dst.dtype, od);
    store(dst.data, dst.dtype, od, x);
  }
}

void launch(const View4& dst, const View4& src, Mode mode, float value, void* stream) {
  const std::int64_t n = dst.numel();
  if (n == 0) return;
  constexpr int kThreads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 8192));
  elementwise_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(dst, src, mode, value);
  FM_CUDA_CHECK_LAUNCH();
}

}  // namespace

void CudaOps::copy(const TensorView& dst, const TensorView& src, bool accumulate) {
  check_copy(dst, src);
  launch(View4(dst), View4(src), accumulate ? Mode::accumulate : Mode::copy, 0.0f, stream_);
}

void CudaOps::fill(const TensorView& dst, float value) { launch(View4(dst), View4(dst), Mode::fill, value, stream_); }

}  // namespace flashmonoid::dist
