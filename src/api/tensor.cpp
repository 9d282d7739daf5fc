#include "flashmonoid/tensor.hpp"

namespace flashmonoid {

std::string to_string(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::i32: return "int32";
  }
  return "?";
}

std::string to_string(Device d) { return d.kind == DeviceKind::cpu ? "cpu" : "cuda:" + std::to_string(d.index); }

TensorView::TensorView(void* ptr, DType t, Device dev, std::initializer_list<std::int64_t> dims)
    : data(ptr), dtype(t), device(dev), ndim(static_cast<int>(dims.size())) {
  int i = 0;
  for (auto s : dims) shape[i++] = s;
  std::int64_t st = 1;
  for (int j = ndim - 1; j >= 0; --j) {
    stride[j] = st;
    st *= shape[j];
  }
}

TensorView::TensorView(void* ptr, DType t, Device dev, std::initializer_list<std::int64_t> dims,
                       std::initializer_list<std::int64_t> strides)
    : data(ptr), dtype(t), device(dev), ndim(static_cast<int>(dims.size())) {
  int i = 0;
  for (auto s : dims) shape[i++] = s;
  i = 0;
  for (auto s : strides) {
    if (i < kMaxDims) stride[i] = s;
    ++i;
  }
  if (i != ndim) ndim = -1;  // rejected by validation: strides must match dims
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // no element to lay out (PyTorch's rule; its empty tensors' strides vary)
  std::int64_t st = 1;
  for (int j = ndim - 1; j >= 0; --j) {
    if (shape[j] != 1 && stride[j] != st) return false;
    st *= shape[j];
  }
  return true;
}

}  // namespace flashmonoid
