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
#include <string>
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

// K/V as decoding reads them: caches (keys, heads, 128) of 2-byte elements, so a head's key row is
// 256 bytes at a stride of heads · 256; grid (split, head), each block streams its split's 64-key
// (K, V) tiles through a 3-stage ring (two pairs in flight while one is consumed), as the decode
// tile does. `head_major` lays the caches out as (heads, keys, 128) instead (each block's bytes
// contiguous). The block consumes one 16-byte word per thread per tile.
struct KvArgs {
  const char* k;
  const char* v;
  int keys, heads, splits;
  bool head_major;
  int* sink;
  int pdl;
  int spin;         // cycles each block spends per tile after its barrier (decoding's products)
  bool descending;  // a split's tiles last to first, as the decode tile visits them
  int page;           // > 0: caches of pages (num_pages, page, heads, 128) read through `table`
  const int* table;   // a shuffled block table (keys / page entries), read a step ahead
};
constexpr int kRow = 256, kTileKeys = 64, kTileBytes = kRow * kTileKeys, kRing = 3;

__device__ __forceinline__ const char* kv_row(const KvArgs& a, const char* base, int key, int head) {
  const std::size_t row = a.head_major ? std::size_t(head) * a.keys + key : std::size_t(key) * a.heads + head;
  return base + row * kRow;
}

__device__ __forceinline__ int consume(const unsigned char* tile) {
  const int4 w = reinterpret_cast<const int4*>(tile)[threadIdx.x];
  return w.x ^ w.y ^ w.z ^ w.w;
}

// cp.async (16 bytes per thread per copy, the decode tile's loads): 8 per thread per K or V tile.
// kPage 0: a.k and a.v as kv_row lays them out; 16 or 64: pages through a.table. kStages (K, V)
// pairs in the ring, kStages - 1 in flight while one is consumed.
template <int kPage, int kStages = kRing>
__global__ void __launch_bounds__(128) k_kv_cpasync(const __grid_constant__ KvArgs a) {
  extern __shared__ __align__(128) unsigned char ring[];
  if (a.pdl) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  const int split = blockIdx.x, head = blockIdx.y, tiles = a.keys / kTileKeys;
  const int t0 = split * tiles / a.splits, t1 = (split + 1) * tiles / a.splits;
  auto tile_of = [&](int t) { return a.descending ? t0 + t1 - 1 - t : t; };
  auto entries = [&](int t, int* e) {  // the block-table entries of step t's tile (64 / page of them)
    if constexpr (kPage > 0) {
      if (t >= t1) return;
#pragma unroll
      for (int j = 0; j < kTileKeys / kPage; ++j) e[j] = __ldg(a.table + tile_of(t) * kTileKeys / kPage + j);
    }
  };
  auto issue = [&](int t, const int* e) {
    if (t < t1) {
      unsigned char* slot = ring + ((t - t0) % kStages) * 2 * kTileBytes;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = threadIdx.x + 128 * i, row = c / 16, col = c % 16;
        const int key = tile_of(t) * kTileKeys + row;
        const unsigned dk = static_cast<unsigned>(__cvta_generic_to_shared(slot + row * kRow + col * 16));
        const unsigned dv = dk + kTileBytes;
        const char *gk, *gv;
        if constexpr (kPage > 0) {
          // row = threadIdx.x / 16 + 8 i with threadIdx.x / 16 < 8: its page is (8 i) / kPage for kPage >= 16.
          const std::size_t phys = std::size_t(e[(8 * i) / kPage]) * kPage + row % kPage;
          gk = a.k + (phys * a.heads + head) * kRow;
          gv = a.v + (phys * a.heads + head) * kRow;
        } else {
          gk = kv_row(a, a.k, key, head);
          gv = kv_row(a, a.v, key, head);
        }
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(gk + col * 16));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv), "l"(gv + col * 16));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  int e[4] = {}, next[4] = {};
#pragma unroll
  for (int j = 0; j + 1 < kStages; ++j) {
    entries(t0 + j, e);
    issue(t0 + j, e);
  }
  entries(t0 + kStages - 1, next);
  int acc = 0;
  for (int t = t0; t < t1; ++t) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");
    __syncthreads();
    issue(t + kStages - 1, next);
    entries(t + kStages, next);
    const unsigned char* slot = ring + ((t - t0) % kStages) * 2 * kTileBytes;
    acc ^= consume(slot) ^ consume(slot + kTileBytes);
    if (a.spin) {
      const long long c0 = clock64();
      while (clock64() - c0 < a.spin) {
      }
    }
  }
  if (acc == 0x7ee1) a.sink[2] = acc;
}

