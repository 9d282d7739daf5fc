// Tile vocabulary of the CPU flash path (flash_fwd.cpp, flash_bwd.cpp): AVX2 fp32 vectors, a
// vectorised exp, row reductions, the one block matrix product, and loaders that turn a strided
// fp32/fp16/bf16 tile into a dense fp32 tile. The build targets x86-64-v3 (AVX2 + FMA + F16C).
//
// Why our own micro-kernel rather than the distribution BLAS for the block products (measured on
// this project's 2-core AMD EPYC, Zen 4, one thread): gemm() below runs the forward's tile products
// (96×64×d, 96×d×64; d = 64, 128) at 105-110 GFLOP/s, the AVX2 FMA peak we measured (109.5);
// OpenBLAS 0.3.21's cblas_sgemm reaches 114-116 with its AVX-512 small-matrix kernel. End to end
// (flash forward, s = 2048, one thread) swapping gemm() for cblas_sgemm changed 76/86 GFLOP/s
// (d = 64/128) into 82/79: equal within the machine's ±10% noise. Equal speed, so we keep the
// kernel: no BLAS needed by the library, and no process-wide openblas_set_num_threads(1), which
// calling OpenBLAS from inside our OpenMP workers would otherwise require.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "api/params.hpp"
#include "cpu/numeric.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid::cpu::tiles {

constexpr int kLanes = 8;  // fp32 lanes of one AVX2 register

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// exp(x) for 8 lanes, within 2 ulp of expf over [-87.3, 88.7]; 0 below (so exp(-inf) = 0 exactly,
// which is what masked scores need). x = n·ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series
// to degree 7 (truncation error r^8/8! < 6e-9 relative), 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in two floats so that n·ln2 is subtracted without losing r's low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147182464599609375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-1.904654323148236e-09f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

// tanh(x) for 8 lanes, within 1.4 ulp of tanh (every 64th float checked against float64), for the
// backward's softcap: a scalar std::tanh per score made a softcapped backward 2.3x slower than a
// plain one (s = 2k, d = 64). |x| < 0.625: x + x³·P(x²), P of degree 5 fitted by least squares to
// tanh's relative error in float64 (0.8 ulp in float32); above: 1 − 2/(exp(2|x|) + 1), where the
// result is >= 0.55 so the subtraction loses at most one bit. Odd, so x's sign is copied.
inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 ax = _mm256_andnot_ps(sign, x);
  const __m256 e = exp8(_mm256_add_ps(ax, ax));
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 u = _mm256_mul_ps(ax, ax);
  __m256 p = _mm256_set1_ps(0.0021780235692858696f);
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(-0.008214971981942654f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(0.021715553477406502f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(-0.053949397057294846f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(0.1333322674036026f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(-0.3333333134651184f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(ax, u), p, ax);
  const __m256 r = _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(x, sign));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// max of x[0, n), n a multiple of 8.
inline float row_max(const float* x, int n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int c = 0; c < n; c += kLanes) m = _mm256_max_ps(m, _mm256_loadu_ps(x + c));
  return hmax(m);
}

// x[c] = exp(x[c] - sub) for c in [0, n), n a multiple of 8; returns the sum of the results.
inline float exp_sub_sum(float* x, int n, float sub) {
  __m256 s = _mm256_setzero_ps(), b = _mm256_set1_ps(sub);
  for (int c = 0; c < n; c += kLanes) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + c), b));
    _mm256_storeu_ps(x + c, e);
    s = _mm256_add_ps(s, e);
  }
  return hsum(s);
}

inline void scale_row(float* x, int n, float a) {
  __m256 va = _mm256_set1_ps(a);
  for (int c = 0; c < n; c += kLanes) _mm256_storeu_ps(x + c, _mm256_mul_ps(va, _mm256_loadu_ps(x + c)));
}

