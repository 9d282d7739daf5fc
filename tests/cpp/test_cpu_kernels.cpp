// The per-ISA CPU kernels (src/cpu/kernels.hpp) on their own, every table this CPU can run: the
// AVX2 one, the 16-lane sources emulated on AVX2 (with and without bf16 products), and the real
// AVX-512 ones where cpuid has them. Plus the one ISA decision (src/cpu/isa.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "cpu/flash_tiles.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/numeric.hpp"

namespace fmtest {
namespace {

namespace cpu = flashmonoid::cpu;

struct Table {
  std::string name;
  const cpu::Kernels* kn;
};

std::vector<Table> tables() {
  std::vector<Table> t{{"avx2", &cpu::kernels_avx2()},
                       {"avx512_emulated", &cpu::kernels_avx512_emulated()},
                       {"avx512_bf16_emulated", &cpu::kernels_avx512_bf16_emulated()},
                       {"amx_emulated", &cpu::kernels_amx_emulated()}};
  if (cpu::cpu_has(cpu::Isa::avx512)) t.push_back({"avx512", &cpu::kernels_avx512()});
  if (cpu::cpu_has(cpu::Isa::avx512_bf16)) t.push_back({"avx512_bf16", &cpu::kernels_avx512_bf16()});
  if (cpu::cpu_has(cpu::Isa::amx_bf16)) t.push_back({"amx_bf16", &cpu::kernels_amx()});
  return t;
}

// The tables with bf16 products.
std::vector<Table> bf16_tables() {
  std::vector<Table> t;
  for (const Table& x : tables())
    if (x.kn->gemm_bf16 != nullptr) t.push_back(x);
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

// exp2 of one row through softmax_rows with mul = 1 and the row's max held at 0 (running max 0,
// lazy margin +inf): the probabilities are 2^x.
float exp2_row(const cpu::Kernels& kn, float* x, int n) {
  float m_run = 0.0f, sum = 0.0f;
  kn.softmax_rows(x, 1, n, 1.0f, INFINITY, &m_run, &sum);
  return sum;
}

// simd::exp2's stated bound (src/cpu/simd.hpp), through softmax_rows (exp2_row): every 97th float
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
      exp2_row(*t.kn, y.data(), static_cast<int>(y.size()));
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
    const float sum = exp2_row(*t.kn, special, 16);
    EXPECT_EQ(special[0], 0.0f) << t.name;
    EXPECT_EQ(special[1], 0.0f) << t.name;
    EXPECT_EQ(special[2], 0.0f) << t.name;
    EXPECT_EQ(special[3], 0.0f) << t.name;
    EXPECT_EQ(special[4], 1.0f) << t.name;
    EXPECT_EQ(special[5], 1.0f) << t.name;
    EXPECT_EQ(special[6], 0.5f) << t.name;
    EXPECT_NEAR(sum, 2.5 + std::sqrt(0.5), 1e-6) << t.name;
    for (float& v : special) v = NAN;
    exp2_row(*t.kn, special, 16);
    EXPECT_TRUE(std::isnan(special[0]) && std::isnan(special[15])) << t.name;
  }
}

// A product's outcome against float64: the largest error of C (M×N, leading dimension ldc) from
// (C0 if acc) + Σ_k term(r, c, k), relative to Σ|terms|, and whether a column past N moved.
struct Check {
  double worst = 0.0;
  bool wrote_past_n = false;
};

template <class Term>
Check check_product(int M, int N, int ldc, int terms, bool acc, const std::vector<float>& C,
                    const std::vector<float>& C0, Term&& term) {
  Check e;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < ldc; ++c) {
      const float got = C[r * ldc + c];
      if (c >= N) {
        e.wrote_past_n |= bits_of(got) != bits_of(C0[r * ldc + c]);
        continue;
      }
      double ref = acc ? C0[r * ldc + c] : 0.0, mag = std::abs(ref);
      for (int k = 0; k < terms; ++k) {
        const double x = term(r, c, k);
        ref += x;
        mag += std::abs(x);
      }
      e.worst = std::max(e.worst, std::abs(got - ref) / mag);
    }
  return e;
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
            const Check e = check_product(M, N, ldc, K, acc, C, C0, [&](int r, int c, int k) {
              return static_cast<double>(trans ? A[k * lda + r] : A[r * lda + k]) * B[k * ldb + c];
            });
            ASSERT_FALSE(e.wrote_past_n) << t.name;
            const double worst = e.worst;
            // fp32 accumulation of K + 1 terms: relative to Σ|terms|, at most (K + 1)·2^-24.
            ASSERT_LE(worst, (K + 1) * 6e-8) << t.name << " form " << form << " M" << M << " N" << N << " K" << K;
          }
    }
}

