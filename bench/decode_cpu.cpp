// decode-cpu-bench: the CPU forward at decoding shapes (few query rows per KV head), the tiled
// mainloop (K/V packed first) against the decoding one (K/V read in place), alternated in one
// process so that a shared machine slows them alike. Per shape: the median time per call over the
// repeats and the minor page faults per call, of each path.
//
//   decode-cpu-bench [--threads 2] [--repeats 9] [--decode-only] [--head-major] [--pages P]
//                    [b,s_k,h,h_k,d,dtype,s_q ...]
//
// --head-major: K/V held head-major, (b, h_k, s_k, d) in memory (torch's SDPA layout, and HF
// transformers' caches), passed as strided (b, s_k, h_k, d) views, as the SDPA override passes them;
// without it, K/V are contiguous (b, s_k, h_k, d) tensors (flash_attn_with_kvcache's layout).
// --pages P: instead, forward_kvcache (public API, no new rows) over a contiguous cache against the
// same rows in pages of P rows behind a shuffled block table, alternated.
// Default shapes: those of CPU_DECODE_NOTES.md. A shape's K/V (b, s_k, h_k, d) is filled with
// fresh random values; q (b, s_q, h, d); not causal (as torch's SDPA at these shapes).
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "flashmonoid/kvcache.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/numeric.hpp"

