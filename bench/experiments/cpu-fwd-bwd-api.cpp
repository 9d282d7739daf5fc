// Times the CPU forward and backward through the public API, one shape per process: b = 1, h = h_k =
// 8, fresh normal inputs, one warm-up call, then the median of `reps` forward and backward calls.
// Used for the backward's A/Bs on the Xeon (bench/NOTES.md, 2026-11-29 from 07:08): build it against
// each tree's static library,
//   g++ -O2 -std=c++20 -I<tree>/include cpu-fwd-bwd-api.cpp <build>/libflashmonoid.a -fopenmp
// and run `a.out S D THREADS REPS fp32|bf16 causal|x`.
#include <flashmonoid/flashmonoid.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace flashmonoid;

namespace {

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int S = argc > 1 ? std::atoi(argv[1]) : 1024, D = argc > 2 ? std::atoi(argv[2]) : 128;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2, reps = argc > 4 ? std::atoi(argv[4]) : 7, H = 8;
  const bool f32 = argc > 5 && std::string(argv[5]) == "fp32";
  Options opt;
  opt.causal = argc > 6 && std::string(argv[6]) == "causal";

  const std::size_t n = std::size_t(S) * H * D, words = f32 ? 2 : 1;  // 16-bit words per element
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  auto random_tensor = [&] {
    std::vector<std::uint16_t> x(n * words);
    for (std::size_t i = 0; i < n; ++i) {
      const float f = normal(gen);
      if (f32) {
        std::memcpy(x.data() + 2 * i, &f, 4);
      } else {
        std::uint32_t u;
        std::memcpy(&u, &f, 4);
        x[i] = static_cast<std::uint16_t>(u >> 16);
      }
    }
    return x;
  };
  std::vector<std::uint16_t> q = random_tensor(), k = random_tensor(), v = random_tensor(), dout = random_tensor();
  std::vector<std::uint16_t> out(n * words), dq(n * words), dk(n * words), dv(n * words);
  std::vector<float> lse(std::size_t(H) * S);
  const Device cpu{};
  auto view = [&](std::vector<std::uint16_t>& x) { return TensorView(x.data(), f32 ? DType::f32 : DType::bf16, cpu, {1, S, H, D}); };
  const TensorView lse_view(lse.data(), DType::f32, cpu, {1, H, S});
  Context ctx;
  ctx.num_threads = threads;

  auto fwd = [&] { forward(view(q), view(k), view(v), view(out), lse_view, opt, ctx); };
  auto bwd = [&] { backward(view(dout), view(q), view(k), view(v), view(out), lse_view, view(dq), view(dk), view(dv), opt, ctx); };
  fwd();
  bwd();
  std::vector<double> tf, tb;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    fwd();
    const auto b = std::chrono::steady_clock::now();
    bwd();
    const auto c = std::chrono::steady_clock::now();
    tf.push_back(std::chrono::duration<double, std::milli>(b - a).count());
    tb.push_back(std::chrono::duration<double, std::milli>(c - b).count());
  }
  std::printf("%s%s s %d d %d T %d: fwd %.2f ms, bwd %.2f ms\n", f32 ? "fp32" : "bf16", opt.causal ? " causal" : "", S, D,
              threads, median(tf), median(tb));
}
