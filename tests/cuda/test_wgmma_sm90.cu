// The sm90 vocabulary (src/cuda/sm90/hopper.cuh, wgmma_ops.cuh, tensor_map) as a plain GEMM against
// cuBLAS: descriptor and swizzle mistakes give wrong numbers, not faults, so they are caught here
// before the attention kernels use them. C (M, N) fp32 = A (M, K) · B, bf16 inputs, with B either
// K-major ((N, K) row-major: the S = Q·Kᵀ form) or MN-major ((K, N) row-major: the O = P·V form).
//
// One kernel per B layout, in CUTLASS's "cooperative" schedule: 128 x 256 output tiles; a producer
// warpgroup (one thread issues TMA) streams k blocks of A (128, 64) and B (256, 64) through a 4-stage
// ring of 48 KB slots (5 would need 240 KB of the 227 KB a block can have); two consumer warpgroups
// each own 64 rows and a (64, 256) fp32 accumulator and store it from registers. The variants
// (kVariants) change only which tile a block takes, as run-time arguments:
// - tile order: row by row (N fastest), or groups of G M tiles walked N by N (TileOrder);
// - grid: one block per tile, or persistent (one block per multiprocessor walking tiles c, c + grid,
//   ...; its producer runs on into the next tile's k blocks while the consumers store).
//
// H100, 8192³, median of 10 event-timed runs, TFLOP/s with B K-major / MN-major:
//   row by row, one block per tile     469 / 528
//   groups of 16, one block per tile   771 / 770
//   groups of 8, persistent            763 / 752
//   cuBLAS                             776 / 775
// The tile order is what reaches cuBLAS. Row by row, a wave of 132 blocks spans 4 M rows and all 32
// N columns, so every wave reads all of B (128 MB, 2.5x the 50 MB L2) from DRAM; in groups of 16 M
// tiles a wave spans 16 A panels (32 MB) and 8-9 B panels (33-36 MB), half the bytes, and the blocks
// that share a panel read it from L2. Persistence adds nothing measurable at this size. A 2-block
// cluster along M that multicast B ran at under half speed (288-332 TFLOP/s) and was removed.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "sm90/hopper.cuh"
#include "sm90/setmaxnreg.hpp"
#include "sm90/tensor_map.hpp"

namespace {

using namespace flashmonoid::cuda;
using namespace flashmonoid::cuda::sm90;
using T = __nv_bfloat16;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kATile = kBM * kBK, kBTile = kBN * kBK;  // elements per stage
constexpr int kThreads = 384, kConsumerWarps = 8;      // a producer warpgroup, 2 consumer warpgroups
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
constexpr int kSmemBytes = kStages * (kATile + kBTile) * sizeof(T) + 2 * kStages * sizeof(Barrier) + kSwizzleAtomBytes;
static_assert(kSmemBytes <= 227 * 1024, "the ring must fit the 227 KB of shared memory a block can have");
static_assert(setmaxnreg_fits(kThreads, kProducerRegs, 2, kConsumerRegs), "register split exceeds the block's budget");

// The order in which blocks take output tiles: groups of `group` M tiles, M fastest inside a group,
// so that the blocks running at one time share A and B panels in L2; group 1 is row by row (N fastest).
struct TileOrder {
  int tiles_m, tiles_n, group;
  __host__ __device__ int count() const { return tiles_m * tiles_n; }
  __device__ __forceinline__ void tile(int t, int& tm, int& tn) const {
    const int per_group = group * tiles_n, first = t / per_group * group, r = t % per_group;
    const int rows = min(group, tiles_m - first);
    tm = first + r % rows;
    tn = r / rows;
  }
};

struct GemmArgs {
  CUtensorMap tm_a;  // A (m, k): box (64, 128), one (128, 64) panel
  CUtensorMap tm_b;  // K-major (n, k): box (64, 256), one (256, 64) panel; MN-major (k, n): box (64, 64)
  float* c;
  int m, n, k;  // m a multiple of 128, n of 256, k of 64
  TileOrder order;
};

// f(m0, n0) for each tile of this block, in order: tile blockIdx.x and every gridDim.x-th after it.
// Producer and consumers alike.
template <class F>
__device__ __forceinline__ void for_each_tile(const GemmArgs& g, F&& f) {
#pragma unroll 1
  for (int t = blockIdx.x; t < g.order.count(); t += gridDim.x) {
    int tm, tn;
    g.order.tile(t, tm, tn);
    f(tm * kBM, tn * kBN);
  }
}

// The producer (one thread): per k block of each of its tiles, A and B into the next ring slot. The
// ring's n-th use is slot n % kStages, phase (n / kStages) & 1, counted across tiles, so the next
// tile's loads go out while the consumers store the last one.
template <int kTransB>
__device__ __forceinline__ void produce(const GemmArgs& g, T* sa, T* sb, Barrier* full, Barrier* empty) {
  prefetch_tensor_map(&g.tm_a);
  prefetch_tensor_map(&g.tm_b);
  const int k_blocks = g.k / kBK;
  unsigned n = 0;
  for_each_tile(g, [&](int m0, int n0) {
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb, ++n) {
      const int s = n % kStages;
      empty[s].wait(((n / kStages) & 1) ^ 1);
      full[s].arrive_expect_tx((kATile + kBTile) * sizeof(T));
      tma_load(sa + s * kATile, &g.tm_a, kb * kBK, 0, m0, 0, full[s]);
      if constexpr (kTransB) {
        for (int p = 0; p < kBN / kPanelCols; ++p)  // (64, 256) as four (64, 64) panels
          tma_load(sb + s * kBTile + p * kBK * kPanelCols, &g.tm_b, n0 + p * kPanelCols, 0, kb * kBK, 0, full[s]);
      } else {
        tma_load(sb + s * kBTile, &g.tm_b, kb * kBK, 0, n0, 0, full[s]);
      }
    }
  });
}

