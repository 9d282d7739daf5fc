// Scratch memory the CPU passes keep per calling thread (src/cpu/flash_fwd.cpp, flash_bwd.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace flashmonoid::cpu {

// Scratch of `bytes`, uninitialised, 64-byte aligned. Up to kKeepScratchBytes it is the calling
// thread's, kept across calls (one buffer for the forward, the backward and decoding, grown to the
// largest call): allocated per call, a pass's packed tiles were faulted in (and zeroed by the kernel)
// on every call. The forward's packed K/V, ~1k minor faults for 4 MB at s = 1k: kept, the forward
// 3-10% faster at s = 1k, 2 threads, inside the torch benchmark process (AMD EPYC, d = 128: 22.1
// against 24.4 ms); at 32 MiB (s = 4k, d = 128, h = 8) the 8192 page faults of a fresh buffer still
// cost 2-3% of the call. The backward's packed Q, dO, K, V and dQ partials (~22 MB at b = 1, h = 8,
// s = 1k, d = 128, bf16; twice that in fp32), kept against fresh per call (AMD EPYC, 2 threads,
// alternated runs, a C++ process calling the API): bf16 d = 128 17.8-20.1 against 22.6-23.1 ms, fp32
// d = 128 26.2 against 34.6-35.4, fp32 d = 64 12.5-12.6 against 17.5; at s = 4k (88 MB) 213-219
// against 241 ms (inside bench/cpu_vs_torch.py's process the same with and without: glibc was
// reusing the freed memory there). Hence 256 MiB: the forward to s = 32k and the backward to s = 8k
// (bf16, d = 128, h = 8) keep theirs; a thread holds what its largest call needed, no more. Larger
// scratch is the call's own (`owned`). The pages stay where the packing threads first touched them.
// Every call returns the same memory: a pass takes one region and lays all its arrays out in it.
inline constexpr std::size_t kKeepScratchBytes = std::size_t{256} << 20;
inline std::byte* align64(std::byte* p) { return p + (-reinterpret_cast<std::uintptr_t>(p) & 63); }
inline std::byte* kept_scratch(std::size_t bytes, std::unique_ptr<std::byte[]>& owned) {
  if (bytes > kKeepScratchBytes) {
    owned = std::make_unique_for_overwrite<std::byte[]>(bytes + 64);
    return align64(owned.get());
  }
  thread_local std::unique_ptr<std::byte[]> kept;
  thread_local std::size_t kept_bytes = 0;
  if (bytes > kept_bytes) {
    kept = std::make_unique_for_overwrite<std::byte[]>(bytes + 64);
    kept_bytes = bytes;
  }
  return align64(kept.get());
}

}  // namespace flashmonoid::cpu
