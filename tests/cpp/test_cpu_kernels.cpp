// The per-ISA CPU kernels (src/cpu/kernels.hpp) on their own, every table this CPU can run: the
// AVX2 one, the 16-lane source emulated on AVX2, and the real AVX-512 one where cpuid has it.
// Plus the one ISA decision (src/cpu/isa.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"

namespace fmtest {
namespace {

namespace cpu = flashmonoid::cpu;

struct Table {
  std::string name;
  const cpu::Kernels* kn;
};

std::vector<Table> tables() {
  std::vector<Table> t{{"avx2", &cpu::kernels_avx2()}, {"avx512_emulated", &cpu::kernels_avx512_emulated()}};
  if (cpu::cpu_has(cpu::Isa::avx512)) t.push_back({"avx512", &cpu::kernels_avx512()});
  return t;
}

float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Error of y against the exact value r, in units of the last place of r rounded to float.
double ulp_error(float y, double r) {
  const float rf = static_cast<float>(r);
  const double ulp = static_cast<double>(std::nextafter(rf, INFINITY)) - rf;
  return std::abs(static_cast<double>(y) - r) / ulp;
}

// simd::exp2's stated bound (src/cpu/simd.hpp), through exp2_sub_sum with mul = 1, sub = 0: every 97th float
// of [-126, 8] (where 2^x is a normal float, up to the forward's lazy-rescale margin), plus the
// values it must return exactly.
TEST(CpuKernels, Exp2WithinOneUlp) {
  for (const Table& t : tables()) {
    double worst = 0.0;
    float worst_x = 0.0f;
    std::vector<float> x;
    auto flush = [&] {
      std::vector<float> y = x;
      y.resize((y.size() + 7) / 8 * 8, 0.0f);
      t.kn->exp2_sub_sum(y.data(), static_cast<int>(y.size()), 1.0f, 0.0f);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double e = ulp_error(y[i], std::exp2(static_cast<double>(x[i])));
        if (e > worst) {
          worst = e;
          worst_x = x[i];
        }
      }
      x.clear();
    };
    for (std::uint32_t sign : {0u, 0x80000000u}) {
      const std::uint32_t end = bits_of(sign ? -126.0f : 8.0f);
      for (std::uint32_t u = sign; u <= end; u += 97) {
        x.push_back(float_of(u));
        if (x.size() == 4096) flush();
      }
      x.push_back(float_of(end));
      flush();
    }
    EXPECT_LE(worst, 0.95) << t.name << " at x = " << worst_x;
    std::printf("%s: exp2 max error %.3f ulp (at x = %.9g)\n", t.name.c_str(), worst, worst_x);

    float special[16] = {-INFINITY, -1000.0f, -127.0f, -126.5f, 0.0f, -0.0f, -1.0f, -0.5f,
                         -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const float sum = t.kn->exp2_sub_sum(special, 16, 1.0f, 0.0f);
    EXPECT_EQ(special[0], 0.0f) << t.name;
    EXPECT_EQ(special[1], 0.0f) << t.name;
    EXPECT_EQ(special[2], 0.0f) << t.name;
    EXPECT_EQ(special[3], 0.0f) << t.name;
    EXPECT_EQ(special[4], 1.0f) << t.name;
    EXPECT_EQ(special[5], 1.0f) << t.name;
    EXPECT_EQ(special[6], 0.5f) << t.name;
    EXPECT_NEAR(sum, 2.5 + std::sqrt(0.5), 1e-6) << t.name;
    for (float& v : special) v = NAN;
    t.kn->exp2_sub_sum(special, 16, 1.0f, 0.0f);
    EXPECT_TRUE(std::isnan(special[0]) && std::isnan(special[15])) << t.name;
  }
}

// C = A·B in every form (overwrite/accumulate, A plain/transposed) against float64, over shapes
// that hit every remainder path (rows mod 6 and 8, columns mod 32, 16 and 8); columns past N
// must stay untouched.
TEST(CpuKernels, GemmMatchesFloat64) {
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal;
  const int ms[] = {1, 2, 5, 6, 7, 8, 9, 13, 17, 64, 96};
  const int ns[] = {8, 16, 24, 32, 40, 56, 64, 72, 128, 136};
  const int ks[] = {1, 7, 64, 128};
  for (const Table& t : tables())
    for (int form = 0; form < 4; ++form) {
      const bool acc = form & 1, trans = form & 2;
      const cpu::GemmFn fn = acc ? (trans ? t.kn->gemm_at_acc : t.kn->gemm_acc) : (trans ? t.kn->gemm_at : t.kn->gemm);
      for (int M : ms)
        for (int N : ns)
          for (int K : ks) {
            const int lda = trans ? M + 3 : K + 3, ldb = N + 5, ldc = N + 8;
            std::vector<float> A(static_cast<std::size_t>(trans ? K : M) * lda), B(static_cast<std::size_t>(K) * ldb),
                C(static_cast<std::size_t>(M) * ldc);
            for (float& x : A) x = normal(gen);
            for (float& x : B) x = normal(gen);
            for (float& x : C) x = normal(gen);
            const std::vector<float> C0 = C;
            fn(M, N, K, A.data(), lda, B.data(), ldb, C.data(), ldc);
            double worst = 0.0;
            for (int r = 0; r < M; ++r)
              for (int c = 0; c < ldc; ++c) {
                const float got = C[r * ldc + c];
                if (c >= N) {
                  ASSERT_EQ(bits_of(got), bits_of(C0[r * ldc + c])) << t.name << " wrote past N";
                  continue;
                }
                double ref = acc ? C0[r * ldc + c] : 0.0, mag = std::abs(ref);
                for (int k = 0; k < K; ++k) {
                  const double a = trans ? A[k * lda + r] : A[r * lda + k];
                  ref += a * B[k * ldb + c];
                  mag += std::abs(a * B[k * ldb + c]);
                }
                worst = std::max(worst, std::abs(got - ref) / mag);
              }
            // fp32 accumulation of K + 1 terms: relative to Σ|terms|, at most (K + 1)·2^-24.
            ASSERT_LE(worst, (K + 1) * 6e-8) << t.name << " form " << form << " M" << M << " N" << N << " K" << K;
          }
    }
}

TEST(CpuKernels, RowMaxAndScale) {
  std::mt19937 gen(99);
  std::normal_distribution<float> normal;
  for (const Table& t : tables())
    for (int n : {8, 16, 24, 72, 128, 136}) {
      std::vector<float> x(n);
      for (float& v : x) v = normal(gen);
      x[n - 3] = 7.5f;
      EXPECT_EQ(t.kn->row_max(x.data(), n), 7.5f) << t.name << " n" << n;
      std::vector<float> y = x;
      t.kn->scale_row(y.data(), n, 0.25f);
      for (int c = 0; c < n; ++c) EXPECT_EQ(y[c], 0.25f * x[c]) << t.name;
    }
}

TEST(CpuIsa, ContextAndEnvironmentChooseTheIsa) {
  const char* env = std::getenv("FLASHMONOID_CPU_ISA");
  const bool forced = env != nullptr && std::string(env) == "avx2";
  const cpu::Isa best = cpu::cpu_has(cpu::Isa::avx512) ? cpu::Isa::avx512 : cpu::Isa::avx2;
  EXPECT_EQ(cpu::default_isa(), forced ? cpu::Isa::avx2 : best);
  EXPECT_EQ(cpu::isa_for(flashmonoid::CpuIsa::best), cpu::default_isa());
  EXPECT_EQ(cpu::isa_for(flashmonoid::CpuIsa::avx2), cpu::Isa::avx2);
  EXPECT_EQ(cpu::kernels_for(cpu::Isa::avx2).isa, cpu::Isa::avx2);
  if (cpu::cpu_has(cpu::Isa::avx512)) EXPECT_EQ(cpu::kernels_for(cpu::Isa::avx512).isa, cpu::Isa::avx512);
  std::printf("CPU has AVX-512: %s; default ISA: %s\n", cpu::cpu_has(cpu::Isa::avx512) ? "yes" : "no",
              cpu::to_string(cpu::default_isa()));
}

// The public API's Context::cpu_isa reaches the kernels: forcing AVX2 gives exactly the AVX2
// table's bits, and the default gives the default ISA's.
TEST(CpuIsa, ContextSelectsTheKernels) {
  Shape s;
  s.s_q = 200;
  s.s_k = 300;
  s.h = 2;
  s.h_k = 2;
  s.d = 40;
  Problem pb(s);
  flashmonoid::Context ctx;
  ctx.cpu_isa = flashmonoid::CpuIsa::avx2;
  auto [o_api, l_api] = pb.forward(ctx);
  auto [o_avx2, l_avx2] = pb.flash(cpu::kernels_avx2());
  EXPECT_EQ(o_api.buf, o_avx2.buf);
  auto [o_best, l_best] = pb.forward(flashmonoid::Context{});
  auto [o_def, l_def] = pb.flash(cpu::kernels_for(cpu::default_isa()));
  EXPECT_EQ(o_best.buf, o_def.buf);
}

}  // namespace
}  // namespace fmtest
