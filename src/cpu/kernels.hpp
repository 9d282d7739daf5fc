// The ISA-specific kernels of the CPU flash path: the block matrix product and the online-softmax
// row operations. One generic source (kernels_impl.hpp) compiled once per ISA, each copy in its
// own translation unit: kernels_avx2.cpp (x86-64-v3, runs on every supported CPU),
// kernels_avx512.cpp (AVX-512 F/BW/VL/DQ flags), kernels_avx512_bf16.cpp (the same plus
// AVX512_BF16) and kernels_amx.cpp (the same plus AMX), the last three called only where cpuid says
// so. flash_fwd.cpp and flash_bwd.cpp stay x86-64-v3 and reach them through this table, chosen once
// per call by kernels_for(isa) (src/cpu/isa.hpp).
//
// Own kernels rather than a BLAS or small-GEMM library, by measurement at the flash tiles' shapes
// (one thread): OpenBLAS 0.3.21's cblas_sgemm in place of the products changed the forward from
// 76/86 to 82/79 GFLOP/s (d = 64/128, Zen 4): equal within noise; torch's bmm (MKL) ran 47-57
// GFLOP/s where these kernels ran 61-63 (Zen 3). A library would also need
// openblas_set_num_threads(1) process-wide to be called from inside our OpenMP workers.
#pragma once

#include <cstdint>

#include "cpu/isa.hpp"