// S = A·Bᵀ (dot_rows) against float64 over shapes that hit every remainder path (rows mod 2 and 4,
// head dims mod 16 and 8), B's rows strided; columns of S past n must stay untouched.
TEST(CpuKernels, DotRowsMatchFloat64) {
  std::mt19937 gen(99);
  std::normal_distribution<float> normal;
  for (const Table& t : tables())
    for (int M : {1, 2, 3, 4, 5, 9, 16, 32})
      for (int N : {4, 8, 12, 64})
        for (int D : {8, 16, 24, 64, 136, 256}) {
          const int lda = D + 8, ldb = D + 24, lds = N + 8;
          std::vector<float> A(static_cast<std::size_t>(M) * lda), B(static_cast<std::size_t>(N) * ldb),
              S(static_cast<std::size_t>(M) * lds);
          for (float& x : A) x = normal(gen);
          for (float& x : B) x = normal(gen);
          for (float& x : S) x = normal(gen);
          const std::vector<float> S0 = S;
          t.kn->dot_rows(M, N, D, A.data(), lda, B.data(), ldb, S.data(), lds);
          const Check e = check_product(M, N, lds, D, false, S, S0, [&](int r, int c, int k) {
            return static_cast<double>(A[r * lda + k]) * B[c * ldb + k];
          });
          ASSERT_FALSE(e.wrote_past_n) << t.name;
          ASSERT_LE(e.worst, (D + 1) * 6e-8) << t.name << " M" << M << " N" << N << " D" << D;
        }
}

// Cache rows for the in-place decoding products (dot_rows_at, pv_rows_at): `keys` rows of d
// elements of type t per head, scattered in one buffer in shuffled order, each followed by NaN
// elements (a load past d poisons every result it touches), the last row ending the buffer.
struct CacheRows {
  std::vector<unsigned char> buf;
  std::vector<const void*> rows;  // (heads, keys)
  std::vector<double> value;      // (heads, keys, d)  the elements as stored
};

CacheRows cache_rows(flashmonoid::DType t, int heads, int keys, int d, std::mt19937& gen) {
  namespace cpu = flashmonoid::cpu;
  const int n = heads * keys, stride = d + 5;
  const std::size_t esize = flashmonoid::dtype_size(t);
  CacheRows c;
  c.buf.resize(static_cast<std::size_t>(n) * stride * esize);
  for (int i = 0; i < n * stride; ++i) cpu::store(c.buf.data(), t, i, NAN);
  std::vector<int> slot(n);
  for (int i = 0; i < n; ++i) slot[i] = i;
  std::shuffle(slot.begin(), slot.end(), gen);
  std::normal_distribution<float> normal;
  c.rows.resize(n);
  c.value.resize(static_cast<std::size_t>(n) * d);
  for (int i = 0; i < n; ++i) {
    const std::int64_t at = static_cast<std::int64_t>(slot[i]) * stride + (slot[i] == n - 1 ? stride - d : 0);
    c.rows[i] = c.buf.data() + at * esize;
    for (int x = 0; x < d; ++x) {
      cpu::store(c.buf.data(), t, at + x, normal(gen));
      c.value[static_cast<std::size_t>(i) * d + x] = cpu::load(c.buf.data(), t, at + x);
    }
  }
  return c;
}

