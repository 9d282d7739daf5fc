// Causal attention on the CPU through the installed library; checks one row by hand.
#include <flashmonoid/flashmonoid.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  namespace fm = flashmonoid;
  const int b = 1, s = 64, h = 4, d = 32;
  std::mt19937 rng(1);
  std::normal_distribution<float> n;
  std::vector<float> q(b * s * h * d), k(q.size()), v(q.size()), out(q.size()), lse(b * h * s);
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = n(rng);
  const auto cpu = fm::Device::cpu();
  fm::Options opt;
  opt.causal = true;
  fm::forward(fm::TensorView(q.data(), fm::DType::f32, cpu, {b, s, h, d}),
              fm::TensorView(k.data(), fm::DType::f32, cpu, {b, s, h, d}),
              fm::TensorView(v.data(), fm::DType::f32, cpu, {b, s, h, d}),
              fm::TensorView(out.data(), fm::DType::f32, cpu, {b, s, h, d}),
              fm::TensorView(lse.data(), fm::DType::f32, cpu, {b, h, s}), opt);
  // Row 0 of a causal square problem sees only key 0: its output is v[0].
  for (int c = 0; c < d; ++c)
    if (std::abs(out[c] - v[c]) > 1e-6f) {
      std::printf("consumer: mismatch at %d\n", c);
      return 1;
    }
  try {
    fm::forward(fm::TensorView(q.data(), fm::DType::f32, cpu, {b, s, h, d}),
                fm::TensorView(k.data(), fm::DType::f16, cpu, {b, s, h, d}),
                fm::TensorView(v.data(), fm::DType::f32, cpu, {b, s, h, d}),
                fm::TensorView(out.data(), fm::DType::f32, cpu, {b, s, h, d}),
                fm::TensorView(lse.data(), fm::DType::f32, cpu, {b, h, s}));
    return 1;
  } catch (const fm::Error& e) {
    std::printf("consumer: ok (bad input reported: %s)\n", e.what());
  }
  return 0;
}
