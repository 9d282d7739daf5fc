// The CPU kernels for Intel AMX (AMX-TILE and AMX-BF16, Sapphire Rapids and later): the AVX512_BF16
// table (kernels_avx512_bf16.cpp) with its two products from bf16 pairs on tile registers. One
// TDPBF16PS adds a (16 × 32 bf16) · (32 × 16 bf16) product into a 16 × 16 fp32 tile: 8192
// multiply-adds, 16 times a zmm VDPBF16PS's 512, from operands laid out exactly as the pair products
// already pack them (A's pairs along its rows; B's pairs down its columns, which is AMX's "VNNI" B).
// The softmax, the conversions to pairs and everything fp32 stay AVX-512. CMakeLists.txt compiles
// this file alone with AVX-512, AVX512_BF16 and AMX flags; nothing here may be called unless
// cpu_has(Isa::amx_bf16), which also asked Linux for the tile state (isa.cpp).
//
// The tests also compile this file for AVX2 with FLASHMONOID_KERNELS_EMULATED defined: the tile
// instructions are then the scalar model below (tile registers as arrays, each TDPBF16PS element as
// VDPBF16PS's two FMAs in simd_bf16.hpp), so that the blocking and every remainder path run, and are
// checked against float64, on any CPU.
#include "cpu/kernels_impl.hpp"

