// The sm90 vocabulary (src/cuda/sm90/hopper.cuh, wgmma_ops.cuh, tensor_map) as a plain GEMM against
// cuBLAS: descriptor and swizzle mistakes give wrong numbers, not faults, so they are caught here
// before the attention kernels use them. C (M, N) fp32 = A (M, K) · B, bf16 inputs, with B either
// K-major ((N, K) row-major: the S = Q·Kᵀ form) or MN-major ((K, N) row-major: the O = P·V form).
// One block: a producer warpgroup streams 128x64 A and 64-deep B tiles through a 4-stage TMA ring,
// two consumer warpgroups each own 64 rows and a 64 x 256 fp32 accumulator.
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
#include "sm90/tensor_map.hpp"

namespace {

using namespace flashmonoid::cuda;
using namespace flashmonoid::cuda::sm90;
using T = __nv_bfloat16;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kATile = kBM * kBK, kBTile = kBN * kBK;  // elements per stage

struct GemmArgs {
  CUtensorMap tm_a, tm_b;
  float* c;
  int m, n, k;
};

template <int kTransB>
__global__ void __launch_bounds__(384, 1) gemm_sm90(const __grid_constant__ GemmArgs g) {
  extern __shared__ unsigned char raw[];
  T* base = reinterpret_cast<T*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) & ~std::uintptr_t(1023));
  T* sa = base;                       // kStages x (128, 64): one panel each
  T* sb = base + kStages * kATile;    // kStages x B tile: (256, 64) one panel, or (64, 256) four panels
  Barrier* full = reinterpret_cast<Barrier*>(sb + kStages * kBTile);
  Barrier* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      full[s].init(1);
      empty[s].init(8);  // one arrival per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN, k_blocks = g.k / kBK;
  if (threadIdx.x / 128 == 0) {
    regs_dealloc<24>();
    if (threadIdx.x == 0) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int s = kb % kStages;
        empty[s].wait(((kb / kStages) & 1) ^ 1);
        full[s].arrive_expect_tx((kATile + kBTile) * sizeof(T));
        tma_load(sa + s * kATile, &g.tm_a, kb * kBK, 0, m0, 0, full[s]);
        if (kTransB) {
          for (int pn = 0; pn < kBN / 64; ++pn)
            tma_load(sb + s * kBTile + pn * kBK * 64, &g.tm_b, n0 + pn * 64, 0, kb * kBK, 0, full[s]);
        } else {
          tma_load(sb + s * kBTile, &g.tm_b, kb * kBK, 0, n0, 0, full[s]);
        }
      }
    }
    return;
  }
  regs_alloc<240>();
  const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float acc[kBN / 2] = {};
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int s = kb % kStages;
    full[s].wait((kb / kStages) & 1);
    wgmma_fence();
    const std::uint32_t a = smem_addr(sa + s * kATile + wg * 64 * 64), b = smem_addr(sb + s * kBTile);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      const std::uint64_t db = kTransB ? desc_mn_major(b, kBK, ks) : desc_k_major(b, kBN, ks);
      wgmma_ss<0, kTransB>(acc, desc_k_major(a, kBM, ks), db, T{}, 1);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous stage's products are done: release it
    fence_regs(acc);
    if (kb > 0 && lane == 0) empty[(kb - 1) % kStages].arrive();
  }
  wgmma_wait<0>();
  fence_regs(acc);
  const int row = m0 + wg * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int i = 0; i < kBN / 8; ++i) {
    const int col = n0 + 8 * i + 2 * (lane % 4);
    *reinterpret_cast<float2*>(g.c + static_cast<std::size_t>(row) * g.n + col) = make_float2(acc[4 * i], acc[4 * i + 1]);
    *reinterpret_cast<float2*>(g.c + static_cast<std::size_t>(row + 8) * g.n + col) =
        make_float2(acc[4 * i + 2], acc[4 * i + 3]);
  }
}

void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

