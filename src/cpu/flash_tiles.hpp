// Tile vocabulary of the CPU flash path (flash_fwd.cpp, flash_bwd.cpp) that is not ISA-specific:
// AVX2 helpers for the element-wise work, loaders that turn a strided fp32/fp16/bf16 tile into a
// dense fp32 tile, and the bf16 pairs of the products from bf16 inputs. The block products and the online-softmax row operations are in the per-ISA
// kernel table (cpu/kernels.hpp). The build targets x86-64-v3 (AVX2 + FMA + F16C).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "api/params.hpp"
#include "cpu/numeric.hpp"
#include "cpu/simd.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid::cpu::tiles {

constexpr int kLanes = 8;  // fp32 lanes of one AVX2 register

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Scores stay in natural units, s = scale·q·k (the scale folded into Q when it is packed), with
// softcap and ALiBi applied there; the softmax takes them to log2 units, as the online-softmax state
// keeps them (detail/monoid.hpp), inside its exponential: 2^(s·log2(e) - m), one FMA, so that s·log2(e)
// is never rounded on its own. (Folding log2(e) into Q instead rounded every q element once more:
// with scores near 1e4, whose fp32 ulp is 1e-3, the forward then missed the FlashAttention rule in
// about 1 of 75 random draws of Numerics.HugeScoresStayFiniteAndExact.)
using simd::kLog2e;

// exp(x) for 8 lanes: simd::exp (its accuracy and range are stated there).
inline __m256 exp8(__m256 x) { return simd::exp(x); }

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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Σ a[c]·b[c] over c < n in double, in 4 x 4 independent lanes (the lanes then summed in a fixed
// order, so the result depends on n and the data only). The backward's D = rowsum(dO ∘ O) ran as
// one chain of dependent double FMAs: ~1/3 of its Q packing's time (perf, EPYC).
inline double dot_f64(const float* a, const float* b, int n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int c = 0;
  for (; c + 16 <= n; c += 16)
    for (int k = 0; k < 4; ++k)
      acc[k] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + c + 4 * k)), _mm256_cvtps_pd(_mm_loadu_ps(b + c + 4 * k)),
                               acc[k]);
  for (; c + 4 <= n; c += 4)
    acc[0] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + c)), _mm256_cvtps_pd(_mm_loadu_ps(b + c)), acc[0]);
  const __m256d s = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
  double sum = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
  for (; c < n; ++c) sum += static_cast<double>(a[c]) * b[c];
  return sum;
}

// Software prefetch into L2 of [p, p + bytes) in `parts` slices: callers spread one tile's prefetch
// over the iterations of a loop that runs before the tile is read, slice(i) in iteration i. The
// slice size is computed once (64-bit divisions per slice cost ~3% of the forward's time).
class PrefetchL2 {
 public:
  PrefetchL2(const void* p, std::int64_t bytes, int parts)
      : p_(static_cast<const char*>(p)), lines_((bytes + 63) / 64), per_((lines_ + parts - 1) / parts) {}
  void slice(int i) const {
    const std::int64_t end = std::min(lines_, (i + 1) * per_);
    for (std::int64_t l = i * per_; l < end; ++l) _mm_prefetch(p_ + l * 64, _MM_HINT_T1);
  }

 private:
  const char* p_;
  std::int64_t lines_, per_;
};

