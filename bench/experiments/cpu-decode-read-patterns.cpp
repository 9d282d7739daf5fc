// Stage-copy patterns of the CPU decoding path, MHA bf16 (h_k = 32, d = 128), GB/s of cache bytes.
// bench/NOTES.md (session of 2026-11-28 from 18:41 UTC): g++ -O2 -march=x86-64-v3 -fopenmp this.cpp
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
constexpr int HK = 32, D = 128;
static float g_sink;
static inline void cvt_row(const uint16_t* r, float* s) {
  for (int i = 0; i < D; i += 8)
    _mm256_store_ps(s + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(r + i))), 16)));
}
static inline float read_stage(const float* s, size_t n) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 32) {
    a = _mm256_add_ps(a, _mm256_load_ps(s + i)); b = _mm256_add_ps(b, _mm256_load_ps(s + i + 8));
    c = _mm256_add_ps(c, _mm256_load_ps(s + i + 16)); d = _mm256_add_ps(d, _mm256_load_ps(s + i + 24));
  }
  a = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
  float t[8]; _mm256_storeu_ps(t, a); return t[0] + t[7];
}
static inline void pf_row(const uint16_t* r) { for (int x = 0; x < D * 2; x += 64) _mm_prefetch((const char*)r + x, _MM_HINT_T0); }
// mode: 0 groups of 8 (64 keys), K/V alternated per head; 1 groups of 8, all K then all V;
// 2 all 32 heads (16 keys), K/V alternated; 3 = 0 + prefetch 2 keys ahead; 4 = 2 + prefetch 1 key ahead;
// 5 groups of 8, no stage (convert and add in registers); 6 all 32 heads, all K then all V
double run(const uint16_t* K, const uint16_t* V, int S, int mode, int threads) {
  const int heads = (mode == 2 || mode == 4 || mode == 6) ? 32 : 8, keys = heads == 32 ? 16 : 64;
  const int groups = HK / heads, splits = 16, tasks = groups * splits;
  float total = 0;
  double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    static thread_local std::vector<float, std::allocator<float>> kc, vc;
    float* ks = (float*)aligned_alloc(64, (size_t)keys * heads * D * 4);
    float* vs = (float*)aligned_alloc(64, (size_t)keys * heads * D * 4);
    memset(ks, 0, (size_t)keys * heads * D * 4); memset(vs, 0, (size_t)keys * heads * D * 4);
    __m256 acc = _mm256_setzero_ps();
#pragma omp for schedule(dynamic, 1) nowait
    for (int t = 0; t < tasks; ++t) {
      const int g = t % groups, c = t / groups, h0 = g * heads;
      const int k_lo = S * c / splits, k_hi = S * (c + 1) / splits;
      for (int j0 = k_lo; j0 < k_hi; j0 += keys) {
        const int n = std::min(keys, k_hi - j0);
        if (mode == 5) {
          for (int j = 0; j < n; ++j)
            for (int h = 0; h < heads; ++h) {
              const uint16_t* kr = K + ((size_t)(j0 + j) * HK + h0 + h) * D;
              const uint16_t* vr = V + ((size_t)(j0 + j) * HK + h0 + h) * D;
              for (int i = 0; i < D; i += 8) {
                acc = _mm256_add_ps(acc, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(kr + i))), 16)));
                acc = _mm256_add_ps(acc, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(vr + i))), 16)));
              }
            }
          continue;
        }
        if (mode == 1 || mode == 6) {
          for (int j = 0; j < n; ++j) for (int h = 0; h < heads; ++h) cvt_row(K + ((size_t)(j0 + j) * HK + h0 + h) * D, ks + ((size_t)h * keys + j) * D);
          for (int j = 0; j < n; ++j) for (int h = 0; h < heads; ++h) cvt_row(V + ((size_t)(j0 + j) * HK + h0 + h) * D, vs + ((size_t)h * keys + j) * D);
        } else {
          const int dist = mode == 3 ? 2 : mode == 4 ? 1 : 0;
          for (int j = 0; j < n; ++j)
            for (int h = 0; h < heads; ++h) {
              const size_t at = ((size_t)(j0 + j) * HK + h0 + h) * D;
              if (dist && j0 + j + dist < S) { pf_row(K + at + (size_t)dist * HK * D); pf_row(V + at + (size_t)dist * HK * D); }
              cvt_row(K + at, ks + ((size_t)h * keys + j) * D);
              cvt_row(V + at, vs + ((size_t)h * keys + j) * D);
            }
        }
        for (int h = 0; h < heads; ++h) total += read_stage(ks + (size_t)h * keys * D, (size_t)n * D) + read_stage(vs + (size_t)h * keys * D, (size_t)n * D);
      }
    }
    float tt[8]; _mm256_storeu_ps(tt, acc); total += tt[0];
    free(ks); free(vs);
  }
  double dt = omp_get_wtime() - t0;
  g_sink += total;
  return (double)S * HK * D * 2 * 2 / dt / 1e9;
}
double plain(const uint16_t* K, size_t bytes, int threads) {
  double t0 = omp_get_wtime(); float total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
  for (size_t blk = 0; blk < bytes / 65536; ++blk) total += read_stage((const float*)((const char*)K + blk * 65536), 16384);
  g_sink += total;
  return bytes / (omp_get_wtime() - t0) / 1e9;
}
int main() {
  const char* names[] = {"groups of 8, K/V per head", "groups of 8, K then V", "all 32 heads, K/V per head", "groups of 8 + prefetch 2 keys",
                         "all 32 + prefetch 1 key", "groups of 8, no stage", "all 32 heads, K then V"};
  for (int S : {4096, 32768}) {
    const size_t n = (size_t)S * HK * D;
    uint16_t* K = (uint16_t*)aligned_alloc(4096, n * 2); uint16_t* V = (uint16_t*)aligned_alloc(4096, n * 2);
    for (size_t i = 0; i < n; ++i) { K[i] = 0x3f80 + (i & 63); V[i] = 0x3f00 + (i & 31); }
    for (int threads : {1, 2, 16}) {
      printf("s_k %d (%.0f MB), %d threads: plain read %.1f GB/s\n", S, n * 4 / 1e6, threads, std::max(plain(K, n * 2, threads), plain(V, n * 2, threads)));
      for (int mode = 0; mode < 7; ++mode) {
        std::vector<double> r;
        for (int rep = 0; rep < 7; ++rep) r.push_back(run(K, V, S, mode, threads));
        std::sort(r.begin(), r.end());
        printf("  %-32s median %6.1f  max %6.1f GB/s\n", names[mode], r[3], r[6]);
      }
    }
    free(K); free(V);
  }
  printf("(%g)\n", g_sink);
}