// O's rows (rows, ld) with each whole block of `block` columns split, its even columns then its odd
// ones: the layout pv_rows_at[kRowBf16] keeps (Kernels::join_bf16_rows undoes it).
std::vector<float> split_rows(const std::vector<float>& o, int rows, int ld, int block) {
  std::vector<float> out = o;
  for (int r = 0; r < rows; ++r)
    for (int x = 0; x + block <= ld; x += block)
      for (int i = 0; i < block / 2; ++i) {
        out[r * ld + x + i] = o[r * ld + x + 2 * i];
        out[r * ld + x + block / 2 + i] = o[r * ld + x + 2 * i + 1];
      }
  return out;
}

// The in-place decoding products against float64, every element type, head dims with and without
// a vector remainder (d mod 16 and 8), several heads and row counts; scores past n and O's columns
// past d untouched, no element past a row's d read (the NaN after each row); heads outermost (the
// head-major walk) the same bits as keys outermost; 2-byte rows the same bits as fp32 rows of their
// values.
TEST(CpuKernels, InPlaceDecodingProductsMatchFloat64) {
  namespace cpu = flashmonoid::cpu;
  using flashmonoid::DType;
  std::mt19937 gen(77);
  std::normal_distribution<float> normal;
  const std::pair<DType, int> types[] = {{DType::f32, cpu::kRowF32}, {DType::bf16, cpu::kRowBf16},
                                         {DType::f16, cpu::kRowF16}};
  for (const Table& tb : tables())
    for (auto [dtype, t] : types)
      for (int heads : {1, 3})
        for (int m : {1, 2, 3, 4, 5, 9})
          for (int n : {4, 5, 12, 64})
            for (int d : {8, 24, 40, 59, 64, 111, 128, 136}) {
              SCOPED_TRACE(tb.name + " " + flashmonoid::to_string(dtype) + " heads " + std::to_string(heads) + " m " +
                           std::to_string(m) + " n " + std::to_string(n) + " d " + std::to_string(d));
              const int keys = 64, dp = (d + 7) / 8 * 8, rows = heads * m, cols = (n + 3) / 4 * 4, lds = cols + 4;
              const CacheRows k = cache_rows(dtype, heads, keys, d, gen), v = cache_rows(dtype, heads, keys, d, gen);
              std::vector<float> A(static_cast<std::size_t>(rows) * dp, 0.0f), S(static_cast<std::size_t>(rows) * lds);
              for (int r = 0; r < rows; ++r)
                for (int x = 0; x < d; ++x) A[r * dp + x] = normal(gen);
              for (float& x : S) x = normal(gen);
              const std::vector<float> S0 = S;
              tb.kn->dot_rows_at[t](heads, m, cols, d, A.data(), dp, k.rows.data(), keys, false, S.data(), lds);
              std::vector<float> S_heads = S0;  // heads outermost: the same bits
              tb.kn->dot_rows_at[t](heads, m, cols, d, A.data(), dp, k.rows.data(), keys, true, S_heads.data(), lds);
              ASSERT_EQ(0, std::memcmp(S.data(), S_heads.data(), S.size() * sizeof(float)))
                  << "scores, heads outermost";
              // Row r of S, A, P and O is head r / m's.
              const auto at = [&](int r, int c, int x) { return (static_cast<std::size_t>(r / m) * keys + c) * d + x; };
              const Check es = check_product(rows, cols, lds, d, false, S, S0, [&](int r, int c, int x) {
                return static_cast<double>(A[r * dp + x]) * k.value[at(r, c, x)];
              });
              ASSERT_FALSE(es.wrote_past_n) << "scores past n";
              ASSERT_LE(es.worst, (d + 1) * 6e-8) << "scores";
              std::vector<float> P(static_cast<std::size_t>(rows) * lds), O(static_cast<std::size_t>(rows) * dp);
              for (float& x : P) x = std::abs(normal(gen));
              for (int r = 0; r < rows; ++r)
                for (int x = 0; x < dp; ++x) O[r * dp + x] = x < d ? normal(gen) : 0.0f;
              const std::vector<float> O0 = O;
              // bf16: O's rows go in and come out split (Kernels::join_bf16_rows)
              const auto pv = [&](bool heads_outer, std::vector<float>& o) {
                if (t == cpu::kRowBf16) o = split_rows(o, rows, dp, tb.kn->panel);
                tb.kn->pv_rows_at[t](heads, m, n, d, P.data(), lds, v.rows.data(), keys, heads_outer, o.data(), dp);
                if (t == cpu::kRowBf16) tb.kn->join_bf16_rows(o.data(), rows, d, dp);
              };
              pv(false, O);
              std::vector<float> O_heads = O0;
              pv(true, O_heads);
              ASSERT_EQ(0, std::memcmp(O.data(), O_heads.data(), O.size() * sizeof(float))) << "P·V, heads outermost";
              const Check eo = check_product(rows, d, dp, n, true, O, O0, [&](int r, int x, int c) {
                return static_cast<double>(P[r * lds + c]) * v.value[at(r, c, x)];
              });
              ASSERT_FALSE(eo.wrote_past_n) << "O past d";
              ASSERT_LE(eo.worst, (n + 1) * 6e-8) << "P·V";
              if (t == cpu::kRowF32) continue;
              // 2-byte rows convert exactly: the same bits as their values' fp32 rows through the fp32
              // products (the same FMAs in the same order, however the conversion is arranged).
              std::vector<float> kf(k.value.begin(), k.value.end()), vf(v.value.begin(), v.value.end());
              std::vector<const void*> kr(k.rows.size()), vr(v.rows.size());
              for (std::size_t i = 0; i < kr.size(); ++i) {
                kr[i] = kf.data() + i * d;
                vr[i] = vf.data() + i * d;
              }
              std::vector<float> S_f = S0, O_f = O0;
              tb.kn->dot_rows_at[cpu::kRowF32](heads, m, cols, d, A.data(), dp, kr.data(), keys, false, S_f.data(), lds);
              tb.kn->pv_rows_at[cpu::kRowF32](heads, m, n, d, P.data(), lds, vr.data(), keys, false, O_f.data(), dp);
              ASSERT_EQ(0, std::memcmp(S.data(), S_f.data(), S.size() * sizeof(float))) << "scores against fp32 rows";
              ASSERT_EQ(0, std::memcmp(O.data(), O_f.data(), O.size() * sizeof(float))) << "P·V against fp32 rows";
            }
}