bool hopper() {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major == 9;
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
    ok(cudaMemset(c, 0xFF, static_cast<std::size_t>(m) * n * 4));  // NaN poison
    EXPECT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  }
  ~Gemm() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(ref);
    cublasDestroy(handle);
  }
  void run() {
    GemmArgs g;
    const flashmonoid::detail::Strides sa{0, k, 0}, sb{0, trans_b ? n : k, 0};
    g.tm_a = make_tensor_map(a, k, 1, m, 1, sa, kBM);
    g.tm_b = trans_b ? make_tensor_map(b, n, 1, k, 1, sb, kBK) : make_tensor_map(b, k, 1, n, 1, sb, kBN);
    g.c = c;
    g.m = m;
    g.n = n;
    g.k = k;
    const std::size_t smem = kStages * (kATile + kBTile) * sizeof(T) + 2048;
    auto* kernel = trans_b ? gemm_sm90<1> : gemm_sm90<0>;
    ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<dim3(n / kBN, m / kBM), 384, smem>>>(g);
    ok(cudaGetLastError());
  }
  // Row-major C = A · op(B) through column-major cuBLAS: Cᵀ = op(B)ᵀ · Aᵀ.
  void run_cublas() {
    const float one = 1.0f, zero = 0.0f;
    const cublasOperation_t ob = trans_b ? CUBLAS_OP_N : CUBLAS_OP_T;
    EXPECT_EQ(cublasGemmEx(handle, ob, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, trans_b ? n : k, a, CUDA_R_16BF, k,
                           &zero, ref, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
  }
};

class WgmmaGemm : public ::testing::TestWithParam<int> {};

TEST_P(WgmmaGemm, MatchesCublas) {
  if (!hopper()) GTEST_SKIP() << "needs a compute capability 9.x device";
  for (auto [m, n, k] : {std::tuple{128, 256, 64}, {256, 512, 320}, {1024, 768, 1024}}) {
    Gemm gm(m, n, k, GetParam());
    gm.run();
    gm.run_cublas();
    ok(cudaDeviceSynchronize());
    std::vector<float> c(static_cast<std::size_t>(m) * n), r(c.size());
    ok(cudaMemcpy(c.data(), gm.c, c.size() * 4, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(r.data(), gm.ref, r.size() * 4, cudaMemcpyDeviceToHost));
    double err = 0, scale = 0;
    for (std::size_t i = 0; i < c.size(); ++i) {
      err = std::max(err, std::isnan(c[i]) ? INFINITY : std::abs(static_cast<double>(c[i]) - r[i]));
      scale = std::max(scale, std::abs(static_cast<double>(r[i])));
    }
    // Both accumulate exact bf16 products in fp32, in different orders: ~K·2^-24 relative.
    EXPECT_LE(err, 1e-5 * scale * std::sqrt(static_cast<double>(k))) << m << "x" << n << "x" << k;
  }
}
INSTANTIATE_TEST_SUITE_P(Layouts, WgmmaGemm, ::testing::Values(0, 1),
                         [](const auto& info) { return info.param ? "b_mn_major" : "b_k_major"; });

// A benchmark, not a test (run explicitly: --gtest_also_run_disabled_tests): 8192^3 against cuBLAS,
// median of 10 event-timed runs after 3 warm-ups; prints one JSON record per implementation.
TEST(WgmmaGemmBench, DISABLED_Throughput8192) {
  if (!hopper()) GTEST_SKIP() << "needs a compute capability 9.x device";
  const int s = 8192;
  for (int tb : {0, 1}) {
    Gemm gm(s, s, s, tb);
    for (int which = 0; which < 2; ++which) {
      auto call = [&] { which == 0 ? gm.run() : gm.run_cublas(); };
      for (int i = 0; i < 3; ++i) call();
      std::vector<float> t;
      cudaEvent_t e0, e1;
      ok(cudaEventCreate(&e0));
      ok(cudaEventCreate(&e1));
      for (int i = 0; i < 10; ++i) {
        ok(cudaEventRecord(e0));
        call();
        ok(cudaEventRecord(e1));
        ok(cudaEventSynchronize(e1));
        float ms = 0;
        ok(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      const double ms = t[t.size() / 2];
      std::printf("{\"impl\": \"%s\", \"pass\": \"gemm\", \"b_layout\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, "
                  "\"ms\": %.4f, \"tflops\": %.1f}\n",
                  which == 0 ? "flashmonoid_wgmma" : "cublas", tb ? "mn_major" : "k_major", s, s, s, ms,
                  2.0 * s * s * s / ms / 1e9);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }
  }
}

}  // namespace
