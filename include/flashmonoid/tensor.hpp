// Non-owning tensor views: the currency of the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace flashmonoid {

enum class DType : std::uint8_t { f32, f16, bf16, i32 };

inline constexpr std::size_t dtype_size(DType t) { return t == DType::f16 || t == DType::bf16 ? 2 : 4; }
std::string to_string(DType t);

enum class DeviceKind : std::uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU
  static constexpr Device cpu() { return {DeviceKind::cpu, 0}; }
  static constexpr Device cuda(int i = 0) { return {DeviceKind::cuda, i}; }
  friend constexpr bool operator==(const Device&, const Device&) = default;
};
std::string to_string(Device d);

// A strided view of at most kMaxDims dimensions. Shape and strides are in elements.
// The library never owns, allocates or frees the memory behind a view.
struct TensorView {
  static constexpr int kMaxDims = 5;

  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t stride[kMaxDims] = {};

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* ptr, DType t, Device dev, std::initializer_list<std::int64_t> dims);
  // Explicit strides (elements), one per dimension.
  TensorView(void* ptr, DType t, Device dev, std::initializer_list<std::int64_t> dims,
             std::initializer_list<std::int64_t> strides);

  bool defined() const { return ndim > 0; }
  std::int64_t numel() const;
  std::int64_t size(int i) const { return shape[i < 0 ? i + ndim : i]; }
  bool is_contiguous() const;  // row-major without gaps; a view without elements always is
  template <class T> T* ptr() const { return static_cast<T*>(data); }
};

}  // namespace flashmonoid