// softmax_rows over several rows: each row's running max moves to the row's max (times mul) only
// where that exceeds it by more than the lazy margin; the probabilities are 2^(x·mul - m) with the
// new m (exp2's bound, tested above), their sums in fp32; a row whose max stays -inf gives zeros.
TEST(CpuKernels, SoftmaxRowsAndScale) {
  std::mt19937 gen(99);
  std::normal_distribution<float> normal;
  const float mul = 1.5f, lazy = 8.0f;
  for (const Table& t : tables())
    for (int n : {8, 16, 24, 72, 128, 136}) {
      const int rows = 5;
      std::vector<float> x(static_cast<std::size_t>(rows) * n);
      for (float& v : x) v = normal(gen);
      for (int r = 0; r < rows; ++r) x[r * n + n - 3] = 7.5f;  // each row's max: 7.5 · mul = 11.25
      for (int c = 0; c < n; ++c) x[4 * n + c] = -INFINITY;
      // Running maxima: moved (-inf; 11.25 > 3 + 8), kept (4 and 20: 11.25 <= 12 and 28), -inf kept.
      std::vector<float> m_run = {-INFINITY, 3.0f, 4.0f, 20.0f, -INFINITY}, sums(rows);
      const std::vector<float> want_m = {11.25f, 11.25f, 4.0f, 20.0f, -INFINITY};
      std::vector<float> y = x;
      t.kn->softmax_rows(y.data(), rows, n, mul, lazy, m_run.data(), sums.data());
      for (int r = 0; r < rows; ++r) {
        EXPECT_EQ(m_run[r], want_m[r]) << t.name << " n" << n << " row " << r;
        double sum = 0.0, mag = 0.0;
        for (int c = 0; c < n; ++c) {
          const float got = y[r * n + c];
          if (r == 4) {
            EXPECT_EQ(got, 0.0f) << t.name;
            continue;
          }
          const double arg = static_cast<double>(std::fma(x[r * n + c], mul, -want_m[r]));
          EXPECT_LE(ulp_error(got, std::exp2(arg)), 0.95) << t.name << " n" << n << " row " << r << " col " << c;
          sum += got;
          mag += std::abs(got);
        }
        // n fp32 additions of the probabilities as computed: within n·2^-24 of their exact sum.
        EXPECT_LE(std::abs(sums[r] - sum), n * 6e-8 * mag) << t.name << " n" << n << " row " << r;
      }
      std::vector<float> z = x;
      t.kn->scale_row(z.data(), n, 0.25f);
      for (int c = 0; c < n; ++c) EXPECT_EQ(z[c], 0.25f * x[c]) << t.name;
    }
}

