// Block timelines of the decoding kernels (append, forward, combine), for profiling only: compiled in
// with -DFLASHMONOID_TRACE=ON (CMake), out otherwise (every mark is then empty, FwdParams has no
// trace field and no kernel changes). Thread 0 of each block stores %globaltimer (ns, common to all
// SMs) and clock64 (its SM's cycles) at numbered events, into
// trace[((kernel · kTraceBlocks + block) · kTraceEvents + event) · 2 + {0: globaltimer, 1: clock64}];
// `flashmonoid-gpu-bench --kv-trace` sets the buffer and prints the timeline of one decoding call.
#pragma once

#include <cstddef>

#include "api/params.hpp"

namespace flashmonoid::cuda {

enum class TraceKernel : int { append, forward, combine };
inline constexpr int kTraceKernels = 3, kTraceBlocks = 2048, kTraceEvents = 4;
inline constexpr std::size_t kTraceBytes = std::size_t{kTraceKernels} * kTraceBlocks * kTraceEvents * 2 * 8;

// Forward events: 0 entry, 1 after the wait for the append (pdl.cuh), 2 mainloop done, 3 exit.
// Combine: 0 entry, 1 after its wait, 2 its first warp's splits loaded and folded, 3 exit.
// Append: 1 launched (before its wait), 0 after its wait (the call's first mark), 3 exit.
__device__ __forceinline__ void trace_mark([[maybe_unused]] const detail::FwdParams& p,
                                           [[maybe_unused]] TraceKernel kernel, [[maybe_unused]] int event) {
#ifdef FLASHMONOID_TRACE
  if (p.trace == nullptr || threadIdx.x != 0) return;
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (block >= kTraceBlocks) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  unsigned long long* slot =
      p.trace + ((static_cast<std::size_t>(kernel) * kTraceBlocks + block) * kTraceEvents + event) * 2;
  slot[0] = t;
  slot[1] = clock64();
#endif
}

}  // namespace flashmonoid::cuda
