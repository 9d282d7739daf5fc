// AMX micro-benchmark (bench/NOTES.md, 2026-11-29 from 04:38 UTC): TSC cycles per TDPBF16PS for the
// CPU forward's two bf16 products as kernels_amx.cpp runs them (S = QKᵀ: 96 rows x 256 keys in 32-column
// panels over 64 pairs; O += P·V: 96 x 128 over 128 pairs, C loaded and stored), against the TDP
// rate alone, tile loads alone (by stride), LDTILECFG and STTILECFG alone, contiguous 1 KB tiles and
// a long-K 32 x 32 block. Not built by CMake:
//   g++ -O2 -std=c++17 -mamx-tile -mamx-bf16 -mavx512f cpu-amx-tile-rates.cpp -o amx && taskset -c 2 ./amx
#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
struct alignas(64) Cfg { uint8_t palette = 1, start = 0, res[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static Cfg cfg_full() { Cfg c; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; } return c; }
// The C block's four tiles loaded (Acc) or zeroed, and stored.
template <bool Acc>
inline void c_begin(float* c, float* c1, size_t sc) {
  if (Acc) { _tile_loadd(0, c, sc); _tile_loadd(1, c + 16, sc); _tile_loadd(2, c1, sc); _tile_loadd(3, c1 + 16, sc); }
  else { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
}
inline void c_end(float* c, float* c1, size_t sc) {
  _tile_stored(0, c, sc); _tile_stored(1, c + 16, sc); _tile_stored(2, c1, sc); _tile_stored(3, c1 + 16, sc);
}
static bool g_check = false;
// Interleaved: A/B loads between the TDPs (A0 B0 dp00, B1 dp01, A1 dp10 dp11) instead of all four first.
template <bool Acc, bool Interleaved = false>
__attribute__((noinline)) void gemm(int M, int N, int K2, const uint32_t* A, int lda, const uint32_t* B, int ldb, float* C, int ldc, bool cfg_each) {
  static Cfg cfg = cfg_full();
  if (cfg_each) _tile_loadconfig(&cfg);
  else if (g_check) { alignas(64) Cfg cur; _tile_storeconfig(&cur); if (std::memcmp(&cur, &cfg, 64) != 0) _tile_loadconfig(&cfg); }
  const size_t sa = 4 * lda, sb = 4 * ldb, sc = 4 * ldc;
  for (int j = 0; j < N; j += 32)
    for (int i = 0; i < M; i += 32) {
      float* c = C + (size_t)i * ldc + j; float* c1 = c + 16 * (size_t)ldc;
      const uint32_t* a = A + (size_t)i * lda;
      c_begin<Acc>(c, c1, sc);
      for (int k = 0; k < K2; k += 16) {
        if (Interleaved) {
          _tile_loadd(4, a + k, sa); _tile_loadd(6, B + (size_t)k * ldb + j, sb);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, B + (size_t)k * ldb + j + 16, sb);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, a + 16 * (size_t)lda + k, sa);
          _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        } else {
          _tile_loadd(4, a + k, sa); _tile_loadd(5, a + 16 * (size_t)lda + k, sa);
          _tile_loadd(6, B + (size_t)k * ldb + j, sb); _tile_loadd(7, B + (size_t)k * ldb + j + 16, sb);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
      }
      c_end(c, c1, sc);
    }
}
__attribute__((noinline)) void tdp_only(int n) { for (int i = 0; i < n; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } }
__attribute__((noinline)) void load_only(int n, const uint32_t* a, size_t s) { for (int i = 0; i < n; ++i) { _tile_loadd(4, a, s); _tile_loadd(5, a + 16, s); _tile_loadd(6, a + 32, s); _tile_loadd(7, a + 48, s); } }
// A and B as contiguous 1 KB tiles: A tile (i16, k) at A + ((i16 * (K2/16)) + k/16) * 256 words; B tile (k, j16) at B + ((k/16) * (N/16) + j16) * 256
template <bool Acc>
__attribute__((noinline)) void gemm_t(int M, int N, int K2, const uint32_t* A, const uint32_t* B, float* C, int ldc) {
  const size_t sc = 4 * ldc; const int kt = K2 / 16, nt = N / 16;
  for (int j = 0; j < N; j += 32)
    for (int i = 0; i < M; i += 32) {
      float* c = C + (size_t)i * ldc + j; float* c1 = c + 16 * (size_t)ldc;
      c_begin<Acc>(c, c1, sc);
      for (int k = 0; k < kt; ++k) {
        _tile_loadd(4, A + ((size_t)(i / 16) * kt + k) * 256, 64); _tile_loadd(5, A + ((size_t)(i / 16 + 1) * kt + k) * 256, 64);
        _tile_loadd(6, B + ((size_t)k * nt + j / 16) * 256, 64); _tile_loadd(7, B + ((size_t)k * nt + j / 16 + 1) * 256, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      c_end(c, c1, sc);
    }
}
__attribute__((noinline)) void load_one(int n, const uint32_t* a, size_t s) { for (int i = 0; i < n; ++i) { _tile_loadd(4, a, s); } }
template <class F> double cyc(F f, int reps) { f(); unsigned long long best = ~0ull; for (int r = 0; r < 7; ++r) { unsigned long long t0 = __rdtsc(); for (int i = 0; i < reps; ++i) f(); best = std::min(best, __rdtsc() - t0); } return double(best) / reps; }
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { std::puts("no AMX permission"); return 1; }
  Cfg c = cfg_full(); _tile_loadconfig(&c);
  std::mt19937 rng(1);
  auto fill = [&](std::vector<uint32_t>& v) { for (auto& x : v) x = (0x3f80u + (rng() & 0x7f)) | (0x3f80u + (rng() & 0x7f)) << 16; };
  // scores: M=96, N=256 (8 panels of 32 cols, each K2 x 32 contiguous), K2=64; PV: M=96, N=128 (4 panels), K2=128
  const int M = 96;
  std::vector<uint32_t> Q(M * 64), Kt(64 * 256), P(M * 128), V(128 * 128);
  fill(Q); fill(Kt); fill(P); fill(V);
  std::vector<float> S(M * 256), O(M * 128, 0.f);
  const double tdp_scores = (M / 32) * 4.0 * (64 / 16) * 8, tdp_pv = (M / 32) * 4.0 * (128 / 16) * 4;
  auto scores_lib = [&](bool each) { for (int p = 0; p < 8; ++p) gemm<false>(M, 32, 64, Q.data(), 64, Kt.data() + p * 64 * 32, 32, S.data() + p * 32, 256, each); };
  auto pv_lib = [&](bool each) { for (int p = 0; p < 4; ++p) gemm<true>(M, 32, 128, P.data(), 128, V.data() + p * 128 * 32, 32, O.data() + p * 32, 128, each); };
  std::printf("peak: tdp only %.1f cycles/TDP\n", cyc([&] { tdp_only(256); }, 200) / 1024);
  std::printf("loads only (L1): %.1f cycles/tile load\n", cyc([&] { load_only(256, Q.data(), 256); }, 200) / 1024);
  std::printf("scores, cfg per call: %.1f cycles/TDP (%.0f per product)\n", cyc([&] { scores_lib(true); }, 200) / tdp_scores, cyc([&] { scores_lib(true); }, 200));
  std::printf("scores, cfg once:     %.1f cycles/TDP\n", cyc([&] { scores_lib(false); }, 200) / tdp_scores);
  g_check = true;
  std::printf("scores, sttilecfg check per call: %.1f cycles/TDP\n", cyc([&] { scores_lib(false); }, 200) / tdp_scores);
  std::printf("pv, sttilecfg check per call:     %.1f cycles/TDP\n", cyc([&] { for (int p = 0; p < 4; ++p) gemm<true>(M, 32, 128, P.data(), 128, V.data() + p * 128 * 32, 32, O.data() + p * 32, 128, false); }, 200) / tdp_pv);
  g_check = false;
  std::printf("pv, cfg once:         %.1f cycles/TDP\n", cyc([&] { for (int p = 0; p < 4; ++p) gemm<true>(M, 32, 128, P.data(), 128, V.data() + p * 128 * 32, 32, O.data() + p * 32, 128, false); }, 200) / tdp_pv);
  { Cfg cc = cfg_full(); alignas(64) Cfg cur;
    std::printf("ldtilecfg alone: %.0f cycles\n", cyc([&] { _tile_loadconfig(&cc); }, 1000));
    std::printf("sttilecfg alone: %.0f cycles\n", cyc([&] { _tile_storeconfig(&cur); }, 1000));
    _tile_loadconfig(&cc); }
  std::printf("scores, interleaved:  %.1f cycles/TDP\n", cyc([&] { for (int p = 0; p < 8; ++p) gemm<false, true>(M, 32, 64, Q.data(), 64, Kt.data() + p * 64 * 32, 32, S.data() + p * 32, 256, false); }, 200) / tdp_scores);
  std::printf("pv, cfg per call:     %.1f cycles/TDP (%.0f per product)\n", cyc([&] { pv_lib(true); }, 200) / tdp_pv, cyc([&] { pv_lib(true); }, 200));
  std::printf("pv, interleaved:      %.1f cycles/TDP\n", cyc([&] { for (int p = 0; p < 4; ++p) gemm<true, true>(M, 32, 128, P.data(), 128, V.data() + p * 128 * 32, 32, O.data() + p * 32, 128, false); }, 200) / tdp_pv);
  std::vector<uint32_t> big(16 * 1024 * 4); fill(big);
  for (size_t st : {64, 128, 256, 512, 1024}) std::printf("loads only, stride %zu: %.1f cycles/load (4 tiles), %.1f (one tile)\n", st, cyc([&] { load_only(256, big.data(), st); }, 200) / 1024, cyc([&] { load_one(256, big.data(), st); }, 200) / 256);
  std::printf("scores, contiguous tiles: %.1f cycles/TDP\n", cyc([&] { gemm_t<false>(M, 256, 64, Q.data(), Kt.data(), S.data(), 256); }, 200) / tdp_scores);
  std::printf("pv, contiguous tiles:     %.1f cycles/TDP\n", cyc([&] { gemm_t<true>(M, 128, 128, P.data(), V.data(), O.data(), 128); }, 200) / tdp_pv);
  std::vector<float> S2(M * 64);
  std::printf("scores, contiguous, C 64 wide (N=64 per call x4): %.1f cycles/TDP\n", cyc([&] { for (int p = 0; p < 4; ++p) gemm_t<false>(M, 64, 64, Q.data(), Kt.data() + p * 64 * 64, S2.data(), 64); }, 200) / tdp_scores);
  // Long K: C in tiles over K2 = 512 (no C traffic): rate with streaming A/B from L1/L2
  std::vector<uint32_t> A2(32 * 512), B2(512 * 32); fill(A2); fill(B2); std::vector<float> C2(32 * 32);
  std::printf("32x32 block, K2=512:  %.1f cycles/TDP\n", cyc([&] { gemm<false>(32, 32, 512, A2.data(), 512, B2.data(), 32, C2.data(), 32, false); }, 400) / 128);
  std::printf("32x32 interleaved:    %.1f cycles/TDP\n", cyc([&] { gemm<false, true>(32, 32, 512, A2.data(), 512, B2.data(), 32, C2.data(), 32, false); }, 400) / 128);
  // softmax-like traffic between products: S (96 KB) re-read by AVX-512 (evicts L1), then the product again
  std::printf("scores after touching 256 KB: %.1f cycles/TDP\n", cyc([&] { static std::vector<float> junk(64 * 1024); for (size_t i = 0; i < junk.size(); i += 16) junk[i] += 1.f; scores_lib(true); }, 100) / tdp_scores);
  unsigned long long t0 = __rdtsc(); usleep(100000); std::printf("rdtsc per 100 ms: %.3g\n", double(__rdtsc() - t0));
  _tile_release();
}