std::uint16_t bf16_bits(float x) { return static_cast<std::uint16_t>(bits_of(x) >> 16); }  // x exact in bf16

std::uint32_t pair(float lo, float hi) { return bf16_bits(lo) | static_cast<std::uint32_t>(bf16_bits(hi)) << 16; }

// The products from bf16 pairs, plain and accumulating, against float64 over shapes that hit every
// remainder path (rows mod 8, columns mod 32, 16 and 8; odd and even pair counts); columns past N
// must stay untouched. A (M, K2) pairs along its rows, B (K2, N) pairs down its columns.
TEST(CpuKernels, Bf16PairGemmMatchesFloat64) {
  std::mt19937 gen(4321);
  std::normal_distribution<float> normal;
  auto bf16_normal = [&] { return flashmonoid::cpu::round_to(DType::bf16, normal(gen)); };
  const int ms[] = {1, 5, 7, 8, 9, 17, 96};
  const int ns[] = {8, 16, 24, 32, 40, 72, 128};
  const int k2s[] = {1, 3, 32, 64, 21};  // 21: 16 pairs on AMX tiles, 5 through VDPBF16PS
  for (const Table& t : bf16_tables())
    for (bool acc : {false, true}) {
      const cpu::GemmPairsFn fn = acc ? t.kn->gemm_bf16_acc : t.kn->gemm_bf16;
      for (int M : ms)
        for (int N : ns)
          for (int K2 : k2s) {
            const int lda = K2 + 3, ldb = N + 5, ldc = N + 8;
            std::vector<std::uint32_t> A(static_cast<std::size_t>(M) * lda), B(static_cast<std::size_t>(K2) * ldb);
            std::vector<float> C(static_cast<std::size_t>(M) * ldc);
            for (auto& x : A) x = pair(bf16_normal(), bf16_normal());
            for (auto& x : B) x = pair(bf16_normal(), bf16_normal());
            for (float& x : C) x = normal(gen);
            const std::vector<float> C0 = C;
            fn(M, N, K2, A.data(), lda, B.data(), ldb, C.data(), ldc);
            // Term k: half k % 2 (0 low, 1 high) of pair k / 2.
            auto half = [](std::uint32_t p, int h) { return static_cast<double>(float_of(h ? p & 0xFFFF0000u : p << 16)); };
            const Check e = check_product(M, N, ldc, 2 * K2, acc, C, C0, [&](int r, int c, int k) {
              return half(A[r * lda + k / 2], k % 2) * half(B[k / 2 * ldb + c], k % 2);
            });
            ASSERT_FALSE(e.wrote_past_n) << t.name;
            const double worst = e.worst;
            // fp32 accumulation of 2·K2 + 1 exact terms: relative to Σ|terms|, at most (2·K2 + 1)·2^-24.
            ASSERT_LE(worst, (2 * K2 + 1) * 6e-8) << t.name << (acc ? " acc" : "") << " M" << M << " N" << N << " K2" << K2;
          }
    }
}