// The same ring filled by bulk copies of one 256-byte row each (warp 0: two K and two V rows per
// lane per tile), completing on one mbarrier per stage.
__global__ void __launch_bounds__(128) k_kv_bulk(const __grid_constant__ KvArgs a) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) std::uint64_t full[kRing];
  if (a.pdl) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  const int split = blockIdx.x, head = blockIdx.y, tiles = a.keys / kTileKeys;
  const int t0 = split * tiles / a.splits, t1 = (split + 1) * tiles / a.splits;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRing; ++s) {
      const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[s]));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int t) {  // warp 0
    if (t >= t1) return;
    const int s = (t - t0) % kRing;
    unsigned char* slot = ring + s * 2 * kTileBytes;
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[s]));
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(2 * kTileBytes) : "memory");
    __syncwarp();
    for (int r = lane; r < kTileKeys; r += 32) {
      const int key = t * kTileKeys + r;
      const unsigned dk = static_cast<unsigned>(__cvta_generic_to_shared(slot + r * kRow));
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dk),
                   "l"(kv_row(a, a.k, key, head)), "r"(kRow), "r"(bar)
                   : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       dk + kTileBytes),
                   "l"(kv_row(a, a.v, key, head)), "r"(kRow), "r"(bar)
                   : "memory");
    }
  };
  if (threadIdx.x < 32) {
    issue(t0);
    issue(t0 + 1);
  }
  int acc = 0;
  for (int t = t0; t < t1; ++t) {
    const int s = (t - t0) % kRing;
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&full[s]));
    const unsigned parity = ((t - t0) / kRing) & 1;
    asm volatile(
        "{\n.reg .pred P;\nW: mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n@!P bra W;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
    __syncthreads();
    if (threadIdx.x < 32) issue(t + 2);
    const unsigned char* slot = ring + s * 2 * kTileBytes;
    acc ^= consume(slot) ^ consume(slot + kTileBytes);
  }
  if (acc == 0x7ee1) a.sink[3] = acc;
}

__global__ void k_small_kv(const __grid_constant__ KvArgs a) {
  if (a.pdl) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  if (threadIdx.x == 0) a.sink[65 + blockIdx.x % 32] = a.keys;
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

// One launch of k (Args or KvArgs, whose pdl field follows the launch), programmatic or plain.
template <class A>
static void launch(void (*k)(A), dim3 grid, int block, std::size_t smem, bool pdl, A a, cudaStream_t s) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = grid;
  c.blockDim = dim3(block);
  c.dynamicSmemBytes = smem;
  c.stream = s;
  c.attrs = attr;
  c.numAttrs = pdl ? 1 : 0;
  a.pdl = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&c, k, a));
}