#ifndef FLASHMONOID_KERNELS_EMULATED
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace flashmonoid::cpu {

#ifdef FLASHMONOID_KERNELS_EMULATED
const Kernels& kernels_avx512_bf16_emulated();  // the same source as kernels_avx512_bf16, for AVX2
#endif

namespace {

// LDTILECFG's 64-byte operand, palette 1: tile t is rows[t] rows of colsb[t] bytes (at most 16 of 64).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

#ifdef FLASHMONOID_KERNELS_EMULATED
// Eight tile registers of this thread under the last configuration, as 32-bit words.
struct EmulatedTiles {
  TileConfig cfg;
  std::uint32_t t[8][16][16];
};
thread_local EmulatedTiles g_tiles;

void tile_config(const TileConfig& c) {
  g_tiles.cfg = c;
  std::memset(g_tiles.t, 0, sizeof(g_tiles.t));  // LDTILECFG zeroes the tiles
}
template <int T>
void tile_load(const void* src, std::size_t stride) {
  const int rows = g_tiles.cfg.rows[T], words = g_tiles.cfg.colsb[T] / 4;
  for (int r = 0; r < rows; ++r)
    std::memcpy(g_tiles.t[T][r], static_cast<const char*>(src) + r * stride, 4 * static_cast<std::size_t>(words));
}
template <int T>
void tile_store(void* dst, std::size_t stride) {
  const int rows = g_tiles.cfg.rows[T], words = g_tiles.cfg.colsb[T] / 4;
  for (int r = 0; r < rows; ++r)
    std::memcpy(static_cast<char*>(dst) + r * stride, g_tiles.t[T][r], 4 * static_cast<std::size_t>(words));
}
template <int T>
void tile_zero() {
  std::memset(g_tiles.t[T], 0, sizeof(g_tiles.t[T]));
}
// C[m][n] += Σ_k a[m][k].hi·b[k][n].hi + a[m][k].lo·b[k][n].lo, k < A's words, in k order, each pair
// as a VDPBF16PS lane (simd::dot_bf16_pairs: its denormal and rounding rules). Intel's pseudo-code
// for TDPBF16PS adds the low product first and leaves the hardware's internal order open, so the
// tests hold both to the fp32 accumulation bound against float64, not to each other's bits.
template <int C, int A, int B>
void tile_dp() {
  const int rows = g_tiles.cfg.rows[C], cols = g_tiles.cfg.colsb[C] / 4, depth = g_tiles.cfg.colsb[A] / 4;
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < cols; n += 8) {  // the kernels configure 8 or 16 columns
      simd::f32x8 acc;
      std::memcpy(&acc, &g_tiles.t[C][m][n], sizeof(acc));
      for (int k = 0; k < depth; ++k) {
        simd::u32x8 b;
        std::memcpy(&b, &g_tiles.t[B][k][n], sizeof(b));
        acc = simd::dot_bf16_pairs(acc, simd::u32x8{} + g_tiles.t[A][m][k], b);
      }
      std::memcpy(&g_tiles.t[C][m][n], &acc, sizeof(acc));
    }
}
#else
// GCC's tile intrinsics paste the tile number into the instruction's text, so each tile and each
// product used below is spelled out.
void tile_config(const TileConfig& c) { _tile_loadconfig(&c); }
template <int T>
void tile_load(const void* src, std::size_t stride);
template <int T>
void tile_store(void* dst, std::size_t stride);
template <int T>
void tile_zero();
template <int C, int A, int B>
void tile_dp();
#define FM_TILE_LOAD(N)                                \
  template <>                                          \
  void tile_load<N>(const void* src, std::size_t stride) { \
    _tile_loadd(N, src, stride);                       \
  }
#define FM_TILE_C(N)                                   \
  FM_TILE_LOAD(N)                                      \
  template <>                                          \
  void tile_store<N>(void* dst, std::size_t stride) {  \
    _tile_stored(N, dst, stride);                      \
  }                                                    \
  template <>                                          \
  void tile_zero<N>() {                                \
    _tile_zero(N);                                     \
  }
FM_TILE_C(0)
FM_TILE_C(1)
FM_TILE_C(2)
FM_TILE_C(3)
FM_TILE_LOAD(4)
FM_TILE_LOAD(5)
FM_TILE_LOAD(6)
FM_TILE_LOAD(7)
#undef FM_TILE_C
#undef FM_TILE_LOAD
#define FM_TILE_DP(C, A, B) \
  template <>               \
  void tile_dp<C, A, B>() { \
    _tile_dpbf16ps(C, A, B); \
  }
FM_TILE_DP(0, 4, 6)
FM_TILE_DP(1, 4, 7)
FM_TILE_DP(2, 5, 6)
FM_TILE_DP(3, 5, 7)
#undef FM_TILE_DP
#endif

// Tiles: 0-3 the C block (rows i, i + 16) × (columns j, j + 16), 4-5 A's two row tiles, 6-7 B's two
// column tiles; a row or column tile past M or N is configured empty and never touched.
TileConfig block_config(int r0, int r1, int n0, int n1) {
  TileConfig c;
  const int rows[2] = {r0, r1}, cols[2] = {n0, n1};
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      const bool used = rows[a] > 0 && cols[b] > 0;
      c.rows[2 * a + b] = static_cast<std::uint8_t>(used ? rows[a] : 0);
      c.colsb[2 * a + b] = static_cast<std::uint16_t>(used ? 4 * cols[b] : 0);
    }
  for (int a = 0; a < 2; ++a) {
    c.rows[4 + a] = static_cast<std::uint8_t>(rows[a]);
    c.colsb[4 + a] = static_cast<std::uint16_t>(rows[a] > 0 ? 64 : 0);
    c.rows[6 + a] = static_cast<std::uint8_t>(cols[a] > 0 ? 16 : 0);
    c.colsb[6 + a] = static_cast<std::uint16_t>(4 * cols[a]);
  }
  return c;
}

// One C block of up to 32 × 32 over K2 pairs (a multiple of 16): R1 / N1 whether its second row /
// column tile exists. The C tiles are loaded (kAcc) or zeroed, accumulate every k step, then stored.
template <bool kAcc, bool R1, bool N1>
void block(int K2, const std::uint32_t* A, int lda, const std::uint32_t* B, int ldb, float* C, int ldc) {
  const std::size_t sa = 4 * static_cast<std::size_t>(lda), sb = 4 * static_cast<std::size_t>(ldb),
                    sc = 4 * static_cast<std::size_t>(ldc);
  float* c10 = C + 16 * static_cast<std::ptrdiff_t>(ldc);
  if constexpr (kAcc) {
    tile_load<0>(C, sc);
    if constexpr (N1) tile_load<1>(C + 16, sc);
    if constexpr (R1) tile_load<2>(c10, sc);
    if constexpr (R1 && N1) tile_load<3>(c10 + 16, sc);
  } else {
    tile_zero<0>();
    if constexpr (N1) tile_zero<1>();
    if constexpr (R1) tile_zero<2>();
    if constexpr (R1 && N1) tile_zero<3>();
  }
  for (int k = 0; k < K2; k += 16) {
    tile_load<4>(A + k, sa);
    if constexpr (R1) tile_load<5>(A + 16 * static_cast<std::ptrdiff_t>(lda) + k, sa);
    tile_load<6>(B + static_cast<std::ptrdiff_t>(k) * ldb, sb);
    if constexpr (N1) tile_load<7>(B + static_cast<std::ptrdiff_t>(k) * ldb + 16, sb);
    tile_dp<0, 4, 6>();
    if constexpr (N1) tile_dp<1, 4, 7>();
    if constexpr (R1) tile_dp<2, 5, 6>();
    if constexpr (R1 && N1) tile_dp<3, 5, 7>();
  }
  tile_store<0>(C, sc);
  if constexpr (N1) tile_store<1>(C + 16, sc);
  if constexpr (R1) tile_store<2>(c10, sc);
  if constexpr (R1 && N1) tile_store<3>(c10 + 16, sc);
}

