// The forward's bf16 packing of one K/V tile timed alone (K: pairs transposed into panels; V: pairs across
// rows, through a stage and to_panels, or with -DDIRECT straight into the panels), sources in cache.
// g++ -O2 -march=x86-64-v3 -std=c++20 -Isrc -Iinclude bench/experiments/cpu-pack-v-pairs-micro.cpp
#include "cpu/flash_tiles.hpp"
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstdint>
#include <random>
using namespace flashmonoid::cpu;
int main() {
  const int S = 1024, H = 8, D = 128, N = 256, panel = 32, d2 = D / 2, dp = D;
  std::vector<std::uint16_t> k(size_t(S) * H * D), v(k.size());
  std::mt19937 g(1); for (auto& x : k) x = g(); for (auto& x : v) x = g();
  std::vector<std::uint32_t> kt2(size_t(d2) * N), v2(size_t(N / 2) * dp), staging(size_t(std::max(d2, N / 2)) * std::max(N, dp));
  auto t0 = std::chrono::steady_clock::now();
  const int reps = 200;
  double tk = 0, tv = 0;
  for (int rep = 0; rep < reps; ++rep)
    for (int h = 0; h < H; ++h)
      for (int j0 = 0; j0 < S; j0 += N) {
        auto a = std::chrono::steady_clock::now();
        tiles::rows_transposed_panels([&](int r, std::uint32_t* out) { tiles::pairs_of_row(k.data() + (size_t(j0 + r) * H + h) * D, D, out); }, N, d2, N, panel, staging.data(), kt2.data());
        auto b = std::chrono::steady_clock::now();
#ifdef DIRECT
        for (int j = 0; j < N / 2; ++j) {
          const std::uint16_t* r0 = v.data() + (size_t(j0 + 2 * j) * H + h) * D;
          const std::uint16_t* r1 = v.data() + (size_t(j0 + 2 * j + 1) * H + h) * D;
          for (int c = 0; c < dp; c += panel)
            tiles::pairs_across_rows(r0 + c, r1 + c, std::clamp(D - c, 0, panel), panel, v2.data() + size_t(c) * (N / 2) + size_t(j) * panel);
        }
#else
        for (int j = 0; j < N / 2; ++j) {
          std::uint32_t* dst = staging.data() + size_t(j) * dp;
          tiles::pairs_across_rows(v.data() + (size_t(j0 + 2 * j) * H + h) * D, v.data() + (size_t(j0 + 2 * j + 1) * H + h) * D, D, dp, dst);
        }
        tiles::to_panels(staging.data(), N / 2, dp, dp, panel, v2.data());
#endif
        auto c = std::chrono::steady_clock::now();
        tk += std::chrono::duration<double>(b - a).count(); tv += std::chrono::duration<double>(c - b).count();
      }
  double elems = double(reps) * H * S * D;
  std::printf("K: %.3f ns/elem, V: %.3f ns/elem (%.1f us per tile K, %.1f V)\n", tk / elems * 1e9, tv / elems * 1e9, tk / (reps * H * 4) * 1e6, tv / (reps * H * 4) * 1e6);
  return kt2[5] + v2[7] == 42;
}