// One lane of VDPBF16PS through the accumulating product (M = 1, N = 8, K2 = 1): c + a.hi·b.hi +
// a.lo·b.lo as Intel's pseudo-code defines it (src/cpu/simd_bf16.hpp), on every bf16 table: the
// emulated one, and the real one where the CPU has AVX512_BF16 (so that a CPU computing it
// otherwise shows up here, not as a vaguer accuracy loss).
float dot_lane(const cpu::Kernels& kn, float c, std::uint32_t a, std::uint32_t b) {
  std::uint32_t bs[8];
  float cs[8];
  for (int i = 0; i < 8; ++i) {
    bs[i] = b;
    cs[i] = c;
  }
  kn.gemm_bf16_acc(1, 8, 1, &a, 1, bs, 8, cs, 8);
  for (int i = 1; i < 8; ++i) EXPECT_EQ(bits_of(cs[i]), bits_of(cs[0]));
  return cs[0];
}

// tiles::dot_f64 (the backward's D = rowsum(dO ∘ O)): within double rounding of a long double sum
// at every length (the 16-, 4- and 1-element steps).
TEST(CpuTiles, DotF64MatchesLongDouble) {
  std::mt19937 gen(20261129);
  std::normal_distribution<float> normal;
  for (int n : {0, 1, 3, 4, 5, 15, 16, 17, 20, 31, 59, 64, 111, 128, 256}) {
    std::vector<float> a(n), b(n);
    for (int c = 0; c < n; ++c) a[c] = normal(gen), b[c] = normal(gen);
    long double exact = 0.0L, magnitude = 0.0L;
    for (int c = 0; c < n; ++c) {
      exact += static_cast<long double>(a[c]) * b[c];
      magnitude += std::fabs(static_cast<long double>(a[c]) * b[c]);
    }
    const double got = cpu::tiles::dot_f64(a.data(), b.data(), n);
    EXPECT_LE(std::fabs(static_cast<long double>(got) - exact), (n + 1) * 0x1p-52L * magnitude) << "n " << n;
  }
}

TEST(CpuKernels, Bf16DotFollowsIntelPseudoCode) {
  const float denormal_bf16 = float_of(0x00010000u);   // the smallest bf16 denormal, 9.2e-41
  for (const Table& t : bf16_tables()) {
    const cpu::Kernels& kn = *t.kn;
    // The high halves' product first, each FMA rounded to nearest even: 2^24 + 2 + 1 ties to
    // 2^24 + 4, minus 1 stays there (low first would give 2^24 + 2 - 1 -> 2^24, then 2^24 + 1 -> 2^24).
    EXPECT_EQ(dot_lane(kn, 16777218.0f, pair(-1.0f, 1.0f), pair(1.0f, 1.0f)), 16777220.0f) << t.name;
    // Exact products, fp32 sums: 3·5 + 0.5·0.25.
    EXPECT_EQ(dot_lane(kn, 0.0f, pair(0.5f, 3.0f), pair(0.25f, 5.0f)), 15.125f) << t.name;
    // Denormal bf16 inputs read as zero: 9.2e-41 · 2^100 would be 1.2e-10.
    EXPECT_EQ(dot_lane(kn, 0.0f, pair(0.0f, denormal_bf16), pair(0.0f, 0x1p100f)), 0.0f) << t.name;
    EXPECT_EQ(dot_lane(kn, 0.0f, pair(denormal_bf16, 0.0f), pair(0x1p100f, 0.0f)), 0.0f) << t.name;
    // A denormal accumulator reads as zero: 1e-40 + 2^-63·2^-63 would be 2^-126 + 1e-40.
    EXPECT_EQ(dot_lane(kn, 1e-40f, pair(0.0f, 0x1p-63f), pair(0.0f, 0x1p-63f)), 0x1p-126f) << t.name;
    // A denormal result is flushed: 2^-70 · 2^-70 = 2^-140.
    EXPECT_EQ(dot_lane(kn, 0.0f, pair(0.0f, 0x1p-70f), pair(0.0f, 0x1p-70f)), 0.0f) << t.name;
    EXPECT_EQ(dot_lane(kn, 0.0f, pair(0x1p-63f, 0.0f), pair(0x1p-63f, 0.0f)), 0x1p-126f) << t.name;  // normal: kept
    EXPECT_TRUE(std::isnan(dot_lane(kn, 1.0f, pair(NAN, 1.0f), pair(1.0f, 1.0f)))) << t.name;
    EXPECT_EQ(dot_lane(kn, 1.0f, pair(0.0f, INFINITY), pair(0.0f, 2.0f)), INFINITY) << t.name;
  }
}