namespace flashmonoid::cpu {

// C (M×N) = A (M×K) · B (K×N), row-major with leading dimensions in elements; N a multiple of 8
// (callers pad B's and C's columns). The _acc forms add into C; the _at forms read A stored
// transposed, element (r, k) at A[k·lda + r].
using GemmFn = void (*)(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc);
// The same product from bf16 pairs (src/cpu/simd_bf16.hpp), fp32 accumulation: A (M×K2) and B
// (K2×N) of pairs, i.e. 2·K2 bf16 along the summed dimension, A's pairs along its rows and B's down
// its columns; C fp32. The _acc form adds into C.
using GemmPairsFn = void (*)(int M, int N, int K2, const std::uint32_t* A, int lda, const std::uint32_t* B, int ldb,
                             float* C, int ldc);

// The element types of cache rows the decoding products read (Kernels::dot_rows_at, pv_rows_at).
enum RowType : int { kRowF32 = 0, kRowBf16 = 1, kRowF16 = 2 };

struct Kernels {
  Isa isa;
  GemmFn gemm, gemm_acc, gemm_at, gemm_at_acc;
  // The forward's online softmax over one tile, rows r < m of s (row stride n, n a multiple of 8):
  //   t = max_c s[r][c] · mul;  m_run[r] <- t if t > m_run[r] + lazy, else m_run[r] stays;
  //   s[r][c] <- 2^(s[r][c]·mul - m_run[r])  (one FMA, then simd::exp2; 0 where m_run[r] = -inf);
  //   sums[r] <- Σ_c s[r][c].
  // mul = log2(e) takes natural-unit scores to the log2 units of the softmax state
  // (detail/monoid.hpp) without rounding the product; lazy is the lazy-rescale margin, so that
  // every exponent is <= lazy. One call per tile: the rows' reductions overlap one another.
  void (*softmax_rows)(float* s, int m, int n, float mul, float lazy, float* m_run, float* sums);
  // x[c] *= a for c < n, n a multiple of 8.
  void (*scale_row)(float* x, int n, float a);
  // The backward's score gradients over n elements (a multiple of 8), element c:
  //   P = 2^(s[c]·log2(e) - lse[c]);  s[c] <- P·z[c];  dp[c] <- P·(dp[c]·z[c] - dsum[c]) · (1 - th[c]²)
  // with the score s[c] in natural units and lse[c] in log2 units (one FMA, then simd::exp2);
  // z = nullptr means z[c] = 1 (no dropout) and th = nullptr drops the softcap factor.
  void (*softmax_grad)(int n, const float* lse, const float* dsum, const float* z, const float* th, float* s,
                       float* dp);
  // Columns of B one register block of the products holds (16 for AVX2, 32 for AVX-512): callers
  // that pack B in column panels of this width (flash_fwd.cpp) keep each panel contiguous in L1.
  int panel;
  // Whether the forward prefetches the next K/V tiles into L2 (software prefetch). The K/V tiles of
  // one head (1 MiB at s = 2k, d = 64, fp32) exceed a Zen 3 core's 512 KiB L2: there it made the
  // AVX2 forward 5-10% faster. On the Xeon (4th/5th gen, 2 MiB L2) the AVX-512 forward ran 0-7%
  // faster without it (s = 2k and 8k, d = 64 and 128, 1 and 2 threads): the hardware prefetchers
  // keep up and the prefetches stalled on fill buffers.
  bool prefetch_kv;
  // S (m, n) = A (m, dp) · Bᵀ, B (n, dp) row-major (lda, ldb, lds in elements): the decoding
  // path's scores (flash_fwd.cpp), query rows against K's rows with K not transposed; n a multiple
  // of 4, dp of 8.
  void (*dot_rows)(int m, int n, int dp, const float* A, int lda, const float* B, int ldb, float* S, int lds);
  // Only where the ISA has a bf16 dot product (VDPBF16PS), else nullptr: the products from bf16
  // pairs, and pairs[j] <- (bf16(x[2j]), bf16(x[2j + 1])) for 2j < n (n a multiple of 16; round to
  // nearest even, denormals to zero), which turns the forward's probabilities into an A operand.
  GemmPairsFn gemm_bf16 = nullptr, gemm_bf16_acc = nullptr;
  void (*to_bf16_pairs)(const float* x, int n, std::uint32_t* pairs) = nullptr;
  // The decoding path's in-place products (flash_fwd.cpp, decode_in_place), K and V read where the
  // cache holds them and converted in registers, without a stage: over `heads` KV heads
  // at once, rows[h·ld_rows + c] pointing at key c's row of head h, d elements of the cache's type
  // (index kRowF32, kRowBf16, kRowF16), never read past them. Blocks of keys (4 for the scores, 8
  // for P·V): keys outermost, heads inside (a (keys, h_k, d) cache's memory order); or with
  // heads_outer (head-major caches, (h_k, keys, d), and where flash_fwd.cpp's walk_heads_outer says)
  // each head's keys in turn, each block's successor prefetched into L1 in address order (a block's
  // rows are read a vector of each in turn, which the hardware prefetchers do not follow within a
  // page; measured at heads_side_by_side and walk_heads_outer). The order changes no bits: each
  // head's sums are its own. Rows of A, S, P
  // and O for head h start at row h·m; A and O rows hold dp = d rounded up to 8 floats, A's zero
  // past d.
  //   dot_rows_at: S[h·m + r][c] = A[h·m + r] · K_c for c < n (n a multiple of 4), summed as
  //   dot_rows sums;  pv_rows_at: O[h·m + r] += P[h·m + r][c] · V_c for c = 0 .. n - 1 in turn,
  //   the FMAs of gemm_acc (O past d unchanged).
  using RowsDotFn = void (*)(int heads, int m, int n, int d, const float* A, int lda, const void* const* rows,
                             int ld_rows, bool heads_outer, float* S, int lds);
  using RowsPvFn = void (*)(int heads, int m, int n, int d, const float* P, int ldp, const void* const* rows,
                            int ld_rows, bool heads_outer, float* O, int ldo);
  RowsDotFn dot_rows_at[3] = {};
  RowsPvFn pv_rows_at[3] = {};
  // pv_rows_at[kRowBf16] keeps O's rows with each whole block of `panel` columns split, its even
  // columns then its odd ones (the columns past the last whole block in order): O = 0 and scale_row
  // are the same either way; join_bf16_rows(O, rows, d, ldo) puts the rows' columns back in order.
  void (*join_bf16_rows)(float* O, int rows, int d, int ldo) = nullptr;
  // Only where the ISA has a bf16 dot product (VDPBF16PS), else nullptr: dot_rows_at's scores of
  // bf16 rows from pairs, one VDPBF16PS per two products where the fp32 ones convert each element
  // first: A's rows of ceil(d / 2) pairs (unscaled Q; zero past them to a multiple of 8 pairs)
  // against the cache's rows read as pairs along d as they are.
  using RowsDotPairsFn = void (*)(int heads, int m, int n, int d, const std::uint32_t* A, int lda,
                                  const void* const* rows, int ld_rows, bool heads_outer, float* S, int lds);
  RowsDotPairsFn dot_pairs_at = nullptr;
  // Rows of A per register block of dot_rows / dot_rows_at (2 at 8 lanes, 4 at 16): dot_rows_at
  // converts each 2-byte K row once per block of this many rows.
  int dot_row_block = 2;

  template <bool Acc, bool TransA>
  GemmFn gemm_for() const {
    if constexpr (TransA) return Acc ? gemm_at_acc : gemm_at;
    return Acc ? gemm_acc : gemm;
  }
};

const Kernels& kernels_avx2();
const Kernels& kernels_avx512();       // call only where cpu_has(Isa::avx512)
const Kernels& kernels_avx512_bf16();  // call only where cpu_has(Isa::avx512_bf16)
const Kernels& kernels_amx();          // call only where cpu_has(Isa::amx_bf16)

inline const Kernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::avx512: return kernels_avx512();
    case Isa::avx512_bf16: return kernels_avx512_bf16();
    case Isa::amx_bf16: return kernels_amx();
    default: return kernels_avx2();
  }
}

}  // namespace flashmonoid::cpu
