// A/B timing harness (bench/experiments/cpu-ab): flashmonoid::forward on fixed random inputs (b = 1, h = 8),
// fp32, or bf16 with BF16 set, causal with CAUSAL set; SERVE: one call per stdin line (abi.py).
// usage: h d s calls [threads]  -> prints per-call ms (median of `calls`) and an output checksum.
#include <flashmonoid/flashmonoid.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <cstring>
#include <cstdint>
namespace fm = flashmonoid;
#ifdef PROF
namespace flashmonoid::cpu::profile { void print(std::FILE*); }
#endif
int main(int argc, char** argv) {
  int d = std::atoi(argv[1]), s = std::atoi(argv[2]), calls = std::atoi(argv[3]);
  int threads = argc > 4 ? std::atoi(argv[4]) : 2;
  const int h = 8;
  // Each tensor starts 64-byte aligned inside its vector (16 elements of slack, never read by the
  // library), as torch's CPU allocator aligns them; a plain vector's large buffers start 16 bytes
  // into a page.
  const size_t n = (size_t)s * h * d;
  std::vector<float> q(n + 16), k(q.size()), v(q.size()), o(q.size()), lse((size_t)h * s);
  std::mt19937 rng(s * 1000 + d);
  std::normal_distribution<float> nd;
  for (auto* t : {&q, &k, &v}) for (auto& x : *t) x = nd(rng);
  const bool bf16 = std::getenv("BF16") != nullptr;  // inputs and output as bf16 (the fp32 values truncated)
  std::vector<std::uint16_t> q16(n + 32), k16(q16.size()), v16(q16.size()), o16(q16.size());
  for (size_t i = 0; i < q.size(); ++i) {
    std::uint32_t u;
    std::memcpy(&u, &q[i], 4); q16[i] = u >> 16;
    std::memcpy(&u, &k[i], 4); k16[i] = u >> 16;
    std::memcpy(&u, &v[i], 4); v16[i] = u >> 16;
  }
  auto aligned = [](auto* p) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    return reinterpret_cast<decltype(p)>((a + 63) & ~std::uintptr_t{63});
  };
  auto view = [&](std::vector<float>& x) {
    if (bf16) {
      std::vector<std::uint16_t>& y = &x == &q ? q16 : &x == &k ? k16 : &x == &v ? v16 : o16;
      return fm::TensorView(aligned(y.data()), fm::DType::bf16, fm::Device::cpu(), {1, s, h, d});
    }
    return fm::TensorView(aligned(x.data()), fm::DType::f32, fm::Device::cpu(), {1, s, h, d});
  };
  fm::TensorView lv(lse.data(), fm::DType::f32, fm::Device::cpu(), {1, h, s});
  fm::Context ctx; ctx.num_threads = threads;
  fm::Options opt;
  opt.causal = std::getenv("CAUSAL") != nullptr;
  fm::forward(view(q), view(k), view(v), view(o), lv, opt, ctx);
  std::vector<double> ms;
  if (std::getenv("SERVE")) {  // one timed call per input line, printed in ms (the A/B driver's mode)
    char line[64];
    while (std::fgets(line, sizeof line, stdin)) {
      auto t0 = std::chrono::steady_clock::now();
      fm::forward(view(q), view(k), view(v), view(o), lv, opt, ctx);
      std::printf("%.4f\n", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      std::fflush(stdout);
    }
    return 0;
  }
  for (int i = 0; i < calls; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fm::forward(view(q), view(k), view(v), view(o), lv, opt, ctx);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
#ifdef PROF
  fm::cpu::profile::print(stdout);
#endif
  std::sort(ms.begin(), ms.end());
  double sum = 0; for (float x : o) sum += x;
  for (auto x : o16) sum += x;
  double fl = 4.0 * h * double(s) * s * d;
  std::printf("d=%d s=%d median %.3f ms (%.1f GFLOP/s) min %.3f checksum %.9g\n", d, s, ms[ms.size() / 2],
              fl / ms[ms.size() / 2] / 1e6, ms[0], sum);
}