// A warpgroup's (64, 256) accumulator into C from registers: lane quads hold 8 columns of rows `row`
// and `row` + 8 (the m64nNk16 fragment), so each warp store of 8-byte pairs fills whole 32-byte sectors.
__device__ __forceinline__ void store(float* c, int ldc, const float (&acc)[kBN / 2], int row, int col) {
#pragma unroll
  for (int i = 0; i < kBN / 8; ++i) {
    float* p = c + static_cast<std::size_t>(row) * ldc + col + 8 * i;
    *reinterpret_cast<float2*>(p) = make_float2(acc[4 * i], acc[4 * i + 1]);
    *reinterpret_cast<float2*>(p + 8 * static_cast<std::size_t>(ldc)) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
  }
}

// The consumers: warpgroup wg's 64 rows of each tile, k block by k block. A slot is released when the
// products that read it are done (wgmma_wait<1>: the previous k block's, while this one's run) by
// every consumer warp.
template <int kTransB>
__device__ __forceinline__ void consume(const GemmArgs& g, const T* sa, const T* sb, Barrier* full, Barrier* empty) {
  const int wg = threadIdx.x / 128 - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int k_blocks = g.k / kBK;
  auto release = [&](unsigned n) {
    if (lane == 0) empty[n % kStages].arrive();
  };
  float acc[kBN / 2] = {};  // (64, 256) fp32: the m64n256 accumulator fragment
  unsigned n = 0;
  for_each_tile(g, [&](int m0, int n0) {
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb, ++n) {
      const int s = n % kStages;
      full[s].wait((n / kStages) & 1);
      wgmma_fence();
      const std::uint32_t a = smem_addr(sa + s * kATile + wg * 64 * kBK), b = smem_addr(sb + s * kBTile);
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        const std::uint64_t db = kTransB ? desc_mn_major(b, kBK, ks) : desc_k_major(b, kBN, ks);
        wgmma_ss<0, kTransB>(acc, desc_k_major(a, kBM, ks), db, T{}, kb > 0 || ks > 0);  // a tile's first overwrites
      }
      wgmma_commit();
      wgmma_wait<1>();
      fence_regs(acc);
      if (kb > 0) release(n - 1);
    }
    wgmma_wait<0>();
    fence_regs(acc);
    release(n - 1);
    store(g.c, g.n, acc, m0 + wg * 64 + warp * 16 + lane / 4, n0 + 2 * (lane % 4));
  });
}

