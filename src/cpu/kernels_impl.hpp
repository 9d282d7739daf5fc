// The one source of the CPU kernels (src/cpu/kernels.hpp), generic in the vector type V: included
// by kernels_avx2.cpp (V = f32x8), kernels_avx512.cpp and kernels_avx512_bf16.cpp (V = f32x16),
// each compiled with its own flags. Internal linkage throughout, for the reason given in simd.hpp.
#pragma once

#include "cpu/kernels.hpp"
#include "cpu/simd.hpp"
#include "cpu/simd_bf16.hpp"

namespace flashmonoid::cpu::kernels_impl {
namespace {

using simd::f32x8;

// Register block of C: MR rows × NV vectors of columns stay in MR·NV accumulators while k runs;
// per k step NV loads of B, MR broadcasts of A, MR·NV FMAs.
// - f32x8 (AVX2, 16 ymm): 6×2, 12 accumulators + 2 B + 1 A, enough independent FMAs to cover
//   the 4-cycle FMA latency on both pipes; 105-110 GFLOP/s on the forward's tiles (Zen 4, one
//   core, AVX2 peak 109.5).
// - f32x16 (AVX-512, 32 zmm): 8×2, 16 accumulators + 2 B + 1 A; 8 rows divide both the forward's
//   96-row and the backward's 64-row tiles, so no remainder block runs.
template <class V>
struct Tile;
template <>
struct Tile<simd::f32x8> {
  static constexpr int MR = 6, NV = 2;
};
template <>
struct Tile<simd::f32x16> {
  static constexpr int MR = 8, NV = 2;
};

// What a product's operands hold and what one k step does with them. The micro-kernels below are
// generic in it, so that fp32 and bf16-pair products share their register blocking and loops.
// - F32: A and B fp32, one FMA per (row, vector) and k.
// - Bf16Pairs: A and B bf16 pairs (simd_bf16.hpp), k counting pairs: one VDPBF16PS per
//   (row, vector) adds two products, A's pair broadcast to every lane.
struct F32 {
  using Elem = float;
  template <class V>
  static V load_b(const float* p) {
    return simd::loadu<V>(p);
  }
  template <class V>
  static V madd(V c, float a, V b) {
    return c + a * b;
  }
};

struct Bf16Pairs {
  using Elem = std::uint32_t;
  template <class V>
  static simd::u32_of<V> load_b(const std::uint32_t* p) {
    return simd::load_pairs<V>(p);
  }
  template <class V>
  static V madd(V c, std::uint32_t a, simd::u32_of<V> b) {
    return simd::dot_bf16_pairs(c, a - simd::u32_of<V>{}, b);
  }
};

// GCC 12 keeps c[][] on the stack, storing every accumulator each k step (65 instead of 105
// GFLOP/s at 96×64×128, AVX2), unless the constant loops are unrolled before scalar replacement:
// hence the pragmas.
template <class Op, class V, int MR, int NV, bool Acc, bool TransA, class E = typename Op::Elem>
inline void micro_kernel(int K, const E* A, int lda, const E* B, int ldb, float* C, int ldc) {
  constexpr int L = simd::lanes<V>;
  V c[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = Acc ? simd::loadu<V>(C + r * ldc + v * L) : V{};
  for (int k = 0; k < K; ++k) {
    decltype(Op::template load_b<V>(B)) b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = Op::template load_b<V>(B + static_cast<std::int64_t>(k) * ldb + v * L);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const E a = TransA ? A[static_cast<std::int64_t>(k) * lda + r] : A[r * lda + k];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = Op::madd(c[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) simd::storeu(C + r * ldc + v * L, c[r][v]);
}

// The last rows of a panel, fewer than a full block: one micro-kernel of exactly that height.
template <class Op, class V, int NV, bool Acc, bool TransA, int MR = Tile<V>::MR - 1, class E = typename Op::Elem>
inline void rest_rows(int rows, int K, const E* A, int lda, const E* B, int ldb, float* C, int ldc) {
  if constexpr (MR > 0) {
    if (rows == MR)
      micro_kernel<Op, V, MR, NV, Acc, TransA>(K, A, lda, B, ldb, C, ldc);
    else
      rest_rows<Op, V, NV, Acc, TransA, MR - 1>(rows, K, A, lda, B, ldb, C, ldc);
  }
}

template <class Op, class V, int NV, bool Acc, bool TransA, class E = typename Op::Elem>
inline void gemm_panel(int M, int K, const E* A, int lda, const E* B, int ldb, float* C, int ldc) {
  constexpr int MR = Tile<V>::MR;
  const auto a_rows = [&](int i) { return TransA ? A + i : A + i * lda; };
  int i = 0;
  for (; i + MR <= M; i += MR) micro_kernel<Op, V, MR, NV, Acc, TransA>(K, a_rows(i), lda, B, ldb, C + i * ldc, ldc);
  rest_rows<Op, V, NV, Acc, TransA>(M - i, K, a_rows(i), lda, B, ldb, C + i * ldc, ldc);
}

// Column panels outermost: one K×(NV·L) panel of B (8 KiB at K = 64, AVX-512) stays in L1 while
// the row blocks of A stream past it. Columns left over: one vector of V, then one of 8 lanes.
template <class Op, class V, bool Acc, bool TransA, class E = typename Op::Elem>
void gemm(int M, int N, int K, const E* A, int lda, const E* B, int ldb, float* C, int ldc) {
  constexpr int L = simd::lanes<V>, NV = Tile<V>::NV;
  int j = 0;
  for (; j + NV * L <= N; j += NV * L) gemm_panel<Op, V, NV, Acc, TransA>(M, K, A, lda, B + j, ldb, C + j, ldc);
  if constexpr (NV > 1)
    for (; j + L <= N; j += L) gemm_panel<Op, V, 1, Acc, TransA>(M, K, A, lda, B + j, ldb, C + j, ldc);
  if constexpr (L > 8)
    if (j < N) gemm_panel<Op, f32x8, 1, Acc, TransA>(M, K, A, lda, B + j, ldb, C + j, ldc);
}

// Kernels::dot_rows, dot_rows_at. Register block: RB rows of A × 4 rows of B, each pair's partial
// sums in one vector (RB = 2 at 8 lanes: 8 accumulators + 4 B + 1 A of 16 ymm; 4 at 16 lanes, 21 of
// 32 zmm), then a row of A's 4 sums reduced together (three hadd and one add of the halves: 4 scores
// for about the cost of one reduction tree).
template <class V>
constexpr int kDotRows = simd::lanes<V> == 16 ? 4 : 2;

inline f32x8 to8(f32x8 v) { return v; }
inline f32x8 to8(simd::f32x16 v) { return simd::half<0>(v) + simd::half<1>(v); }

// Cache rows in their own element type as vectors of W's shape (Kernels::dot_rows_at, dot_pairs_at,
// pv_rows_at): Row<kRowF32> floats, Row<kRowBf16> and Row<kRowF16> the bits of bf16 and fp16
// values, as fp32 vectors W; RowPairs bf16 rows as they are, pairs along the row
// (simd_bf16.hpp). load<W>(p) reads one vector: lanes<W> · kPerLane elements; load_part<W, R>(p, n)
// only the first n (fewer), the rest 0.
template <int T>
struct Row;
template <>
struct Row<kRowF32> {
  using E = float;
  static constexpr int kPerLane = 1;
  template <class W>
  static W load(const float* p) {
    return simd::loadu<W>(p);
  }
};
template <>
struct Row<kRowBf16> {
  using E = std::uint16_t;
  static constexpr int kPerLane = 1;
  template <class W>
  static W load(const std::uint16_t* p) {  // bf16 is fp32's upper half: zero-extend, shift
    typedef std::uint16_t H __attribute__((vector_size(sizeof(W) / 2)));
    H h;
    std::memcpy(&h, p, sizeof(H));
    return (W)(__builtin_convertvector(h, simd::u32_of<W>) << 16);
  }
};
template <>
struct Row<kRowF16> {
  using E = std::uint16_t;
  static constexpr int kPerLane = 1;
  template <class W>
  static W load(const std::uint16_t* p) {  // F16C (x86-64-v3), 8 lanes per conversion without AVX-512
    if constexpr (simd::lanes<W> == 8) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
#ifdef __AVX512F__
      // The all-lanes zero-mask form: _mm512_cvtph_ps passes an undefined source GCC 12 warns about.
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF), h);
#else
      const f32x8 lo = load<f32x8>(p), hi = load<f32x8>(p + 8);
      return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    }
  }
};

struct RowPairs {
  using E = std::uint16_t;
  static constexpr int kPerLane = 2;
  template <class W>
  static simd::u32_of<W> load(const std::uint16_t* p) {
    return simd::load_pairs<W>(p);
  }
};

template <class W, class R, class E>
inline auto load_part(const E* p, int n) {
  E buf[simd::lanes<W> * R::kPerLane] = {};
  std::memcpy(buf, p, sizeof(E) * static_cast<std::size_t>(n));
  return R::template load<W>(buf);
}

// Lanes x .. x + lanes<W> of a row of d elements (elements past d read as 0, never loaded).
template <class W, class R, class E>
inline auto load_upto(const E* row, int x, int d) {
  constexpr int k = R::kPerLane;
  return (x + simd::lanes<W>) * k <= d ? R::template load<W>(row + x * k) : load_part<W, R>(row + x * k, d - x * k);
}

// A's rows for dot_block: fp32 vectors, or pairs of bf16 (against RowPairs).
template <class W>
inline W load_a(const float* p) {
  return simd::loadu<W>(p);
}
template <class W>
inline simd::u32_of<W> load_a(const std::uint32_t* p) {
  return simd::load_pairs<W>(p);
}
// acc + a·b lane by lane: one FMA for fp32 vectors, one VDPBF16PS (two products) for pairs.
template <class W>
inline W madd(W acc, W a, W b) {
  return acc + a * b;
}
template <class W>
inline W madd(W acc, simd::u32_of<W> a, simd::u32_of<W> b) {
  return simd::dot_bf16_pairs(acc, a, b);
}

// Kernels::dot_rows, dot_rows_at and dot_pairs_at: RB rows of A (fp32, or bf16 pairs with
// RowPairs) against 4 rows of B (b[c], d elements of R), the register block and reduction described
// at kDotRows.
template <class V, int RB, class R, class A_, class E = typename R::E>
inline void dot_block(int d, const A_* A, int lda, const E* const* b, float* S, int lds) {
  constexpr int L = simd::lanes<V>;
  const int dp = ((d + R::kPerLane - 1) / R::kPerLane + 7) / 8 * 8, full = dp / L * L;  // lanes
  V acc[RB][4];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = V{};
  for (int x = 0; x < full; x += L) {
    decltype(R::template load<V>(b[0])) bv[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) bv[c] = load_upto<V, R>(b[c], x, d);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const auto a = load_a<V>(A + r * lda + x);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = madd<V>(acc[r][c], a, bv[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    f32x8 s[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      s[c] = to8(acc[r][c]);
      if (full < dp) s[c] = madd<f32x8>(s[c], load_a<f32x8>(A + r * lda + full), load_upto<f32x8, R>(b[c], full, d));
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    _mm_storeu_ps(S + r * lds, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// Keys (B's rows) outermost: 4 rows of B stay in L1 while every row block of A passes.
template <class V>
void dot_rows(int m, int n, int dp, const float* A, int lda, const float* B, int ldb, float* S, int lds) {
  constexpr int RB = kDotRows<V>;
  for (int c = 0; c < n; c += 4) {
    const float* b[4];
    for (int u = 0; u < 4; ++u) b[u] = B + static_cast<std::int64_t>(c + u) * ldb;
    int r = 0;
    for (; r + RB <= m; r += RB) dot_block<V, RB, Row<kRowF32>>(dp, A + r * lda, lda, b, S + r * lds + c, lds);
    for (; r < m; ++r) dot_block<V, 1, Row<kRowF32>>(dp, A + r * lda, lda, b, S + r * lds + c, lds);
  }
}

// The lines of rows lo .. hi - 1 of one head (rows[c] pointing at d elements of E) into L1, in
// address order: dot_rows_at and pv_rows_at, the next block of a head-major walk.
template <class E>
inline void prefetch_rows(const void* const* rows, int lo, int hi, int d) {
  const auto bytes = static_cast<std::ptrdiff_t>(d) * static_cast<std::ptrdiff_t>(sizeof(E));
  for (int c = lo; c < hi; ++c) {
    const char* p = static_cast<const char*>(rows[c]);
    for (std::ptrdiff_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    if (bytes % 64 != 0) _mm_prefetch(p + bytes - 1, _MM_HINT_T0);
  }
}

// Blocks of `kb` keys (n a multiple of kb) of `heads` heads, visit(head, first key) keys
// outermost, or heads outermost (heads_outer) with each visit's successor's rows prefetched first
// (prefetch_rows): Kernels::dot_rows_at and pv_rows_at.
template <class E, class Visit>
inline void walk_blocks(int heads, int n, int kb, bool heads_outer, const void* const* rows, int ld_rows, int d,
                        Visit visit) {
  if (!heads_outer) {
    for (int c = 0; c < n; c += kb)
      for (int h = 0; h < heads; ++h) visit(h, c);
    return;
  }
  for (int h = 0; h < heads; ++h)
    for (int c = 0; c < n; c += kb) {
      const bool same = c + kb < n;
      const int nh = same ? h : h + 1, nc = same ? c + kb : 0;
      if (nh < heads) prefetch_rows<E>(rows + static_cast<std::ptrdiff_t>(nh) * ld_rows, nc, std::min(nc + kb, n), d);
      visit(h, c);
    }
}

template <class V, class R, class A_>
void dot_rows_at(int heads, int m, int n, int d, const A_* A, int lda, const void* const* rows, int ld_rows,
                 bool heads_outer, float* S, int lds) {
  using E = typename R::E;
  constexpr int RB = kDotRows<V>;
  walk_blocks<E>(heads, n, 4, heads_outer, rows, ld_rows, d, [&](int h, int c) {
    const E* b[4];
    for (int u = 0; u < 4; ++u) b[u] = static_cast<const E*>(rows[h * ld_rows + c + u]);
    const A_* a = A + static_cast<std::int64_t>(h) * m * lda;
    float* s = S + static_cast<std::int64_t>(h) * m * lds + c;
    int r = 0;
    for (; r + RB <= m; r += RB) dot_block<V, RB, R>(d, a + r * lda, lda, b, s + r * lds, lds);
    for (; r < m; ++r) dot_block<V, 1, R>(d, a + r * lda, lda, b, s + r * lds, lds);
  });
}

// O's columns x .. x + lanes<W> of a head's m rows += P's columns c0 .. c0 + KB times those KB
// V rows: the rows' vectors loaded once, each O vector loaded, added KB times in key order, stored.
template <class W, int KB, class R, class E = typename R::E>
inline void pv_block_at(int x, int d, int m, const float* P, int ldp, const E* const* v, float* O, int ldo) {
  W b[KB];
#pragma GCC unroll 8
  for (int c = 0; c < KB; ++c) b[c] = load_upto<W, R>(v[c], x, d);
  for (int r = 0; r < m; ++r) {
    W o = simd::loadu<W>(O + static_cast<std::int64_t>(r) * ldo + x);
#pragma GCC unroll 8
    for (int c = 0; c < KB; ++c) o = o + P[static_cast<std::int64_t>(r) * ldp + c] * b[c];
    simd::storeu(O + static_cast<std::int64_t>(r) * ldo + x, o);
  }
}

// Even lanes (the columns x, x + 2, ...) and odd lanes of 2·lanes<W> columns back in column order:
// join_bf16_rows.
inline void join_even_odd(f32x8 even, f32x8 odd, f32x8* a, f32x8* b) {
  *a = __builtin_shufflevector(even, odd, 0,8,1,9,2,10,3,11);
  *b = __builtin_shufflevector(even, odd, 4,12,5,13,6,14,7,15);
}
inline void join_even_odd(simd::f32x16 even, simd::f32x16 odd, simd::f32x16* a, simd::f32x16* b) {
  *a = __builtin_shufflevector(even, odd, 0,16,1,17,2,18,3,19,4,20,5,21,6,22,7,23);
  *b = __builtin_shufflevector(even, odd, 8,24,9,25,10,26,11,27,12,28,13,29,14,30,15,31);
}

// pv_block_at for bf16 rows over 2·lanes<W> columns from x: each 32-bit lane of a V row's load
// holds two elements, the even one made fp32 by a shift and the odd one by a mask (one operation
// per lanes<W> elements where the widening load takes two), and O's rows hold those columns split,
// the even ones then the odd ones (join_bf16_rows puts them back in order once per task): the same
// FMAs in the same key order per element as pv_block_at's. Per 8 keys and 2·lanes<W> columns, 16
// conversions instead of 32 at any row count. Xeon, against pv_block_at, one row per KV head (O split
// and joined per block then): MHA 1.03-1.65x at 1, 2 and 16 threads; AMD EPYC (Zen 4), 1 thread,
// this layout against that: GQA 32/8 1.15-1.19x, 2 rows 1.08x, 8 rows 1.21x, one row 0.98-0.99x.
template <class W, int KB>
inline void pv_block_bf16(int x, int d, int m, const float* P, int ldp, const std::uint16_t* const* v, float* O,
                          int ldo) {
  constexpr int L = simd::lanes<W>;
  W ev[KB], od[KB];
#pragma GCC unroll 8
  for (int c = 0; c < KB; ++c) {
    const simd::u32_of<W> b = load_upto<W, RowPairs>(v[c], x / 2, d);
    ev[c] = (W)(b << 16);
    od[c] = (W)(b & 0xFFFF0000u);
  }
  for (int r = 0; r < m; ++r) {
    float* o = O + static_cast<std::int64_t>(r) * ldo + x;
    W even = simd::loadu<W>(o), odd = simd::loadu<W>(o + L);
#pragma GCC unroll 8
    for (int c = 0; c < KB; ++c) {
      const float p = P[static_cast<std::int64_t>(r) * ldp + c];
      even = even + p * ev[c];
      odd = odd + p * od[c];
    }
    simd::storeu(o, even);
    simd::storeu(o + L, odd);
  }
}

// Kernels::join_bf16_rows: rows of O written by pv_rows_at[kRowBf16] back to column order.
template <class V>
void join_bf16_rows(float* O, int rows, int d, int ldo) {
  constexpr int L = simd::lanes<V>;
  const int dp = (d + 7) / 8 * 8;
  for (int r = 0; r < rows; ++r)
    for (int x = 0; x + 2 * L <= dp; x += 2 * L) {
      float* o = O + static_cast<std::int64_t>(r) * ldo + x;
      V lo, hi;
      join_even_odd(simd::loadu<V>(o), simd::loadu<V>(o + L), &lo, &hi);
      simd::storeu(o, lo);
      simd::storeu(o + L, hi);
    }
}

template <class V, int KB, class R, class E = typename R::E>
inline void pv_keys_at(int d, int m, const float* P, int ldp, const E* const* v, float* O, int ldo) {
  constexpr int L = simd::lanes<V>;
  const int dp = (d + 7) / 8 * 8;
  int x = 0;
  if constexpr (std::is_same_v<R, Row<kRowBf16>>)
    for (; x + 2 * L <= dp; x += 2 * L) pv_block_bf16<V, KB>(x, d, m, P, ldp, v, O, ldo);
  for (; x + L <= dp; x += L) pv_block_at<V, KB, R>(x, d, m, P, ldp, v, O, ldo);
  if constexpr (L > 8)
    if (x < dp) pv_block_at<f32x8, KB, R>(x, d, m, P, ldp, v, O, ldo);
}

template <class V, int T>
void pv_rows_at(int heads, int m, int n, int d, const float* P, int ldp, const void* const* rows, int ld_rows,
                bool heads_outer, float* O, int ldo) {
  using R = Row<T>;
  using E = typename R::E;
  constexpr int KB = 8;
  const int whole = n / KB * KB;  // blocks of KB keys, then the rest one key at a time
  walk_blocks<E>(heads, whole, KB, heads_outer, rows, ld_rows, d, [&](int h, int c) {
    const E* v[KB];
    for (int u = 0; u < KB; ++u) v[u] = static_cast<const E*>(rows[h * ld_rows + c + u]);
    pv_keys_at<V, KB, R>(d, m, P + static_cast<std::int64_t>(h) * m * ldp + c, ldp, v,
                         O + static_cast<std::int64_t>(h) * m * ldo, ldo);
  });
  walk_blocks<E>(heads, n - whole, 1, heads_outer, rows + whole, ld_rows, d, [&](int h, int c) {
    const E* v[1] = {static_cast<const E*>(rows[h * ld_rows + whole + c])};
    pv_keys_at<V, 1, R>(d, m, P + static_cast<std::int64_t>(h) * m * ldp + whole + c, ldp, v,
                        O + static_cast<std::int64_t>(h) * m * ldo, ldo);
  });
}

// Row operations over n floats, n a multiple of 8: full vectors of V, then one of 8 lanes.
// R rows of softmax_rows at once, interleaved: one row's chain (max over its vectors, the
// reduction, the new max, the exponentials, their running sum, its reduction) is ~170 cycles of
// latency against ~70 of work on 128 columns at 16 lanes, and the rows are independent: 4 rows at
// a time took a 16×128 tile from 5.1 to 3.6 ns per zmm vector and the forward at d = 64 from 77-80
// to 72 ms (s = 2k, one thread, Xeon). Each row's arithmetic is the same in any group size.
template <class V, int R>
inline void softmax_row_group(float* s, int n, float mul, float lazy, float* m_run, float* sums) {
  constexpr int L = simd::lanes<V>;
  const int full = n / L * L;
  float* x[R];
  V acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    x[r] = s + static_cast<std::int64_t>(r) * n;
    acc[r] = simd::splat<V>(-__builtin_inff());
  }
  for (int c = 0; c < full; c += L)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = simd::vmax(acc[r], simd::loadu<V>(x[r] + c));
  float m_new[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float t = simd::reduce_max(acc[r]);
    if (full < n) {
      const float u = simd::reduce_max(simd::loadu<f32x8>(x[r] + full));
      t = u > t ? u : t;
    }
    t *= mul;
    m_new[r] = t > m_run[r] + lazy ? t : m_run[r];
    m_run[r] = m_new[r];
    acc[r] = V{};
  }
  for (int c = 0; c < full; c += L)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V e = simd::exp2(simd::loadu<V>(x[r] + c) * mul - m_new[r]);  // contracted to one FMA
      simd::storeu(x[r] + c, e);
      acc[r] += e;
    }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float sum = simd::reduce_sum(acc[r]);
    if (full < n) {
      const f32x8 e = simd::exp2(simd::loadu<f32x8>(x[r] + full) * mul - m_new[r]);
      simd::storeu(x[r] + full, e);
      sum += simd::reduce_sum(e);
    }
    sums[r] = sum;
    if (m_new[r] == -__builtin_inff()) {  // every key so far masked: nothing to add
      for (int c = 0; c < n; ++c) x[r][c] = 0.0f;
      sums[r] = 0.0f;
    }
  }
}

template <class V>
void softmax_rows(float* s, int m, int n, float mul, float lazy, float* m_run, float* sums) {
  constexpr int R = 4;
  int r = 0;
  for (; r + R <= m; r += R)
    softmax_row_group<V, R>(s + static_cast<std::int64_t>(r) * n, n, mul, lazy, m_run + r, sums + r);
  for (; r < m; ++r) softmax_row_group<V, 1>(s + static_cast<std::int64_t>(r) * n, n, mul, lazy, m_run + r, sums + r);
}

template <class V>
void scale_row(float* x, int n, float a) {
  int c = 0;
  for (; c + simd::lanes<V> <= n; c += simd::lanes<V>) simd::storeu(x + c, a * simd::loadu<V>(x + c));
  if (c < n) simd::storeu(x + c, a * simd::loadu<f32x8>(x + c));
}

template <class V>
inline void softmax_grad_at(int c, const float* lse, const float* dsum, const float* z, const float* th, float* s,
                            float* dp) {
  const V prob = simd::exp2(simd::loadu<V>(s + c) * simd::kLog2e - simd::loadu<V>(lse + c));  // one FMA
  const V dsum_v = simd::loadu<V>(dsum + c), dp_v = simd::loadu<V>(dp + c);
  V ds;
  if (z != nullptr) {
    const V zv = simd::loadu<V>(z + c);
    simd::storeu(s + c, prob * zv);
    ds = prob * (dp_v * zv - dsum_v);
  } else {
    simd::storeu(s + c, prob);
    ds = prob * (dp_v - dsum_v);
  }
  if (th != nullptr) {
    const V t = simd::loadu<V>(th + c);
    ds = ds * (1.0f - t * t);
  }
  simd::storeu(dp + c, ds);
}

template <class V>
void softmax_grad(int n, const float* lse, const float* dsum, const float* z, const float* th, float* s, float* dp) {
  int c = 0;
  for (; c + simd::lanes<V> <= n; c += simd::lanes<V>) softmax_grad_at<V>(c, lse, dsum, z, th, s, dp);
  if (c < n) softmax_grad_at<f32x8>(c, lse, dsum, z, th, s, dp);
}

// The table for vectors V; with bf16 products (Bf16 = true, the AVX512_BF16 build) it also has the
// pair products and the conversion of probabilities to bf16 pairs.
template <class V, bool Bf16 = false>
constexpr Kernels make_kernels(Isa isa) {
  Kernels k{isa,        gemm<F32, V, false, false>, gemm<F32, V, true, false>, gemm<F32, V, false, true>,
            gemm<F32, V, true, true>, softmax_rows<V>, scale_row<V>, softmax_grad<V>,
            Tile<V>::NV * simd::lanes<V>, simd::lanes<V> == 8, dot_rows<V>};
  k.dot_row_block = kDotRows<V>;
  k.dot_rows_at[kRowF32] = dot_rows_at<V, Row<kRowF32>, float>;
  k.dot_rows_at[kRowBf16] = dot_rows_at<V, Row<kRowBf16>, float>;
  k.dot_rows_at[kRowF16] = dot_rows_at<V, Row<kRowF16>, float>;
  k.pv_rows_at[kRowF32] = pv_rows_at<V, kRowF32>;
  k.pv_rows_at[kRowBf16] = pv_rows_at<V, kRowBf16>;
  k.pv_rows_at[kRowF16] = pv_rows_at<V, kRowF16>;
  k.join_bf16_rows = join_bf16_rows<V>;
  if constexpr (Bf16) {
    k.gemm_bf16 = gemm<Bf16Pairs, V, false, false>;
    k.gemm_bf16_acc = gemm<Bf16Pairs, V, true, false>;
    k.to_bf16_pairs = simd::to_bf16_pairs;
    k.dot_pairs_at = dot_rows_at<V, RowPairs, std::uint32_t>;
  }
  return k;
}

}  // namespace
}  // namespace flashmonoid::cpu::kernels_impl