// P's conversion to bf16 pairs (VCVTNE2PS2BF16): round to nearest even, zero and denormals to zero
// of their sign, NaN quiet, infinities kept, overflow to infinity; otherwise float_to_bf16's bits.
TEST(CpuKernels, Bf16PairsOfFloatsFollowIntelPseudoCode) {
  std::mt19937 gen(77);
  std::normal_distribution<float> normal;
  for (const Table& t : bf16_tables()) {
    for (int n : {16, 32, 48, 128}) {
      std::vector<float> x(n);
      for (float& v : x) v = normal(gen) * 8.0f;
      const float special[] = {1.0f + 0x1p-8f,  1.0f + 3 * 0x1p-8f, -1.0f - 0x1p-8f, 1e-40f,   -1e-40f,  0.0f,
                               -0.0f,           INFINITY,           -INFINITY,       NAN,      0x1.fffffep127f,
                               0x1p-126f,       -0x1.0101p-126f};
      for (std::size_t i = 0; i < std::size(special) && i < x.size(); ++i) x[i] = special[i];
      std::vector<std::uint32_t> pairs(n / 2);
      t.kn->to_bf16_pairs(x.data(), n, pairs.data());
      for (int i = 0; i < n; ++i) {
        const std::uint16_t got = static_cast<std::uint16_t>(pairs[i / 2] >> (16 * (i % 2)));
        const std::uint32_t u = bits_of(x[i]);
        std::uint16_t want = flashmonoid::cpu::float_to_bf16(x[i]);
        if ((u & 0x7F800000u) == 0) want = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
        EXPECT_EQ(got, want) << t.name << " n" << n << " x[" << i << "] = " << x[i];
      }
      if (n >= 16) {
        const auto half = [&](int i) { return static_cast<std::uint16_t>(pairs[i / 2] >> (16 * (i % 2))); };
        EXPECT_EQ(half(0), 0x3F80) << "1 + 2^-8 ties to even (1)";
        EXPECT_EQ(half(1), 0x3F82) << "1 + 3·2^-8 ties to even (1 + 2^-6)";
        EXPECT_EQ(half(3), 0x0000) << "denormal to +0";
        EXPECT_EQ(half(4), 0x8000) << "denormal to -0";
        EXPECT_EQ(half(10), 0x7F80) << "FLT_MAX rounds to infinity";
      }
    }
  }
}

