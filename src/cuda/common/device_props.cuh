// What the launch path asks of a device, queried once per device and kept: a decoding step made
// six cudaDeviceGetAttribute calls and a cudaFuncSetAttribute per call (0.04 and 0.32 us each on
// the H100 VM, `gpu_bench --sweep`), for values that never change while the process runs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>

#include "common/check.cuh"

namespace flashmonoid::cuda {

struct DeviceProps {
  int major = 0, minor = 0;      // compute capability
  int num_sms = 0;               // multiprocessors
  std::size_t smem_optin = 0;    // shared memory per block, opt-in limit
  std::size_t smem_per_sm = 0;   // shared memory per multiprocessor
};

namespace props_detail {
constexpr int kMaxDevices = 64;  // devices past this are queried on every call

inline bool query(int device, DeviceProps* out) {
  int optin = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&out->major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&out->minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&out->num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess) {
    (void)cudaGetLastError();  // a device that is not there: the caller reports it
    return false;
  }
  out->smem_optin = static_cast<std::size_t>(optin);
  out->smem_per_sm = static_cast<std::size_t>(per_sm);
  return true;
}
}  // namespace props_detail

// The properties of `device` (kept after the first successful query; thread-safe); false when the
// runtime cannot query it (no such device), and then nothing is kept.
inline bool find_device_props(int device, DeviceProps* out) {
  using namespace props_detail;
  if (device < 0 || device >= kMaxDevices) return query(device, out);
  static std::atomic<bool> ready[kMaxDevices];
  static DeviceProps kept[kMaxDevices];
  static std::mutex mutex;
  if (!ready[device].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!ready[device].load(std::memory_order_relaxed)) {
      if (!query(device, &kept[device])) return false;
      ready[device].store(true, std::memory_order_release);
    }
  }
  *out = kept[device];
  return true;
}

inline DeviceProps device_props(int device) {
  DeviceProps p;
  if (!find_device_props(device, &p))
    throw DeviceError("flashmonoid: cannot query the properties of CUDA device " + std::to_string(device));
  return p;
}

// cudaFuncSetAttribute(kKernel, MaxDynamicSharedMemorySize, bytes) on the current device, once per
// (kernel, device) and size: the attribute only ever grows, and a launch may use less than it allows.
// Kept per process, as the kernel's other state: a cudaDeviceReset in between is not supported.
template <auto kKernel>
void allow_dynamic_smem(std::size_t bytes, int device) {
  using props_detail::kMaxDevices;
  if (device < 0 || device >= kMaxDevices) {
    const RelaxedCaptureMode relaxed;  // a first launch may come while another thread captures (check.cuh)
    FM_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    return;
  }
  static std::atomic<std::size_t> allowed[kMaxDevices];
  static std::mutex mutex;
  if (allowed[device].load(std::memory_order_acquire) >= bytes) return;
  std::lock_guard<std::mutex> lock(mutex);  // one setter at a time, so the attribute never shrinks
  if (allowed[device].load(std::memory_order_relaxed) >= bytes) return;
  const RelaxedCaptureMode relaxed;
  FM_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  allowed[device].store(bytes, std::memory_order_release);
}

}  // namespace flashmonoid::cuda