// The rows of a (b, s, h, d) tensor that one head reads are h·d elements apart (4 KiB at h = 8,
// d = 128, fp32), each in a page of its own, where the hardware prefetchers do not follow: the row
// loops below (Q's tile, the packing of K and V, the output rows) were latency-bound on their loads
// (perf, s = 1k, d = 128, 2 threads: ~8% of the forward's samples). So each loop touches the row
// kRowsAhead ahead of the one it copies, `write` for rows it will store to: the forward 1.4-1.6%
// faster at s = 1k, d = 64 and 128 (AMD EPYC, 2 threads; 4 or 16 rows ahead the same).
constexpr int kRowsAhead = 8;
inline void prefetch_row(const void* base, DType t, std::int64_t offset, int d, bool write = false) {
  const char* p = static_cast<const char*>(base) + offset * static_cast<std::int64_t>(dtype_size(t));
  const std::int64_t bytes = static_cast<std::int64_t>(d) * dtype_size(t);
  for (std::int64_t b = 0; b < bytes; b += 64) {
    if (write) __builtin_prefetch(p + b, 1, 3);
    else __builtin_prefetch(p + b, 0, 3);
  }
  if (bytes % 64 != 0) __builtin_prefetch(p + bytes - 1, write ? 1 : 0, 3);
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
    if (r + kRowsAhead < rows) prefetch_row(base, t, row_offset(r + kRowsAhead), d);
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

// The transpose of an 8×8 block: d[c·ldd + r] = s[r·lds + c] (unpack, shuffle, then 128-bit lane
// swaps: 24 instructions where element by element took 64 loads and 64 scalar stores).
inline void transpose8x8(const float* s, int lds, float* d, int ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + static_cast<std::int64_t>(i) * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(d + static_cast<std::int64_t>(i) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(d + static_cast<std::int64_t>(i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// The same for 16-bit elements, rows and cols multiples of 8 (strides in elements): 8×8 blocks in
// three rounds of unpacks. Only vector loads and stores touch the memory, so any 16-bit data (bf16
// bits in uint32 pair arrays among them) may pass through.
inline void transpose_u16(const void* src, int rows, int cols, int lds, void* dst, int ldd) {
  const auto* s = static_cast<const std::uint16_t*>(src);
  auto* d = static_cast<std::uint16_t*>(dst);
  for (int r0 = 0; r0 < rows; r0 += 8)
    for (int c0 = 0; c0 < cols; c0 += 8) {
      __m128i x[8], a[8], b[8];
      for (int i = 0; i < 8; ++i)
        x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + static_cast<std::int64_t>(r0 + i) * lds + c0));
      for (int i = 0; i < 8; i += 2) {  // rows i, i + 1 interleaved: columns 0-3, then 4-7
        a[i] = _mm_unpacklo_epi16(x[i], x[i + 1]);
        a[i + 1] = _mm_unpackhi_epi16(x[i], x[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {  // rows i .. i + 3: columns (0, 1), (2, 3), (4, 5), (6, 7)
        b[i] = _mm_unpacklo_epi32(a[i], a[i + 2]);
        b[i + 1] = _mm_unpackhi_epi32(a[i], a[i + 2]);
        b[i + 2] = _mm_unpacklo_epi32(a[i + 1], a[i + 3]);
        b[i + 3] = _mm_unpackhi_epi32(a[i + 1], a[i + 3]);
      }
      for (int c = 0; c < 8; ++c) {  // column c: rows 0-3 from b[c / 2], rows 4-7 from b[4 + c / 2]
        const __m128i col = c % 2 == 0 ? _mm_unpacklo_epi64(b[c / 2], b[4 + c / 2])
                                       : _mm_unpackhi_epi64(b[c / 2], b[4 + c / 2]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + static_cast<std::int64_t>(c0 + c) * ldd + r0), col);
      }
    }
}

// dst[c·ldd + r] = src[r·lds + c] for r < rows, c < cols: 8×8 blocks, the edges element by element.
// T: any 4-byte element (floats, or bf16 pairs: the shuffles move bits, never round them).
template <class T>
inline void transpose(const T* src, int rows, int cols, int lds, T* dst, int ldd) {
  static_assert(sizeof(T) == 4, "8×8 blocks of 4-byte elements");
  auto at = [](int i, int j, int ld) { return static_cast<std::int64_t>(i) * ld + j; };
  int r = 0;
  for (; r + 8 <= rows; r += 8) {
    int c = 0;
    for (; c + 8 <= cols; c += 8)
      transpose8x8(reinterpret_cast<const float*>(src + at(r, c, lds)), lds, reinterpret_cast<float*>(dst + at(c, r, ldd)),
                   ldd);
    for (; c < cols; ++c)
      for (int i = r; i < r + 8; ++i) dst[at(c, i, ldd)] = src[at(i, c, lds)];
  }
  for (; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[at(c, r, ldd)] = src[at(r, c, lds)];
}

// The transpose of load_rows' tile, element (c, r) = mul · src[r][c] for c < d, r < cols (columns
// [rows, cols) zeroed), written straight into column panels of `panel` columns (to_panels' layout,
// panel a multiple of 8): (c, r) at dst[(r / panel)·d·panel + c·panel + r % panel]. tmp holds 8 rows
// (8·d floats): rows are loaded 8 at a time and each 8×8 block lands in its panel.
// rows_transposed_panels does it for any 4-byte T, row r written into tmp by load(r, out) (d elements).
template <class T, class LoadRow>
inline void rows_transposed_panels(LoadRow&& load, int rows, int d, int cols, int panel, T* tmp, T* dst) {
  const auto column = [&](int r) { return dst + static_cast<std::int64_t>(r / panel) * d * panel + r % panel; };
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int k = rows - r0 < 8 ? rows - r0 : 8;
    for (int i = 0; i < k; ++i) load(r0 + i, tmp + static_cast<std::int64_t>(i) * d);
    transpose(tmp, k, d, d, column(r0), panel);
  }
  for (int r = rows; r < cols; ++r) {
    T* col = column(r);
    for (int c = 0; c < d; ++c) col[static_cast<std::int64_t>(c) * panel] = T{};
  }
}
template <class RowOffset>
inline void load_rows_transposed_panels(const void* base, DType t, RowOffset&& row_offset, int rows, int d, int cols,
                                        int panel, float mul, float* tmp, float* dst) {
  rows_transposed_panels(
      [&](int r, float* out) {
        if (r + kRowsAhead < rows) prefetch_row(base, t, row_offset(r + kRowsAhead), d);
        load_row(base, t, row_offset(r), d, mul, out);
      },
      rows, d, cols, panel, tmp, dst);
}

// load_rows' tile (rows_pad, cols), written straight into column panels of `panel` columns
// (to_panels' layout): element (r, c) at dst[(c / panel)·rows_pad·panel + r·panel + c % panel];
// rows [rows, rows_pad) and columns [d, cols) zeroed, cols a multiple of panel.
template <class RowOffset>
inline void load_rows_panels(const void* base, DType t, RowOffset&& row_offset, int rows, int rows_pad, int d,
                             int cols, int panel, float mul, float* dst) {
  for (int r = 0; r < rows_pad; ++r) {
    if (r + kRowsAhead < rows) prefetch_row(base, t, row_offset(r + kRowsAhead), d);
    for (int j = 0; j < cols; j += panel) {
      float* out = dst + static_cast<std::int64_t>(j) * rows_pad + static_cast<std::int64_t>(r) * panel;
      const int w = r < rows ? std::clamp(d - j, 0, panel) : 0;
      if (w > 0) load_row(base, t, row_offset(r) + j, w, mul, out);
      for (int c = w; c < panel; ++c) out[c] = 0.0f;
    }
  }
}

// dst <- src (rows, cols), row stride ld, as column panels of `panel` columns, panel after panel:
// element (r, c) at dst[(c / panel)·rows·panel + r·panel + c % panel], columns [cols, panels·panel)
// zeroed. The products' B operands are packed so (panel = Kernels::panel): a row-major tile with
// rows 256 or 512 B apart put the (K, panel) block a micro-kernel streams its row blocks over into
// 16 or 8 of L1's 64 sets, where its lines evicted each other.
// T is float, or std::uint32_t for bf16 pairs (a pair is one element).
template <class T>
inline void to_panels(const T* src, int rows, int cols, int ld, int panel, T* dst) {
  for (int j = 0; j < cols; j += panel)
    for (int r = 0; r < rows; ++r) {
      const T* in = src + static_cast<std::int64_t>(r) * ld + j;
      T* out = dst + static_cast<std::int64_t>(j) * rows + r * panel;
      const int w = cols - j < panel ? cols - j : panel;
      for (int c = 0; c < w; ++c) out[c] = in[c];
      for (int c = w; c < panel; ++c) out[c] = T{};
    }
}

// C (M, N) (+)= A (M, K) · B (K, N), B the first K rows of column panels of (rows, panel)
// (to_panels): one product per panel, each element summed exactly as by one call over all of B.
// T as for to_panels (K then counts pairs).
template <class Gemm, class T>
inline void gemm_panels(Gemm gemm, int M, int N, int K, const T* A, int lda, const T* B, int rows, int panel,
                        float* C, int ldc) {
  for (int j = 0; j < N; j += panel)
    gemm(M, N - j < panel ? N - j : panel, K, A, lda, B + static_cast<std::int64_t>(j) * rows, panel, C + j, ldc);
}

// bf16 pairs (src/cpu/simd_bf16.hpp) for the products from bf16 inputs, the bits copied as they are.
// Pair j of a row of d bf16 paired along d, (src[2j], src[2j + 1]), the element past an odd d
// zero: Q as the A operand of S = QKᵀ, K as the columns of its B operand Kᵀ.
inline std::uint32_t pair_along_row(const std::uint16_t* src, int d, int j) {
  return src[2 * j] | (2 * j + 1 < d ? static_cast<std::uint32_t>(src[2 * j + 1]) << 16 : 0u);
}

// dst[j] <- pair_along_row(src, d, j) for j < (d + 1) / 2: for an even d the row's bits as they are
// (x86 is little-endian: element 2j is the low half of word j).
inline void pairs_of_row(const std::uint16_t* src, int d, std::uint32_t* dst) {
  if (d % 2 == 0) {
    std::memcpy(dst, src, 2 * static_cast<std::size_t>(d));
    return;
  }
  for (int j = 0; j < (d + 1) / 2; ++j) dst[j] = pair_along_row(src, d, j);
}

// dst[c] <- (r0[c], r1[c]) for c < d, zero for c in [d, ld); r1 = nullptr reads zeros: two rows of
// a bf16 tensor paired across rows (V paired along the keys, the B operand of O += P·V).
// 8 columns at a time by interleaving the two rows' 16-bit halves: the scalar loop as compiled took
// ~3x as long (a forward's V tile of d = 128 in cache, AMD EPYC).
inline void pairs_across_rows(const std::uint16_t* r0, const std::uint16_t* r1, int d, int ld, std::uint32_t* dst) {
  int c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + c));
    const __m128i b = r1 != nullptr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + c)) : _mm_setzero_si128();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c), _mm_unpacklo_epi16(a, b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c + 4), _mm_unpackhi_epi16(a, b));
  }
  for (; c < d; ++c) dst[c] = r0[c] | (r1 ? static_cast<std::uint32_t>(r1[c]) << 16 : 0u);
  for (c = d; c < ld; ++c) dst[c] = 0;
}

