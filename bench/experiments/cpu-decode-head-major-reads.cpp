// Read patterns of CPU decoding, MHA fp32 (h_k = 32, d = 128, 4k keys), (b, s, h_k, d) against head-major
// memory: GB/s of K+V bytes summed in registers. bench/NOTES.md (session of 2026-11-28 from 20:50 UTC).
// g++ -O2 -march=native -fopenmp cpu-decode-head-major-reads.cpp
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
constexpr int HK = 32, D = 128, S = 4096, SPLITS = 16, CHUNK = 64;
// layout 0: (s, h, d); 1: (h, s, d)
static inline const float* row(const float* base, int layout, int key, int h) {
  return layout == 0 ? base + ((size_t)key * HK + h) * D : base + ((size_t)h * S + key) * D;
}
static inline __m256 add_row(__m256 acc, const float* r) {
  for (int i = 0; i < D; i += 16) acc = _mm256_add_ps(acc, _mm256_add_ps(_mm256_loadu_ps(r + i), _mm256_loadu_ps(r + i + 8)));
  return acc;
}
// group: heads per task; order 0 keys outer (4 keys) heads inner; 1 head by head; 2 head by head, 4 keys from 4 quarters of the chunk
double run(const float* K, const float* V, int layout, int group, int order, int threads, float* sink) {
  const int groups = HK / group, tasks = groups * SPLITS;
  double t0 = omp_get_wtime();
  float tot = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tot)
  {
    __m256 acc = _mm256_setzero_ps();
#pragma omp for schedule(dynamic, 1) nowait
    for (int t = 0; t < tasks; ++t) {
      const int g = t % groups, c = t / groups, h0 = g * group;
      const int lo = S * c / SPLITS, hi = S * (c + 1) / SPLITS;
      for (int j0 = lo; j0 < hi; j0 += CHUNK) {
        for (int pass = 0; pass < 2; ++pass) {
          const float* B = pass == 0 ? K : V;
          if (order == 3) {  // like pv_block_at: 8 rows, 32 B of each in turn
            for (int j = 0; j < CHUNK; j += 8)
              for (int h = h0; h < h0 + group; ++h) {
                const float* r[8];
                for (int u = 0; u < 8; ++u) r[u] = row(B, layout, j0 + j + u, h);
                for (int x = 0; x < D; x += 8)
                  for (int u = 0; u < 8; ++u) acc = _mm256_add_ps(acc, _mm256_loadu_ps(r[u] + x));
              }
          } else if (order == 4) {  // the same rows, one after another
            for (int j = 0; j < CHUNK; j += 8)
              for (int h = h0; h < h0 + group; ++h)
                for (int u = 0; u < 8; ++u) acc = add_row(acc, row(B, layout, j0 + j + u, h));
          } else if (order == 0) {
            for (int j = 0; j < CHUNK; j += 4)
              for (int h = h0; h < h0 + group; ++h)
                for (int u = 0; u < 4; ++u) acc = add_row(acc, row(B, layout, j0 + j + u, h));
          } else if (order == 1) {
            for (int h = h0; h < h0 + group; ++h)
              for (int j = 0; j < CHUNK; ++j) acc = add_row(acc, row(B, layout, j0 + j, h));
          } else {
            for (int h = h0; h < h0 + group; ++h)
              for (int j = 0; j < CHUNK / 4; ++j)
                for (int u = 0; u < 4; ++u) acc = add_row(acc, row(B, layout, j0 + j + u * (CHUNK / 4), h));
          }
        }
      }
    }
    float a[8]; _mm256_storeu_ps(a, acc); tot += a[0] + a[7];
  }
  double dt = omp_get_wtime() - t0;
  *sink += tot;
  return 2.0 * S * HK * D * 4 / dt / 1e9;
}
double plain(const float* K, const float* V, int threads, float* sink) {
  const size_t n = (size_t)S * HK * D;
  double t0 = omp_get_wtime();
  float tot = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tot)
  {
    __m256 acc = _mm256_setzero_ps();
#pragma omp for schedule(static) nowait
    for (size_t i = 0; i < n; i += 16) {
      acc = _mm256_add_ps(acc, _mm256_add_ps(_mm256_loadu_ps(K + i), _mm256_loadu_ps(K + i + 8)));
      acc = _mm256_add_ps(acc, _mm256_add_ps(_mm256_loadu_ps(V + i), _mm256_loadu_ps(V + i + 8)));
    }
    float a[8]; _mm256_storeu_ps(a, acc); tot += a[0] + a[7];
  }
  *sink += tot;
  return 2.0 * n * 4 / (omp_get_wtime() - t0) / 1e9;
}
int main() {
  const size_t n = (size_t)S * HK * D;
  float* K = (float*)aligned_alloc(4096, n * 4);
  float* V = (float*)aligned_alloc(4096, n * 4);
#pragma omp parallel for
  for (size_t i = 0; i < n; ++i) { K[i] = (float)(i % 7) * 0.25f; V[i] = (float)(i % 5) * 0.5f; }
  float sink = 0;
  struct Cfg { const char* name; int layout, group, order; } cfgs[] = {
    {"bshd g8 keys-outer (library)", 0, 8, 0}, {"bshd g4 keys-outer", 0, 4, 0},
    {"hm g8 keys-outer", 1, 8, 0}, {"hm g4 keys-outer", 1, 4, 0}, {"hm g1 (one stream)", 1, 1, 1},
    {"hm g8 head by head", 1, 8, 1}, {"bshd g8 8 rows interleaved", 0, 8, 3}, {"bshd g8 8 rows in turn", 0, 8, 4},
    {"hm g8 8 rows interleaved", 1, 8, 3}, {"hm g8 8 rows in turn", 1, 8, 4}};
  for (int threads : {16, 2}) {
    std::vector<std::vector<double>> r(11);
    for (int rep = 0; rep < 7; ++rep) {
      for (int c = 0; c < 10; ++c) r[c].push_back(run(K, V, cfgs[c].layout, cfgs[c].group, cfgs[c].order, threads, &sink));
      r[10].push_back(plain(K, V, threads, &sink));
    }
    for (int c = 0; c < 11; ++c) {
      std::sort(r[c].begin(), r[c].end());
      std::printf("%2d threads %-32s %6.1f GB/s (min %.1f max %.1f)\n", threads, c < 10 ? cfgs[c].name : "plain read", r[c][3], r[c][0], r[c][6]);
    }
  }
  std::printf("sink %g\n", sink);
}