int main(int argc, char** argv) {  // any argument: decoding's layout table only ("ring": the ring-depth table)
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
  const int calls = 24;
  // us per call: `calls` calls (call(c, stream) launches call c) captured into one graph, replayed
  // 9 times, the median of the last 7.
  auto graph_us = [&](auto call) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int c = 0; c < calls; ++c) call(c);
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
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return median(t) * 1e3 / calls;
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
  std::printf("\n%-28s %9s %9s %8s %8s\n", "variant", "MB", "us/call", "TB/s", "x copy");
  for (const Variant& v : variants) {
    if (argc > 1) break;
    for (double mb : mbs) {
      // A multiple of every grid's chunk (264 * 32 KB pieces * 2) near the decoding size.
      const std::size_t unit = std::size_t{264} * 2 * 32768;
      const std::size_t bytes = std::max<std::size_t>(1, static_cast<std::size_t>(mb * 1e6 / unit + 0.5)) * unit;
      const int slices = static_cast<int>(std::min<std::size_t>(8, pool_bytes / bytes));
      const double us = graph_us([&](int c) {
        Args a{reinterpret_cast<const int4*>(reinterpret_cast<const char*>(pool) + (c % slices) * bytes), bytes / 16,
               sink, 0};
        if (v.chain == 2) launch(k_small, dim3(8), 128, 0, true, a, s);
        launch(v.k, dim3(v.grid), v.block, v.smem, v.chain >= 1, a, s);
        if (v.chain == 2) launch(k_small, dim3(32), 256, 0, true, a, s);
      });
      const double tbps = bytes / us / 1e6;
      std::printf("%-28s %9.1f %9.2f %8.3f %8.3f\n", v.name, bytes / 1e6, us, tbps, tbps / copy_tbps);
    }
  }
  // Decoding's layout: GQA 32/8, hdim 128, b = 1 (the 8 heads' rows interleaved), a (K, V) cache
  // pair per call, rotated over the pool; 33 splits at 32k keys as the library's heuristic picks.
  using KvKernel = void (*)(KvArgs);
  struct KvVariant {
    const char* name;
    KvKernel k;
    bool head_major;
    int chain;
    int spin = 0;
    bool descending = false;
    int page = 0;
    int stages = kRing;
    bool one_per_sm = false;  // half the splits: one block per multiprocessor
    bool ring_table = false;  // the ring-depth table (argument "ring") rather than the first
  };
  for (KvKernel k : {k_kv_cpasync<0>, k_kv_cpasync<16>, k_kv_cpasync<64>})
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kRing * 2 * kTileBytes));
  CK(cudaFuncSetAttribute(k_kv_cpasync<0, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 2 * kTileBytes));
  CK(cudaFuncSetAttribute(k_kv_cpasync<0, 6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 6 * 2 * kTileBytes));
  CK(cudaFuncSetAttribute(k_kv_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, kRing * 2 * kTileBytes));
  const KvVariant kv_variants[] = {
      {"kv cp.async, chain", k_kv_cpasync<0>, false, 2},      {"kv cp.async, pdl alone", k_kv_cpasync<0>, false, 1},
      {"kv cp.async head-major, chain", k_kv_cpasync<0>, true, 2}, {"kv bulk rows, chain", k_kv_bulk, false, 2},
      {"kv bulk rows head-major, chain", k_kv_bulk, true, 2},
      // The small kernels cannot share a multiprocessor with two stream blocks (as decoding's append,
      // 66 registers x 128 threads, and combine, 108 x 256, cannot beside two 217 x 128 forward
      // blocks): shared memory stands in for registers here.
      {"kv cp.async, chain, small fat", k_kv_cpasync<0>, false, 3},
      {"kv cp.async, chain, descending", k_kv_cpasync<0>, false, 2, 0, true},
      {"kv cp.async, chain, page 16", k_kv_cpasync<16>, false, 2, 0, false, 16},
      {"kv cp.async, chain, page 64", k_kv_cpasync<64>, false, 2, 0, false, 64},
      {"kv cp.async, chain, page 16 desc", k_kv_cpasync<16>, false, 2, 0, true, 16},
      {"kv cp.async, chain, spin 500", k_kv_cpasync<0>, false, 2, 500},
      {"kv cp.async, chain, spin 1000", k_kv_cpasync<0>, false, 2, 1000},
      {"kv cp.async, chain, spin 2000", k_kv_cpasync<0>, false, 2, 2000},
      {"kv cp.async, chain, spin 3000", k_kv_cpasync<0>, false, 2, 3000},
      // Ring depth against per-tile work: 2 blocks per SM of 3 stages (decoding's), or 1 block of 3,
      // 4 or 6 stages (half the splits).
      {"ring 3 x2/SM", k_kv_cpasync<0>, false, 2, 0, false, 0, 3, false, true},
      {"ring 3 x2/SM, spin 1500", k_kv_cpasync<0>, false, 2, 1500, false, 0, 3, false, true},
      {"ring 3 x1/SM", k_kv_cpasync<0>, false, 2, 0, false, 0, 3, true, true},
      {"ring 3 x1/SM, spin 1500", k_kv_cpasync<0>, false, 2, 1500, false, 0, 3, true, true},
      {"ring 4 x1/SM", k_kv_cpasync<0, 4>, false, 2, 0, false, 0, 4, true, true},
      {"ring 4 x1/SM, spin 1500", k_kv_cpasync<0, 4>, false, 2, 1500, false, 0, 4, true, true},
      {"ring 6 x1/SM", k_kv_cpasync<0, 6>, false, 2, 0, false, 0, 6, true, true},
      {"ring 6 x1/SM, spin 1500", k_kv_cpasync<0, 6>, false, 2, 1500, false, 0, 6, true, true},
  };
  const bool ring_table = argc > 1 && std::string(argv[1]) == "ring";
  const int kv_keys[][2] = {{4096, 8}, {32768, 33}, {131072, 132}};
  std::printf("\n%-32s %8s %6s %9s %8s %8s\n", "variant", "keys", "MB", "us/call", "TB/s", "x copy");
  for (const KvVariant& v : kv_variants)
    for (const auto& kk : kv_keys) {
      if (v.ring_table != ring_table) break;
      const int heads = 8, keys = kk[0], splits = v.one_per_sm ? kk[1] / 2 : kk[1];
      const std::size_t half = std::size_t(keys) * heads * kRow, bytes = 2 * half;
      const int slices = static_cast<int>(std::min<std::size_t>(8, pool_bytes / bytes));
      int* table = nullptr;  // a shuffled block table (the same for every slice)
      if (v.page > 0) {
        std::vector<int> h(keys / v.page);
        for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<int>(i);
        unsigned rng = 12345;
        for (std::size_t i = h.size() - 1; i > 0; --i) {
          rng = rng * 1664525u + 1013904223u;
          std::swap(h[i], h[rng % (i + 1)]);
        }
        CK(cudaMalloc(&table, h.size() * sizeof(int)));
        CK(cudaMemcpy(table, h.data(), h.size() * sizeof(int), cudaMemcpyHostToDevice));
      }
      const double us = graph_us([&](int c) {
        const char* base = reinterpret_cast<const char*>(pool) + (c % slices) * bytes;
        KvArgs a{base, base + half, keys, heads, splits, v.head_major, sink, 0, v.spin, v.descending, v.page, table};
        const std::size_t small_smem = v.chain == 3 ? 30 * 1024 : 0;
        if (v.chain >= 2) launch(k_small_kv, dim3(8), 128, small_smem, true, a, s);
        launch(v.k, dim3(splits, heads), 128, std::size_t(v.stages) * 2 * kTileBytes, v.chain >= 1, a, s);
        if (v.chain >= 2) launch(k_small_kv, dim3(32), 256, small_smem, true, a, s);
      });
      const double tbps = bytes / us / 1e6;
      std::printf("%-32s %8d %6.1f %9.2f %8.3f %8.3f\n", v.name, keys, bytes / 1e6, us, tbps, tbps / copy_tbps);
      if (table) CK(cudaFree(table));
    }
  CK(cudaDeviceSynchronize());
  return 0;
}