// The block matrix product. C (M×N) = A (M×K) · B (K×N), or C += A·B when Acc; all row-major with
// leading dimensions in elements; N is a multiple of 8 (callers pad B's and C's columns).
// Register block: MR rows × NV·8 columns of C stay in MR·NV ymm accumulators while k runs; per k
// step NV loads of B, MR broadcasts of A, MR·NV FMAs. 6×16 (12 accumulators + 2 B + 1 A of the 16
// ymm registers) keeps both FMA pipes busy through the 4-cycle FMA latency.
// GCC 12 keeps c[][] on the stack, storing all 12 accumulators every k step (65 instead of 105
// GFLOP/s at 96×64×128), unless the constant loops are unrolled before scalar replacement: hence
// the pragmas.
// TransA: A is stored transposed, element (r, k) at A[k·lda + r] (the backward's dSᵀ tile feeds
// dQ = dS·K without a transpose); the broadcasts are scalar loads either way.
template <int MR, int NV, bool Acc, bool TransA = false>
inline void micro_kernel(int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
  __m256 c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      c[r][v] = Acc ? _mm256_loadu_ps(C + r * ldc + v * kLanes) : _mm256_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m256 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm256_loadu_ps(B + static_cast<std::int64_t>(k) * ldb + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m256 a = _mm256_broadcast_ss(TransA ? A + static_cast<std::int64_t>(k) * lda + r : A + r * lda + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(C + r * ldc + v * kLanes, c[r][v]);
}

constexpr int kMR = 6;

template <int NV, bool Acc, bool TransA>
inline void gemm_panel(int M, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
  const auto a_rows = [&](int i) { return TransA ? A + i : A + i * lda; };
  int i = 0;
  for (; i + kMR <= M; i += kMR) micro_kernel<kMR, NV, Acc, TransA>(K, a_rows(i), lda, B, ldb, C + i * ldc, ldc);
  const float* a = a_rows(i);
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: micro_kernel<5, NV, Acc, TransA>(K, a, lda, B, ldb, c, ldc); break;
    case 4: micro_kernel<4, NV, Acc, TransA>(K, a, lda, B, ldb, c, ldc); break;
    case 3: micro_kernel<3, NV, Acc, TransA>(K, a, lda, B, ldb, c, ldc); break;
    case 2: micro_kernel<2, NV, Acc, TransA>(K, a, lda, B, ldb, c, ldc); break;
    case 1: micro_kernel<1, NV, Acc, TransA>(K, a, lda, B, ldb, c, ldc); break;
    default: break;
  }
}

// Column panels outermost: one K×16 panel of B (4 KiB at K = 64) stays in L1 while the row blocks
// of A stream past it.
template <bool Acc, bool TransA = false>
inline void gemm(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
  int j = 0;
  for (; j + 2 * kLanes <= N; j += 2 * kLanes) gemm_panel<2, Acc, TransA>(M, K, A, lda, B + j, ldb, C + j, ldc);
  if (j < N) gemm_panel<1, Acc, TransA>(M, K, A, lda, B + j, ldb, C + j, ldc);
}

// dst[c] = mul · src[c] for c < d, src a row of dtype t; fp16 via F16C (exact, like half_to_float).
inline void load_row(const void* base, DType t, std::int64_t offset, int d, float mul, float* dst) {
  int c = 0;
  __m256 vm = _mm256_set1_ps(mul);
  if (t == DType::f32) {
    const float* src = static_cast<const float*>(base) + offset;
    for (; c + kLanes <= d; c += kLanes) _mm256_storeu_ps(dst + c, _mm256_mul_ps(vm, _mm256_loadu_ps(src + c)));
    for (; c < d; ++c) dst[c] = mul * src[c];
  } else {
    const std::uint16_t* src = static_cast<const std::uint16_t*>(base) + offset;
    for (; c + kLanes <= d; c += kLanes) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
      __m256 f = t == DType::f16 ? _mm256_cvtph_ps(h)
                                 : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      _mm256_storeu_ps(dst + c, _mm256_mul_ps(vm, f));
    }
    for (; c < d; ++c) dst[c] = mul * (t == DType::f16 ? half_to_float(src[c]) : bf16_to_float(src[c]));
  }
}

// dst (rows_pad × ld) <- mul · rows [0, rows) of a tensor, row r at element row_offset(r); rows
// [rows, rows_pad) and columns [d, ld) are zeroed so that products over the padding add nothing.
template <class RowOffset>
inline void load_rows(const void* base, DType t, RowOffset&& row_offset, int rows, int rows_pad, int d, int ld,
                      float mul, float* dst) {
  for (int r = 0; r < rows_pad; ++r) {
    float* row = dst + static_cast<std::int64_t>(r) * ld;
    int c = 0;
    if (r < rows) {
      load_row(base, t, row_offset(r), d, mul, row);
      c = d;
    }
    for (; c < ld; ++c) row[c] = 0.0f;
  }
}

// The same for rows [0, rows) of head `head` starting at row row0 of a strided tensor.
inline void load_tile(const void* base, DType t, const detail::Strides& st, int b, std::int64_t row0, int head,
                      int rows, int rows_pad, int d, int ld, float mul, float* dst) {
  load_rows(base, t, [&](int r) { return detail::offset_of(st, b, row0 + r, head); }, rows, rows_pad, d, ld, mul, dst);
}

// dst (d × ld) <- the transpose of load_rows' tile: dst[c·ld + r] = mul · src[r][c], columns
// [rows, ld) zeroed. tmp holds one row (d floats).
template <class RowOffset>
inline void load_rows_transposed(const void* base, DType t, RowOffset&& row_offset, int rows, int d, int ld,
                                 float mul, float* tmp, float* dst) {
  for (int r = 0; r < rows; ++r) {
    load_row(base, t, row_offset(r), d, mul, tmp);
    for (int c = 0; c < d; ++c) dst[static_cast<std::int64_t>(c) * ld + r] = tmp[c];
  }
  for (int c = 0; c < d; ++c)
    for (int r = rows; r < ld; ++r) dst[static_cast<std::int64_t>(c) * ld + r] = 0.0f;
}

// The row at element `offset` of a tensor of dtype t <- src[0, d) (fp32), rounded to nearest even.
inline void store_row(void* base, DType t, std::int64_t offset, int d, const float* src) {
  if (t == DType::f32) {
    float* dst = static_cast<float*>(base) + offset;
    for (int c = 0; c < d; ++c) dst[c] = src[c];
  } else {
    for (int c = 0; c < d; ++c) store(base, t, offset + c, src[c]);
  }
}

}  // namespace flashmonoid::cpu::tiles