namespace {

using flashmonoid::DType;
using flashmonoid::TensorView;
namespace cpu = flashmonoid::cpu;

struct Case {
  int b, s_k, h, h_k, d;
  DType dtype;
  int s_q;
};

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Two calls (call(0), call(1)) timed alternately, which runs first swapping each repeat, enough calls
// per timing for ~2e8 bytes of K/V (`work` per call) so that tiny shapes are not timer noise: per
// call, each one's median us over the repeats and its mean minor faults. With second_only, call(1)
// alone (the other's results 0).
struct Alternated {
  double us[2] = {0, 0}, faults[2] = {0, 0};
};
template <class Call>
Alternated alternate(double work, int repeats, bool second_only, Call call) {
  const int calls = std::clamp(static_cast<int>(2e8 / std::max(work, 1.0)), 1, 2000);
  std::vector<double> us[2];
  Alternated a;
  for (int i = second_only ? 1 : 0; i < 2; ++i) call(i);  // warm-up
  for (int r = 0; r < repeats; ++r)
    for (int i = second_only ? 1 : 0; i < 2; ++i) {
      const int which = second_only ? 1 : (r + i) % 2;
      const long f0 = minor_faults();
      const auto t0 = std::chrono::steady_clock::now();
      for (int n = 0; n < calls; ++n) call(which);
      const auto t1 = std::chrono::steady_clock::now();
      a.faults[which] += static_cast<double>(minor_faults() - f0) / calls / repeats;
      us[which].push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
    }
  for (int i = 0; i < 2; ++i)
    if (!us[i].empty()) a.us[i] = median(us[i]);
  return a;
}

// Fresh N(0, 1) values, blocks of 64k elements from generators seeded off rng (in parallel: a
// 134 MB cache took longer to fill than to time).
void fill(std::vector<std::uint8_t>& buf, DType t, std::mt19937& rng) {
  constexpr std::int64_t kBlock = 1 << 16;
  const auto count = static_cast<std::int64_t>(buf.size() / flashmonoid::dtype_size(t));
  const std::uint32_t seed = rng();
#pragma omp parallel for schedule(static)
  for (std::int64_t b0 = 0; b0 < count; b0 += kBlock) {
    std::mt19937 r(seed + static_cast<std::uint32_t>(b0 / kBlock));
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (std::int64_t i = b0; i < std::min(count, b0 + kBlock); ++i) cpu::store(buf.data(), t, i, n(r));
  }
}

void run(const Case& c, int threads, int repeats, bool decode_only, bool head_major, std::mt19937& rng) {
  const std::size_t es = flashmonoid::dtype_size(c.dtype);
  std::vector<std::uint8_t> q(static_cast<std::size_t>(c.b) * c.s_q * c.h * c.d * es),
      k(static_cast<std::size_t>(c.b) * c.s_k * c.h_k * c.d * es), v(k.size()), o(q.size());
  std::vector<float> lse(static_cast<std::size_t>(c.b) * c.h * c.s_q);
  fill(q, c.dtype, rng);
  fill(k, c.dtype, rng);
  fill(v, c.dtype, rng);
  const flashmonoid::Device cpu_dev{};
  const std::int64_t kv_strides[2][4] = {{std::int64_t{c.s_k} * c.h_k * c.d, std::int64_t{c.h_k} * c.d, c.d, 1},
                                         {std::int64_t{c.h_k} * c.s_k * c.d, c.d, std::int64_t{c.s_k} * c.d, 1}};
  const std::int64_t* st = kv_strides[head_major ? 1 : 0];
  const TensorView qv(q.data(), c.dtype, cpu_dev, {c.b, c.s_q, c.h, c.d}),
      kv(k.data(), c.dtype, cpu_dev, {c.b, c.s_k, c.h_k, c.d}, {st[0], st[1], st[2], st[3]}),
      vv(v.data(), c.dtype, cpu_dev, {c.b, c.s_k, c.h_k, c.d}, {st[0], st[1], st[2], st[3]}),
      ov(o.data(), c.dtype, cpu_dev, {c.b, c.s_q, c.h, c.d}), lv(lse.data(), DType::f32, cpu_dev, {c.b, c.h, c.s_q});
  const auto p = flashmonoid::detail::make_fwd_params(qv, kv, vv, ov, lv, flashmonoid::Options{}, nullptr);
  const cpu::Kernels& kn = cpu::kernels_for(cpu::default_isa());
  using Fn = void (*)(const flashmonoid::detail::FwdParams&, int, const cpu::Kernels&);
  const Fn paths[2] = {cpu::flash_forward_tiled, cpu::flash_forward_decode};
  const Alternated a = alternate(static_cast<double>(c.b) * c.s_k * c.h_k * c.d * es * 2, repeats, decode_only,
                                 [&](int which) { paths[which](p, threads, kn); });
  std::printf("b=%d s_k=%d h=%d h_k=%d d=%d %s s_q=%d%s | tiled %.1f us (%.0f faults) | decode %.1f us (%.1f faults) | x%.2f\n",
              c.b, c.s_k, c.h, c.h_k, c.d, flashmonoid::to_string(c.dtype).c_str(), c.s_q, head_major ? " head-major" : "",
              a.us[0], a.faults[0], a.us[1],
              a.faults[1], a.us[0] / a.us[1]);
  std::fflush(stdout);
}

// forward_kvcache over a contiguous cache (b, s_k, h_k, d) against pages of `page` rows.
void run_pages(const Case& c, int page, int threads, int repeats, std::mt19937& rng) {
  const std::size_t es = flashmonoid::dtype_size(c.dtype);
  const int pages_per_seq = (c.s_k + page - 1) / page, num_pages = c.b * pages_per_seq;
  const std::size_t row = static_cast<std::size_t>(c.h_k) * c.d * es;
  std::vector<std::uint8_t> q(static_cast<std::size_t>(c.b) * c.s_q * c.h * c.d * es), o(q.size()),
      k(static_cast<std::size_t>(c.b) * c.s_k * row), v(k.size()),
      kp(static_cast<std::size_t>(num_pages) * page * row), vp(kp.size());
  std::vector<float> lse(static_cast<std::size_t>(c.b) * c.h * c.s_q);
  fill(q, c.dtype, rng);
  fill(k, c.dtype, rng);
  fill(v, c.dtype, rng);
  std::vector<int> table(num_pages);
  for (int i = 0; i < num_pages; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), rng);
  for (int b = 0; b < c.b; ++b)
    for (int r = 0; r < c.s_k; ++r) {
      const std::size_t from = (static_cast<std::size_t>(b) * c.s_k + r) * row;
      const std::size_t to = (static_cast<std::size_t>(table[b * pages_per_seq + r / page]) * page + r % page) * row;
      std::copy_n(k.data() + from, row, kp.data() + to);
      std::copy_n(v.data() + from, row, vp.data() + to);
    }
  const flashmonoid::Device dev{};
  const TensorView qv(q.data(), c.dtype, dev, {c.b, c.s_q, c.h, c.d}), ov(o.data(), c.dtype, dev, {c.b, c.s_q, c.h, c.d}),
      lv(lse.data(), DType::f32, dev, {c.b, c.h, c.s_q});
  flashmonoid::KVCache contiguous, paged;
  contiguous.k = TensorView(k.data(), c.dtype, dev, {c.b, c.s_k, c.h_k, c.d});
  contiguous.v = TensorView(v.data(), c.dtype, dev, {c.b, c.s_k, c.h_k, c.d});
  contiguous.seqlen = c.s_k;
  paged.k = TensorView(kp.data(), c.dtype, dev, {num_pages, page, c.h_k, c.d});
  paged.v = TensorView(vp.data(), c.dtype, dev, {num_pages, page, c.h_k, c.d});
  paged.block_table = TensorView(table.data(), DType::i32, dev, {c.b, pages_per_seq});
  paged.seqlen = c.s_k;
  flashmonoid::Context ctx;
  ctx.num_threads = threads;
  const flashmonoid::KVCache* caches[2] = {&contiguous, &paged};
  const Alternated a = alternate(static_cast<double>(c.b) * c.s_k * row * 2, repeats, false, [&](int which) {
    flashmonoid::forward_kvcache(qv, *caches[which], {}, {}, {}, ov, lv, {}, ctx);
  });
  std::printf("kvcache b=%d s_k=%d h=%d h_k=%d d=%d %s s_q=%d | contiguous %.1f us (%.1f faults) | pages of %d %.1f us (%.1f faults)\n",
              c.b, c.s_k, c.h, c.h_k, c.d, flashmonoid::to_string(c.dtype).c_str(), c.s_q, a.us[0], a.faults[0], page,
              a.us[1], a.faults[1]);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, repeats = 9;
  bool decode_only = false, head_major = false;
  int pages = 0;
  std::vector<Case> cases;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--pages" && i + 1 < argc) {
      pages = std::atoi(argv[++i]);
    } else if (a == "--head-major") {
      head_major = true;
    } else if (a == "--decode-only") {
      decode_only = true;
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else {
      Case c{};
      char t[8] = {};
      if (std::sscanf(a.c_str(), "%d,%d,%d,%d,%d,%7[a-z0-9],%d", &c.b, &c.s_k, &c.h, &c.h_k, &c.d, t, &c.s_q) != 7) {
        std::fprintf(stderr, "bad shape '%s' (b,s_k,h,h_k,d,dtype,s_q)\n", a.c_str());
        return 1;
      }
      c.dtype = std::string(t) == "bf16" ? DType::bf16 : std::string(t) == "fp16" ? DType::f16 : DType::f32;
      cases.push_back(c);
    }
  }
  const bool defaults = cases.empty();
  if (defaults) {
    for (DType t : {DType::f32, DType::bf16})
      for (int s_q : {1, 4}) {
        for (auto [b, s_k] : {std::pair{1, 512}, {1, 4096}, {1, 32768}, {8, 4096}}) cases.push_back({b, s_k, 32, 8, 128, t, s_q});
        cases.push_back({1, 4096, 32, 32, 128, t, s_q});
        cases.push_back({1, 4096, 32, 8, 64, t, s_q});
      }
    cases.push_back({1, 5, 4, 1, 64, DType::f32, 1});  // the tiny call
  }
  std::printf("threads %d, repeats %d, isa %s\n", threads, repeats, cpu::to_string(cpu::default_isa()));
  std::mt19937 rng(1234);
  for (const Case& c : cases) {
    if (pages > 0)
      run_pages(c, pages, threads, repeats, rng);
    else
      run(c, threads, repeats, decode_only, head_major, rng);
  }
}
