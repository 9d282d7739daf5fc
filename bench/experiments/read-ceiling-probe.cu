// Probe (issue 10, the 134 MB shapes): how much of the device's copy bandwidth a graph-replayed
// stream of reads reaches at decoding's sizes, with nothing but the reads, and with a decoding
// call's chain around them (a small kernel before, a small merge kernel after, all chained by
// programmatic dependent launch). This bounds the 0.9-of-copy bar from above: a decoding call reads
// the same bytes and does more.
// nvcc -O3 -std=c++17 -arch=sm_90a read-ceiling-probe.cu -o probe && ./probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

struct Args {
  const int4* src;
  std::size_t n16;  // 16-byte words
  int* sink;
  int pdl;  // 1: wait for the kernel before, let the next one launch early
};

__device__ __forceinline__ void pdl_begin(int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
}

// Each block streams one contiguous chunk (as a split of a decoding call does), 16-byte loads,
// kUnroll in flight per thread.
template <int kUnroll>
__global__ void __launch_bounds__(256) k_ldg(const __grid_constant__ Args a) {
  pdl_begin(a.pdl);
  const std::size_t chunk = a.n16 / gridDim.x;
  const int4* p = a.src + chunk * blockIdx.x;
  int acc = 0;
  for (std::size_t i = threadIdx.x; i < chunk; i += std::size_t{blockDim.x} * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t j = i + static_cast<std::size_t>(u) * blockDim.x;
      v[u] = j < chunk ? __ldcs(p + j) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x7ee1) a.sink[1 + blockIdx.x % 64] = acc;
}

// Each block streams its chunk with bulk copies (the engine decoding's K/V loads use) into a ring
// of kStages pieces of kPiece bytes; one thread issues and waits, the block consumes nothing.
template <int kStages, int kPiece>
__global__ void __launch_bounds__(128) k_bulk(const __grid_constant__ Args a) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) std::uint64_t full[kStages];
  pdl_begin(a.pdl);
  if (threadIdx.x != 0) return;
  const std::size_t chunk = a.n16 * 16 / gridDim.x;
  const char* p = reinterpret_cast<const char*>(a.src) + chunk * blockIdx.x;
  const int pieces = static_cast<int>(chunk / kPiece);
  for (int s = 0; s < kStages; ++s) {
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[s]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto issue = [&](int i) {
    const int s = i % kStages;
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[s]));
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(ring + s * kPiece));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kPiece) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
        "l"(p + std::size_t{static_cast<unsigned>(i)} * kPiece), "r"(kPiece), "r"(bar)
        : "memory");
  };
  for (int i = 0; i < kStages && i < pieces; ++i) issue(i);
  for (int i = 0; i < pieces; ++i) {
    const int s = i % kStages;
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[s]));
    const unsigned parity = (i / kStages) & 1;
    asm volatile(
        "{\n.reg .pred P;\nW: mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n@!P bra W;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
    if (i + kStages < pieces) issue(i + kStages);
  }
  if (ring[0] == 0x7e && ring[kPiece - 1] == 0x11) a.sink[0] = 1;
}

// The small kernels around the stream in a decoding call (the append before, the merge after).
__global__ void k_small(const __grid_constant__ Args a) {
  pdl_begin(a.pdl);
  if (threadIdx.x == 0) a.sink[65 + blockIdx.x % 32] = static_cast<int>(a.n16);
}

__global__ void k_fill(int4* p, std::size_t n16, unsigned seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n16;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    p[i] = make_int4(h, h * 3 + 1, h * 5 + 2, h * 7 + 3);
  }
}

using KernelFn = void (*)(Args);
struct Variant {
  const char* name;
  KernelFn k;
  int grid, block;
  std::size_t smem;
  int chain;  // 0: the reads alone, plain launches; 1: alone, programmatic; 2: small + reads + small
};

static void launch(KernelFn k, int grid, int block, std::size_t smem, bool pdl, Args a, cudaStream_t s) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(grid);
  c.blockDim = dim3(block);
  c.dynamicSmemBytes = smem;
  c.stream = s;
  c.attrs = attr;
  c.numAttrs = pdl ? 1 : 0;
  a.pdl = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&c, k, a));
}