// GemmPairsFn on tiles: C (M×N) (+)= A (M×K2 pairs) · B (K2×N pairs), N a multiple of 8. The first
// K2 rounded down to 16 pairs run on AMX in 32 × 32 blocks (the configuration reloaded only when a
// block's remainder shape changes; LDTILECFG runs once per call at least, since other code in the
// thread, torch's oneDNN among it, may have configured the tiles otherwise); the last K2 % 16 pairs
// (head dims not a multiple of 32) and calls under 16 pairs go through VDPBF16PS.
template <bool kAcc>
void gemm_pairs_amx(int M, int N, int K2, const std::uint32_t* A, int lda, const std::uint32_t* B, int ldb, float* C,
                    int ldc) {
  const int kf = K2 / 16 * 16;
#ifdef FLASHMONOID_KERNELS_EMULATED
  const Kernels& vec = kernels_avx512_bf16_emulated();
#else
  const Kernels& vec = kernels_avx512_bf16();
#endif
  if (kf == 0 || M <= 0) {
    (kAcc ? vec.gemm_bf16_acc : vec.gemm_bf16)(M, N, K2, A, lda, B, ldb, C, ldc);
    return;
  }
  int shape = -1;  // (r0, r1, n0, n1) of the loaded configuration, packed
  for (int j = 0; j < N; j += 32) {
    const int n0 = std::min(16, N - j), n1 = std::clamp(N - j - 16, 0, 16);
    for (int i = 0; i < M; i += 32) {
      const int r0 = std::min(16, M - i), r1 = std::clamp(M - i - 16, 0, 16);
      const int s = r0 | r1 << 5 | n0 << 10 | n1 << 15;
      if (s != shape) {
        tile_config(block_config(r0, r1, n0, n1));
        shape = s;
      }
      const std::uint32_t* a = A + static_cast<std::ptrdiff_t>(i) * lda;
      float* c = C + static_cast<std::ptrdiff_t>(i) * ldc + j;
      if (r1 > 0 && n1 > 0)
        block<kAcc, true, true>(kf, a, lda, B + j, ldb, c, ldc);
      else if (r1 > 0)
        block<kAcc, true, false>(kf, a, lda, B + j, ldb, c, ldc);
      else if (n1 > 0)
        block<kAcc, false, true>(kf, a, lda, B + j, ldb, c, ldc);
      else
        block<kAcc, false, false>(kf, a, lda, B + j, ldb, c, ldc);
    }
  }
  if (kf < K2) vec.gemm_bf16_acc(M, N, K2 - kf, A + kf, lda, B + static_cast<std::ptrdiff_t>(kf) * ldb, ldb, C, ldc);
}

}  // namespace

#ifdef FLASHMONOID_KERNELS_EMULATED
const Kernels& kernels_amx_emulated() {
#else
const Kernels& kernels_amx() {
#endif
  static constexpr Kernels k = [] {
    Kernels t = kernels_impl::make_kernels<simd::f32x16, true>(Isa::amx_bf16);
    t.gemm_bf16 = gemm_pairs_amx<false>;
    t.gemm_bf16_acc = gemm_pairs_amx<true>;
    return t;
  }();
  return k;
}

}  // namespace flashmonoid::cpu
