// The CUDA backend's entry points, called by src/api/dispatch.cpp after validation. Compiled only
// when the build has CUDA (FLASHMONOID_WITH_CUDA); otherwise dispatch reports NotSupported.
#pragma once

#include <cstddef>
#include <string>

#include "api/kvcache_params.hpp"
#include "api/params.hpp"
#include "api/pointer_source.hpp"
#include "flashmonoid/options.hpp"

namespace flashmonoid::cuda {

// Why the CUDA backend cannot run p on its device ("" when it can). The one support table:
// dispatch, supports() and the tests' skip logic all ask this.
std::string unsupported_reason(const detail::FwdParams& p);

using detail::PointerSource;

// Validates that the pointers in p are device pointers of p.device (asking the runtime unless the
// source vouches for it) and suitably aligned (throws Error naming the argument otherwise).
void check_pointers(const detail::FwdParams& p, PointerSource source = PointerSource::unverified);
void check_pointers(const detail::BwdParams& p);
// One pointer: device memory of `device` (or nullptr), aligned to `align` bytes.
void check_device_pointer(const void* ptr, const char* name, int device, int align, PointerSource source);

// Which kernel family (architecture) runs p with ctx (ctx.cuda_path, FLASHMONOID_CUDA_PATH, the device and
// the shape); throws NotSupported when a forced family cannot run p.
enum class KernelArch { sm80, sm90 };
KernelArch forward_path(const detail::FwdParams& p, const Context& ctx);

std::size_t forward_workspace_size(const detail::FwdParams& p);
std::size_t backward_workspace_size(const detail::BwdParams& p);

// Queue the work on ctx.stream; never synchronise, never allocate. after_own_kernel: the last
// launch on ctx.stream is this call's own (forward_kvcache's append), so on sm_90 and later the
// forward may start under it (programmatic dependent launch, common/pdl.cuh). batch: the kernels
// are added to it, for the caller to launch with the rest of its call (common/launch_batch.hpp).
class LaunchBatch;
void forward(const detail::FwdParams& p, const Context& ctx, bool after_own_kernel = false,
             LaunchBatch* batch = nullptr);
void backward(const detail::BwdParams& p, const Context& ctx);
void merge(const detail::MergeParams& p, const Context& ctx);

// forward_kvcache (src/cuda/kvcache.cu): at most one append/rotary launch, then the forward.
std::size_t forward_kvcache_workspace_size(const detail::KvCacheCall& c);
void forward_kvcache(const detail::KvCacheCall& c, const Context& ctx, PointerSource source);
// Whether stream is being captured (false where the runtime cannot say: a launch then reports it).
bool stream_is_capturing(void* stream);
#ifdef FLASHMONOID_TRACE
// The buffer (common/trace.cuh: kTraceBytes) that forward_kvcache's kernels record their block
// timelines into; nullptr stops them. Profiling builds only.
void set_trace_buffer(void* buffer);
void* trace_buffer();
#endif

bool available();  // a device of compute capability >= 8.0 is visible

}  // namespace flashmonoid::cuda