template <int kTransB>
__global__ void __launch_bounds__(kThreads, 1) gemm_sm90(const __grid_constant__ GemmArgs g) {
  extern __shared__ unsigned char raw[];
  T* sa = reinterpret_cast<T*>(align_smem_1024(raw));  // kStages x (128, 64): one panel each
  T* sb = sa + kStages * kATile;  // kStages x B tile: (256, 64) one panel, or (64, 256) four panels
  Barrier* full = reinterpret_cast<Barrier*>(sb + kStages * kBTile);
  Barrier* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      full[s].init(1);
      empty[s].init(kConsumerWarps);  // one arrival per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x / 128 == 0) {
    regs_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) produce<kTransB>(g, sa, sb, full, empty);
  } else {
    regs_alloc<kConsumerRegs>();
    consume<kTransB>(g, sa, sb, full, empty);
  }
}

void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

bool hopper() {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major == 9;
}

struct Variant {
  const char* name;
  bool persistent;
  int group;  // M tiles per group of the tile order; 1: row by row
};
// TFLOP/s at 8192³, H100, B K-major / MN-major (cuBLAS 776 / 775).
constexpr Variant kVariants[] = {
    {"flashmonoid_wgmma", false, 1},               // 469 / 528: a wave reads all of B from DRAM
    {"flashmonoid_wgmma_g16", false, 16},          // 771 / 770
    {"flashmonoid_wgmma_persistent_g8", true, 8},  // 763 / 752: the forward kernel's persistent ring
};

template <int kTransB>
void launch(const GemmArgs& args, bool persistent) {
  auto* kernel = gemm_sm90<kTransB>;
  // Blocks resident at once: the persistent grid. Asked once, outside the timed calls.
  static const int resident = [&] {
    int sms = 0, per_sm = 0;
    ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    ok(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmemBytes));
    return sms * per_sm;
  }();
  ASSERT_GT(resident, 0) << "no block of this kernel fits a multiprocessor";
  const int tiles = args.order.count();
  kernel<<<persistent ? std::min(tiles, resident) : tiles, kThreads, kSmemBytes>>>(args);
  ok(cudaGetLastError());
}

void launch(const Variant& v, const GemmArgs& args, bool trans_b) {
  trans_b ? launch<1>(args, v.persistent) : launch<0>(args, v.persistent);
}