int main() {
  const std::size_t pool_bytes = std::size_t{3} << 30;
  int4* pool = nullptr;
  int* sink = nullptr;
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMalloc(&sink, 4096));
  k_fill<<<1024, 256>>>(pool, pool_bytes / 16, 0x9e3779b9u);
  CK(cudaDeviceSynchronize());
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // The copy the bars divide by: 1 GiB device to device, bytes read + written.
  double copy_tbps = 0;
  {
    const std::size_t bytes = std::size_t{1} << 30;
    std::vector<float> t;
    for (int r = 0; r < 12; ++r) {
      CK(cudaEventRecord(e0, s));
      CK(cudaMemcpyAsync(reinterpret_cast<char*>(pool) + bytes, pool, bytes, cudaMemcpyDeviceToDevice, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 2) t.push_back(ms);
    }
    copy_tbps = 2.0 * bytes / median(t) / 1e9;
    std::printf("copy 1 GiB: %.3f TB/s\n", copy_tbps);
  }
  CK(cudaFuncSetAttribute(k_bulk<3, 32768>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 32768));
  CK(cudaFuncSetAttribute(k_bulk<6, 16384>, cudaFuncAttributeMaxDynamicSharedMemorySize, 6 * 16384));
  const Variant variants[] = {
      {"ldg x8, 264 x 256", k_ldg<8>, 264, 256, 0, 0},
      {"ldg x8, 264 x 256, pdl", k_ldg<8>, 264, 256, 0, 1},
      {"ldg x8, 264 x 256, chain", k_ldg<8>, 264, 256, 0, 2},
      {"ldg x4, 528 x 256, pdl", k_ldg<4>, 528, 256, 0, 1},
      {"bulk 3x32K, 264, plain", k_bulk<3, 32768>, 264, 128, 3 * 32768, 0},
      {"bulk 3x32K, 264, pdl", k_bulk<3, 32768>, 264, 128, 3 * 32768, 1},
      {"bulk 3x32K, 264, chain", k_bulk<3, 32768>, 264, 128, 3 * 32768, 2},
      {"bulk 6x16K, 264, chain", k_bulk<6, 16384>, 264, 128, 6 * 16384, 2},
      {"bulk 3x32K, 132, chain", k_bulk<3, 32768>, 132, 128, 3 * 32768, 2},
  };
  const double mbs[] = {16.8, 33.6, 67.1, 134.2, 268.4, 536.9};
  const int calls = 24;
  std::printf("\n%-28s %9s %9s %8s %8s\n", "variant", "MB", "us/call", "TB/s", "x copy");
  for (const Variant& v : variants) {
    for (double mb : mbs) {
      // A multiple of every grid's chunk (264 * 32 KB pieces * 2) near the decoding size.
      const std::size_t unit = std::size_t{264} * 2 * 32768;
      const std::size_t bytes = std::max<std::size_t>(1, static_cast<std::size_t>(mb * 1e6 / unit + 0.5)) * unit;
      const int slices = static_cast<int>(std::min<std::size_t>(8, pool_bytes / bytes));
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int c = 0; c < calls; ++c) {
        Args a{reinterpret_cast<const int4*>(reinterpret_cast<const char*>(pool) + (c % slices) * bytes), bytes / 16,
               sink, 0};
        if (v.chain == 2) launch(k_small, 8, 128, 0, true, a, s);
        launch(v.k, v.grid, v.block, v.smem, v.chain >= 1, a, s);
        if (v.chain == 2) launch(k_small, 32, 256, 0, true, a, s);
      }
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      std::vector<float> t;
      for (int r = 0; r < 9; ++r) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) t.push_back(ms);
      }
      const double us = median(t) * 1e3 / calls;
      const double tbps = bytes / us / 1e6;
      std::printf("%-28s %9.1f %9.2f %8.3f %8.3f\n", v.name, bytes / 1e6, us, tbps, tbps / copy_tbps);
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