// The row at element `offset` of a tensor of dtype t <- mul · src[0, d) (fp32), rounded to nearest
// even (the forward normalises its output rows on the way out, mul = 1/l).
inline void store_row(void* base, DType t, std::int64_t offset, int d, const float* src, float mul = 1.0f) {
  if (t == DType::f32) {
    float* dst = static_cast<float*>(base) + offset;
    for (int c = 0; c < d; ++c) dst[c] = mul * src[c];
  } else if (t == DType::bf16) {  // one loop the compiler vectorises
    std::uint16_t* dst = static_cast<std::uint16_t*>(base) + offset;
    for (int c = 0; c < d; ++c) dst[c] = float_to_bf16(mul * src[c]);
  } else {
    for (int c = 0; c < d; ++c) store(base, t, offset + c, mul * src[c]);
  }
}

// store_row for fp32 rows of a multiple of 16 elements at 64-byte aligned addresses (returns false,
// storing nothing, otherwise): non-temporal stores, whole lines written without being read first.
// The caller fences (_mm_sfence) before another thread may read them.
inline bool store_row_stream(void* base, DType t, std::int64_t offset, int d, const float* src, float mul) {
  float* dst = static_cast<float*>(base) + offset;
  if (t != DType::f32 || d % 16 != 0 || (reinterpret_cast<std::uintptr_t>(dst) & 63) != 0) return false;
  const __m256 vm = _mm256_set1_ps(mul);
  for (int c = 0; c < d; c += kLanes) _mm256_stream_ps(dst + c, _mm256_mul_ps(vm, _mm256_loadu_ps(src + c)));
  return true;
}

}  // namespace flashmonoid::cpu::tiles
