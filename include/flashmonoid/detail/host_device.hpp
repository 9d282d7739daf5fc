#pragma once
// Functions that define the library's semantics are compiled for both the host and the GPU, so
// the CPU backends and the CUDA kernels share one definition.
#if defined(__CUDACC__)
#define FM_HD __host__ __device__ __forceinline__
#else
#define FM_HD inline
#endif