TEST(CpuIsa, ContextAndEnvironmentChooseTheIsa) {
  const char* env = std::getenv("FLASHMONOID_CPU_ISA");
  const std::string want = env != nullptr ? env : "";
  const cpu::Isa best = cpu::cpu_has(cpu::Isa::amx_bf16)      ? cpu::Isa::amx_bf16
                        : cpu::cpu_has(cpu::Isa::avx512_bf16) ? cpu::Isa::avx512_bf16
                        : cpu::cpu_has(cpu::Isa::avx512)      ? cpu::Isa::avx512
                                                              : cpu::Isa::avx2;
  const cpu::Isa by_default =
      best == cpu::Isa::amx_bf16 || cpu::bf16_products_by_default() ? best : std::min(best, cpu::Isa::avx512);
  const cpu::Isa expected = want == "avx2"          ? cpu::Isa::avx2
                            : want == "amx_bf16"    ? best
                            : want == "avx512_bf16" ? std::min(best, cpu::Isa::avx512_bf16)
                            : want == "avx512"      ? std::min(best, cpu::Isa::avx512)
                                                    : by_default;
  EXPECT_EQ(cpu::default_isa(), expected);
  EXPECT_EQ(cpu::isa_for(flashmonoid::CpuIsa::best), cpu::default_isa());
  EXPECT_EQ(cpu::isa_for(flashmonoid::CpuIsa::avx2), cpu::Isa::avx2);
  for (cpu::Isa isa : {cpu::Isa::avx2, cpu::Isa::avx512, cpu::Isa::avx512_bf16, cpu::Isa::amx_bf16})
    if (cpu::cpu_has(isa)) {
      EXPECT_EQ(cpu::kernels_for(isa).isa, isa);
      EXPECT_EQ(cpu::kernels_for(isa).gemm_bf16 != nullptr, isa >= cpu::Isa::avx512_bf16);
    }
  std::printf("CPU has AVX-512: %s, AVX512_BF16: %s, AMX-BF16: %s; default ISA: %s\n",
              cpu::cpu_has(cpu::Isa::avx512) ? "yes" : "no", cpu::cpu_has(cpu::Isa::avx512_bf16) ? "yes" : "no",
              cpu::cpu_has(cpu::Isa::amx_bf16) ? "yes" : "no", cpu::to_string(cpu::default_isa()));
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

// The in-place decoding scores from bf16 pairs (dot_pairs_at) on every table with them, against
// float64: Q's pairs against K's rows read as pairs, exact products summed in fp32; the same cases
// and checks as the fp32 products above (no element past d read: NaN there), heads outermost the
// same bits.
TEST(CpuKernels, InPlaceDecodingPairProductsMatchFloat64) {
  namespace cpu = flashmonoid::cpu;
  using flashmonoid::DType;
  std::mt19937 gen(78);
  std::normal_distribution<float> normal;
  auto bf16_normal = [&] { return cpu::round_to(DType::bf16, normal(gen)); };
  auto half = [](std::uint32_t p, int h) { return static_cast<double>(float_of(h ? p & 0xFFFF0000u : p << 16)); };
  for (const Table& tb : bf16_tables()) {
    ASSERT_NE(tb.kn->dot_pairs_at, nullptr) << tb.name;
    for (int heads : {1, 3})
      for (int m : {1, 2, 4, 5, 9})
        for (int n : {4, 5, 12, 63, 64})
          for (int d : {8, 24, 40, 59, 64, 111, 128, 136}) {
            SCOPED_TRACE(tb.name + " heads " + std::to_string(heads) + " m " + std::to_string(m) + " n " +
                         std::to_string(n) + " d " + std::to_string(d));
            const int keys = 64, d2 = (d + 1) / 2, lda = (d2 + 7) / 8 * 8, rows = heads * m;
            const int cols = (n + 3) / 4 * 4, lds = cols + 4;
            const CacheRows k = cache_rows(DType::bf16, heads, keys, d, gen);
            std::vector<std::uint32_t> A(static_cast<std::size_t>(rows) * lda, 0u);
            for (int r = 0; r < rows; ++r)
              for (int j = 0; j < d2; ++j) A[r * lda + j] = pair(bf16_normal(), 2 * j + 1 < d ? bf16_normal() : 0.0f);
            std::vector<float> S(static_cast<std::size_t>(rows) * lds);
            for (float& x : S) x = normal(gen);
            const std::vector<float> S0 = S;
            tb.kn->dot_pairs_at(heads, m, cols, d, A.data(), lda, k.rows.data(), keys, false, S.data(), lds);
            std::vector<float> S_heads = S0;
            tb.kn->dot_pairs_at(heads, m, cols, d, A.data(), lda, k.rows.data(), keys, true, S_heads.data(), lds);
            ASSERT_EQ(0, std::memcmp(S.data(), S_heads.data(), S.size() * sizeof(float))) << "scores, heads outermost";
            const auto at = [&](int r, int c, int x) { return (static_cast<std::size_t>(r / m) * keys + c) * d + x; };
            const Check es = check_product(rows, cols, lds, d, false, S, S0, [&](int r, int c, int x) {
              return half(A[r * lda + x / 2], x % 2) * k.value[at(r, c, x)];
            });
            ASSERT_FALSE(es.wrote_past_n) << "scores past n";
            ASSERT_LE(es.worst, (d + 1) * 6e-8) << "scores";
          }
  }
}

}  // namespace
}  // namespace fmtest