struct Gemm {
  int m, n, k, trans_b;
  T *a = nullptr, *b = nullptr;
  float *c = nullptr, *ref = nullptr;
  cublasHandle_t handle = nullptr;
  Gemm(int m_, int n_, int k_, int tb) : m(m_), n(n_), k(k_), trans_b(tb) {
    std::vector<T> ha(static_cast<std::size_t>(m) * k), hb(static_cast<std::size_t>(n) * k);
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> nd;
    for (auto& x : ha) x = __float2bfloat16(nd(rng));
    for (auto& x : hb) x = __float2bfloat16(nd(rng));
    ok(cudaMalloc(&a, ha.size() * sizeof(T)));
    ok(cudaMalloc(&b, hb.size() * sizeof(T)));
    ok(cudaMalloc(&c, static_cast<std::size_t>(m) * n * 4));
    ok(cudaMalloc(&ref, static_cast<std::size_t>(m) * n * 4));
    ok(cudaMemcpy(a, ha.data(), ha.size() * sizeof(T), cudaMemcpyHostToDevice));
    ok(cudaMemcpy(b, hb.data(), hb.size() * sizeof(T), cudaMemcpyHostToDevice));
    poison();
    EXPECT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  }
  ~Gemm() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(ref);
    cublasDestroy(handle);
  }
  void poison() { ok(cudaMemset(c, 0xFF, static_cast<std::size_t>(m) * n * 4)); }  // NaN
  GemmArgs args(const Variant& v) const {
    GemmArgs g;
    const flashmonoid::detail::Strides sa{0, k, 0}, sb{0, trans_b ? n : k, 0};
    g.tm_a = make_tensor_map(a, k, 1, m, 1, sa, kBM);
    g.tm_b = trans_b ? make_tensor_map(b, n, 1, k, 1, sb, kBK) : make_tensor_map(b, k, 1, n, 1, sb, kBN);
    g.c = c;
    g.m = m;
    g.n = n;
    g.k = k;
    g.order = {m / kBM, n / kBN, v.group};
    return g;
  }
  // Row-major C = A · op(B) through column-major cuBLAS: Cᵀ = op(B)ᵀ · Aᵀ.
  void run_cublas() {
    const float one = 1.0f, zero = 0.0f;
    const cublasOperation_t ob = trans_b ? CUBLAS_OP_N : CUBLAS_OP_T;
    EXPECT_EQ(cublasGemmEx(handle, ob, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, trans_b ? n : k, a, CUDA_R_16BF, k,
                           &zero, ref, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
  }
  std::vector<float> download(const float* p) const {
    std::vector<float> h(static_cast<std::size_t>(m) * n);
    ok(cudaMemcpy(h.data(), p, h.size() * 4, cudaMemcpyDeviceToHost));
    return h;
  }
};

class WgmmaGemm : public ::testing::TestWithParam<int> {};

TEST_P(WgmmaGemm, MatchesCublas) {
  if (!hopper()) GTEST_SKIP() << "needs a compute capability 9.x device";
  // 2048x2304, 2176x2048 and 4096x4096: 144, 136 and 512 tiles, more than the 132 multiprocessors
  // and no multiple of them, so persistent blocks take unequal numbers of tiles. 128, 256, 1024 and
  // 2176 rows (1, 2, 8 and 17 M tiles) end in a group shorter than 16 M tiles.
  // k = 192 and 128: fewer k blocks than ring slots, so a tile starts mid-ring.
  for (auto [m, n, k] : {std::tuple{128, 256, 64}, {256, 512, 320}, {1024, 768, 1024}, {2048, 2304, 512},
                         {2176, 2048, 192}, {4096, 4096, 128}}) {
    Gemm gm(m, n, k, GetParam());
    gm.run_cublas();
    ok(cudaDeviceSynchronize());
    const std::vector<float> r = gm.download(gm.ref);
    for (const Variant& v : kVariants) {
      gm.poison();
      launch(v, gm.args(v), gm.trans_b);
      ok(cudaDeviceSynchronize());
      const std::vector<float> c = gm.download(gm.c);
      double err = 0, scale = 0;
      for (std::size_t i = 0; i < c.size(); ++i) {
        err = std::max(err, std::isnan(c[i]) ? INFINITY : std::abs(static_cast<double>(c[i]) - r[i]));
        scale = std::max(scale, std::abs(static_cast<double>(r[i])));
      }
      // Both accumulate exact bf16 products in fp32, in different orders: ~K·2^-24 relative.
      EXPECT_LE(err, 1e-5 * scale * std::sqrt(static_cast<double>(k))) << v.name << " " << m << "x" << n << "x" << k;
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Layouts, WgmmaGemm, ::testing::Values(0, 1),
                         [](const auto& info) { return info.param ? "b_mn_major" : "b_k_major"; });

// Median of 10 event-timed calls after 3 warm-ups, in ms.
template <class F>
double median_ms(F&& call) {
  for (int i = 0; i < 3; ++i) call();
  cudaEvent_t ev[2];
  for (auto& e : ev) ok(cudaEventCreate(&e));
  std::vector<float> t(10);
  for (float& ms : t) {
    ok(cudaEventRecord(ev[0]));
    call();
    ok(cudaEventRecord(ev[1]));
    ok(cudaEventSynchronize(ev[1]));
    ok(cudaEventElapsedTime(&ms, ev[0], ev[1]));
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

// A benchmark, not a test (run explicitly: --gtest_also_run_disabled_tests): 8192^3, every variant
// and cuBLAS on the same random inputs; prints one JSON record per implementation and B layout.
TEST(WgmmaGemmBench, DISABLED_Throughput8192) {
  if (!hopper()) GTEST_SKIP() << "needs a compute capability 9.x device";
  const int s = 8192;
  int dev = 0;
  cudaDeviceProp prop{};
  ok(cudaGetDevice(&dev));
  ok(cudaGetDeviceProperties(&prop, dev));
  for (int tb : {0, 1}) {
    Gemm gm(s, s, s, tb);
    auto report = [&](const char* impl, double ms) {
      std::printf("{\"impl\": \"%s\", \"pass\": \"gemm\", \"b_layout\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, "
                  "\"ms\": %.4f, \"tflops\": %.1f, \"device\": \"%s\"}\n",
                  impl, tb ? "mn_major" : "k_major", s, s, s, ms, 2.0 * s * s * s / ms / 1e9, prop.name);
    };
    for (const Variant& v : kVariants) {
      const GemmArgs args = gm.args(v);
      report(v.name, median_ms([&] { launch(v, args, tb); }));
    }
    report("cublas", median_ms([&] { gm.run_cublas(); }));
  }
}

}  // namespace
