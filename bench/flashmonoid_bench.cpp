// flashmonoid-bench: standard attention (S = QKᵀ materialised) against flash attention over a
// range of sequence lengths; checks that they agree and prints time, GFLOP/s, peak extra memory
// and the largest difference, then writes the rows as JSON (bench/results/ by default).
//
// Standard, on the CPU, is either the unfused baseline below (BLAS gemm S = scale·QKᵀ in fp32 for
// every head at once, softmax in place, BLAS gemm O = PV: what a framework's "math" attention
// does) or the library's float64 reference (--baseline reference). Flash is flashmonoid::forward.
// FLOPs, shared by every row: 4·b·h·s_q·s_k·d, halved when causal.
// Peak extra memory: a counting global operator new/delete in this binary; both the baseline's
// buffers and the library's CPU scratch are allocated through it. Inputs and outputs are
// allocated before the count starts and are not included.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <malloc.h>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/flash_tiles.hpp"
#include "cpu/numeric.hpp"
#include "cpu/profile.hpp"
#include "flashmonoid/flashmonoid.hpp"

#ifdef FLASHMONOID_HAVE_BLAS
#include <cblas.h>
#endif
#ifdef FLASHMONOID_BENCH_OPENBLAS
extern "C" void openblas_set_num_threads(int);
#endif
#ifdef FLASHMONOID_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "counting_allocator.hpp"

using counting::PeakScope;

namespace {

using flashmonoid::DType;
using flashmonoid::TensorView;
namespace fm = flashmonoid;

// ---- command line -------------------------------------------------------------------------------
struct Config {
  std::vector<int> seqlens{512, 1024, 2048, 4096};
  int hdim = 64, heads = 8, batch = 1, threads = 0, repeats = 3;
  DType dtype = DType::f32;
  bool causal = false;
  std::string baseline = "unfused";  // or "reference"
  std::string device = "auto";       // auto, cpu, cuda
  std::string out;
};

void usage() {
  std::fprintf(stderr,
               "usage: flashmonoid-bench [--seqlens 512,1024,...] [--hdim 64] [--heads 8] [--batch 1]\n"
               "                         [--threads N] [--dtype fp32|fp16|bf16] [--causal] [--repeats 3]\n"
               "                         [--baseline unfused|reference] [--device auto|cpu|cuda] [--out FILE]\n"
               "Times standard (materialised) and flash attention; median of --repeats runs after a warm-up.\n");
}

bool parse(int argc, char** argv, Config& c) {
  for (int a = 1; a < argc; ++a) {
    std::string f = argv[a];
    auto value = [&]() -> std::string {
      if (a + 1 >= argc) throw std::runtime_error(f + " needs a value");
      return argv[++a];
    };
    if (f == "--seqlens") {
      c.seqlens.clear();
      std::stringstream ss(value());
      for (std::string item; std::getline(ss, item, ',');) c.seqlens.push_back(std::stoi(item));
    } else if (f == "--hdim") {
      c.hdim = std::stoi(value());
    } else if (f == "--heads") {
      c.heads = std::stoi(value());
    } else if (f == "--batch") {
      c.batch = std::stoi(value());
    } else if (f == "--threads") {
      c.threads = std::stoi(value());
    } else if (f == "--repeats") {
      c.repeats = std::max(1, std::stoi(value()));
    } else if (f == "--dtype") {
      std::string t = value();
      if (t == "fp32") c.dtype = DType::f32;
      else if (t == "fp16") c.dtype = DType::f16;
      else if (t == "bf16") c.dtype = DType::bf16;
      else throw std::runtime_error("--dtype must be fp32, fp16 or bf16");
    } else if (f == "--causal") {
      c.causal = true;
    } else if (f == "--baseline") {
      c.baseline = value();
      if (c.baseline != "unfused" && c.baseline != "reference") throw std::runtime_error("--baseline must be unfused or reference");
    } else if (f == "--device") {
      c.device = value();
    } else if (f == "--out") {
      c.out = value();
    } else if (f == "-h" || f == "--help") {
      usage();
      std::exit(0);
    } else {
      throw std::runtime_error("unknown flag " + f);
    }
  }
  if (c.threads <= 0) c.threads = omp_get_max_threads();
  return true;
}

// ---- data ---------------------------------------------------------------------------------------
struct Host {
  std::vector<std::uint8_t> buf;
  TensorView view;
  Host(DType t, std::initializer_list<std::int64_t> dims) {
    std::int64_t n = 1;
    for (auto d : dims) n *= d;
    buf.resize(static_cast<std::size_t>(n) * fm::dtype_size(t));
    view = TensorView(buf.data(), t, fm::Device::cpu(), dims);
  }
  std::int64_t numel() const { return view.numel(); }
  float get(std::int64_t i) const { return fm::cpu::load(view.data, view.dtype, i); }
};

void fill_random(Host& t, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::int64_t i = 0; i < t.numel(); ++i) fm::cpu::store(t.view.data, t.view.dtype, i, nd(rng));
}

// Inputs as fp32 copies (the baseline computes in fp32 whatever the storage dtype).
std::vector<float> to_f32(const Host& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = t.get(i);
  return v;
}

// C (M×N, ldc) = alpha · A (M×K, lda) · op(B) + 0, op(B) = B (K×N, ldb) or Bᵀ with B (N×K, ldb).
void sgemm(bool b_transposed, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
           float* C, int ldc) {
#ifdef FLASHMONOID_HAVE_BLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, b_transposed ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb,
              0.0f, C, ldc);
#else
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) acc += A[i * lda + k] * (b_transposed ? B[j * ldb + k] : B[k * ldb + j]);
      C[static_cast<std::int64_t>(i) * ldc + j] = alpha * acc;
    }
#endif
}

// x[0, n) <- softmax of x[0, visible), zeros after. exp is the flash path's (tiles::exp8).
void softmax_row(float* x, int n, int visible) {
  float mx = -INFINITY;
  for (int j = 0; j < visible; ++j) mx = std::max(mx, x[j]);
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vs = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= visible; j += 8) {
    __m256 e = fm::cpu::tiles::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
    _mm256_storeu_ps(x + j, e);
    vs = _mm256_add_ps(vs, e);
  }
  float sum = fm::cpu::tiles::hsum(vs);
  for (; j < visible; ++j) sum += (x[j] = std::exp(x[j] - mx));
  const float inv = 1.0f / sum;
  for (j = 0; j < visible; ++j) x[j] *= inv;
  for (; j < n; ++j) x[j] = 0.0f;
}

// The unfused baseline on (b, s, h, d) tensors: S for all b·h heads, then softmax, then PV.
void unfused_forward(const Config& c, int s, const Host& q, const Host& k, const Host& v, Host& out) {
  const int b = c.batch, h = c.heads, d = c.hdim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> qf, kf, vf;
  const float *qp, *kp, *vp;
  if (c.dtype == DType::f32) {
    qp = static_cast<const float*>(q.view.data);
    kp = static_cast<const float*>(k.view.data);
    vp = static_cast<const float*>(v.view.data);
  } else {
    qf = to_f32(q), kf = to_f32(k), vf = to_f32(v);
    qp = qf.data(), kp = kf.data(), vp = vf.data();
  }
  const std::int64_t ss = static_cast<std::int64_t>(s) * s;
  std::vector<float> scores(static_cast<std::size_t>(b) * h * ss);  // (b, h, s, s)
  std::vector<float> of(c.dtype == DType::f32 ? 0 : static_cast<std::size_t>(out.numel()));
  float* op = c.dtype == DType::f32 ? static_cast<float*>(out.view.data) : of.data();
  const std::int64_t row = static_cast<std::int64_t>(h) * d, batch = row * s;
  // Threads over heads, each running single-threaded BLAS: one thread pool. With OpenBLAS's own
  // threads for the gemms and OpenMP's for the softmax, the two pools' spinning workers fought
  // over the 2 cores and the baseline ran at 13 GFLOP/s instead of 80 at s = 4096.
#pragma omp parallel for num_threads(c.threads) schedule(dynamic, 1)
  for (int bh = 0; bh < b * h; ++bh) {
    const int bi = bh / h, hi = bh % h;
    float* sc = scores.data() + static_cast<std::int64_t>(bh) * ss;  // (s, s) of this head
    sgemm(true, s, s, d, scale, qp + bi * batch + hi * d, static_cast<int>(row), kp + bi * batch + hi * d,
          static_cast<int>(row), sc, s);
    for (int i = 0; i < s; ++i) softmax_row(sc + static_cast<std::int64_t>(i) * s, s, c.causal ? i + 1 : s);
    sgemm(false, s, d, s, 1.0f, sc, s, vp + bi * batch + hi * d, static_cast<int>(row), op + bi * batch + hi * d,
          static_cast<int>(row));
  }
  if (c.dtype != DType::f32)
    for (std::int64_t i = 0; i < out.numel(); ++i) fm::cpu::store(out.view.data, out.view.dtype, i, of[i]);
}

// ---- timing -------------------------------------------------------------------------------------
struct Measure {
  double ms = 0.0;  // median
  std::int64_t peak_extra = 0;
  bool ok = true;
  std::string note;
};

double time_ms(const std::function<void()>& run) {
  auto t0 = std::chrono::steady_clock::now();
  run();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// A warm-up run of each (the one whose peak memory is reported), then `repeats` timed runs that
// alternate between the two, so that load from other processes on a shared machine falls on both
// alike; the median of each is reported. `second` may be empty.
void measure(int repeats, const std::function<void()>& first, Measure& m1, const std::function<void()>& second,
             Measure& m2) {
  const std::function<void()>* runs[2] = {&first, &second};
  Measure* out[2] = {&m1, &m2};
  std::vector<double> t[2];
  for (int w = 0; w < 2; ++w) {
    if (!*runs[w]) continue;
    PeakScope scope;
    (*runs[w])();
    out[w]->peak_extra = scope.extra();
  }
  for (int r = 0; r < repeats; ++r)
    for (int w = 0; w < 2; ++w)
      if (*runs[w]) t[w].push_back(time_ms(*runs[w]));
  for (int w = 0; w < 2; ++w)
    if (*runs[w]) out[w]->ms = median(t[w]);
}

std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

std::string human_bytes(std::int64_t b) {
  char buf[32];
  if (b >= (1LL << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", b / 1073741824.0);
  else if (b >= (1LL << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", b / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  return buf;
}

struct Row {
  int seqlen;
  Measure standard, flash;
  double gflop;
  double max_abs_err = 0.0, max_rel_err = 0.0;
  bool agree = true;
};

// Agreement bound on max|flash − standard| / max|standard|: both compute in fp32 (the float64
// reference is exact), so differences are rounding; the output's storage dtype bounds them.
double tolerance(DType t) { return t == DType::f32 ? 1e-4 : t == DType::f16 ? 4e-3 : 3e-2; }

#ifdef FLASHMONOID_WITH_CUDA
// The GPU path, kept minimal: flash only (the baseline stays on the CPU), checked against the CPU
// flash output of the same inputs. Returns false (with the reason printed) when the CUDA backend
// cannot run this configuration.
bool run_cuda(const Config& c, std::vector<Row>& rows, std::string& device_name) {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  device_name = prop.name;
  std::mt19937_64 rng(20261121);
  for (std::size_t n = 0; n < c.seqlens.size(); ++n) {
    const int s = c.seqlens[n];
    std::fprintf(stderr, "\r[%zu/%zu] s=%d cuda flash      ", n + 1, c.seqlens.size(), s);
    Host q(c.dtype, {c.batch, s, c.heads, c.hdim}), k(q.view.dtype, {c.batch, s, c.heads, c.hdim}),
        v(c.dtype, {c.batch, s, c.heads, c.hdim}), o(c.dtype, {c.batch, s, c.heads, c.hdim}),
        o_gpu(c.dtype, {c.batch, s, c.heads, c.hdim}), lse(DType::f32, {c.batch, c.heads, s});
    fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
    std::size_t bytes = q.buf.size(), lse_bytes = lse.buf.size();
    void *dq, *dk, *dv, *dout, *dlse;
    cudaMalloc(&dq, bytes), cudaMalloc(&dk, bytes), cudaMalloc(&dv, bytes), cudaMalloc(&dout, bytes),
        cudaMalloc(&dlse, lse_bytes);
    cudaMemcpy(dq, q.buf.data(), bytes, cudaMemcpyHostToDevice);
    cudaMemcpy(dk, k.buf.data(), bytes, cudaMemcpyHostToDevice);
    cudaMemcpy(dv, v.buf.data(), bytes, cudaMemcpyHostToDevice);
    auto dev = [&](void* p, const TensorView& like) {
      TensorView t = like;
      t.data = p;
      t.device = fm::Device::cuda(0);
      return t;
    };
    fm::Options opt;
    opt.causal = c.causal;
    Row row{s, {}, {}, 4.0 * c.batch * c.heads * double(s) * s * c.hdim * (c.causal ? 0.5 : 1.0) / 1e9};
    bool ok = true;
    try {
      measure(
          c.repeats,
          [&] {
            fm::forward(dev(dq, q.view), dev(dk, k.view), dev(dv, v.view), dev(dout, o.view), dev(dlse, lse.view), opt);
            cudaDeviceSynchronize();
          },
          row.flash, {}, row.standard);
    } catch (const fm::NotSupported& e) {
      std::fprintf(stderr, "\ncuda: %s\n", e.what());
      ok = false;
    }
    if (ok) {
      cudaMemcpy(o_gpu.buf.data(), dout, bytes, cudaMemcpyDeviceToHost);
      fm::Context ctx;
      ctx.num_threads = c.threads;
      fm::forward(q.view, k.view, v.view, o.view, lse.view, opt, ctx);
      double mx = 0.0;
      for (std::int64_t i = 0; i < o.numel(); ++i) {
        row.max_abs_err = std::max(row.max_abs_err, double(std::abs(o_gpu.get(i) - o.get(i))));
        mx = std::max(mx, double(std::abs(o.get(i))));
      }
      row.max_rel_err = row.max_abs_err / std::max(mx, 1e-30);
      row.agree = row.max_rel_err <= tolerance(c.dtype);
      row.standard.ok = false;
      row.standard.note = "cpu flash is the check";
      rows.push_back(row);
    }
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dout), cudaFree(dlse);
    if (!ok) return false;
  }
  std::fprintf(stderr, "\r%60s\r", "");
  return true;
}
#endif

void run_cpu(const Config& c, std::vector<Row>& rows) {
#ifdef FLASHMONOID_BENCH_OPENBLAS
  openblas_set_num_threads(1);  // the baseline threads over heads itself
#endif
  std::mt19937_64 rng(20261121);
  const std::size_t total = c.seqlens.size();
  for (std::size_t n = 0; n < total; ++n) {
    const int s = c.seqlens[n];
    // Fresh random inputs per length; outputs poisoned with NaN so that an unwritten element shows.
    Host q(c.dtype, {c.batch, s, c.heads, c.hdim}), k(c.dtype, {c.batch, s, c.heads, c.hdim}),
        v(c.dtype, {c.batch, s, c.heads, c.hdim}), o_std(c.dtype, {c.batch, s, c.heads, c.hdim}),
        o_flash(c.dtype, {c.batch, s, c.heads, c.hdim}), lse(DType::f32, {c.batch, c.heads, s});
    fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
    for (Host* t : {&o_std, &o_flash})
      for (std::int64_t i = 0; i < t->numel(); ++i) fm::cpu::store(t->view.data, t->view.dtype, i, NAN);
    fm::Options opt;
    opt.causal = c.causal;
    fm::Context flash_ctx, ref_ctx;
    flash_ctx.num_threads = ref_ctx.num_threads = c.threads;
    ref_ctx.cpu_algorithm = fm::CpuAlgorithm::reference;

    Row row{s, {}, {}, 4.0 * c.batch * c.heads * double(s) * s * c.hdim * (c.causal ? 0.5 : 1.0) / 1e9};
    std::fprintf(stderr, "\r[%zu/%zu] s=%d: standard (%s) and flash ...", n + 1, total, s, c.baseline.c_str());
    std::function<void()> standard = [&] { unfused_forward(c, s, q, k, v, o_std); };
    if (c.baseline == "reference")
      standard = [&] { fm::forward(q.view, k.view, v.view, o_std.view, lse.view, opt, ref_ctx); };
    measure(c.repeats, standard, row.standard,
            [&] { fm::forward(q.view, k.view, v.view, o_flash.view, lse.view, opt, flash_ctx); }, row.flash);
    fm::cpu::profile::print(stderr);  // a -DFLASHMONOID_CPU_PROFILE=ON build's phases of these runs

    double mx = 0.0;
    for (std::int64_t i = 0; i < o_std.numel(); ++i) {
      const double a = o_flash.get(i), b = o_std.get(i);
      row.max_abs_err = std::max(row.max_abs_err, std::isnan(a) || std::isnan(b) ? INFINITY : std::abs(a - b));
      mx = std::max(mx, std::abs(b));
    }
    row.max_rel_err = row.max_abs_err / std::max(mx, 1e-30);
    row.agree = row.max_rel_err <= tolerance(c.dtype);
    rows.push_back(row);
  }
  std::fprintf(stderr, "\r%60s\r", "");
}

void print_table(const Config& c, const std::string& device, const std::vector<Row>& rows) {
  std::printf("flashmonoid-bench on %s, %d thread%s: b=%d h=%d d=%d %s%s, standard = %s\n", device.c_str(), c.threads,
              c.threads == 1 ? "" : "s", c.batch, c.heads, c.hdim, fm::to_string(c.dtype).c_str(),
              c.causal ? " causal" : "", c.baseline.c_str());
  std::printf("%7s | %10s %9s %11s | %10s %9s %11s | %7s | %9s %s\n", "seqlen", "std ms", "GFLOP/s", "std mem",
              "flash ms", "GFLOP/s", "flash mem", "speedup", "max err", "");
  for (const Row& r : rows) {
    char std_ms[16] = "-", std_gf[16] = "-", speed[16] = "-";
    std::string std_mem = "-";
    if (r.standard.ok) {
      std::snprintf(std_ms, sizeof std_ms, "%.2f", r.standard.ms);
      std::snprintf(std_gf, sizeof std_gf, "%.1f", r.gflop / (r.standard.ms * 1e-3));
      std::snprintf(speed, sizeof speed, "%.2fx", r.standard.ms / r.flash.ms);
      std_mem = human_bytes(r.standard.peak_extra);
    }
    std::printf("%7d | %10s %9s %11s | %10.2f %9.1f %11s | %7s | %9.2e %s\n", r.seqlen, std_ms, std_gf, std_mem.c_str(),
                r.flash.ms, r.gflop / (r.flash.ms * 1e-3), human_bytes(r.flash.peak_extra).c_str(), speed,
                r.max_rel_err, r.agree ? "ok" : "MISMATCH");
  }
  std::printf("max err = max|flash - standard| / max|standard| (agree when <= %.0e)\n", tolerance(c.dtype));
}

std::string json(const Config& c, const std::string& device, const std::vector<Row>& rows) {
  std::ostringstream j;
  j << "{\n  \"device\": \"" << device << "\",\n  \"threads\": " << c.threads << ",\n  \"batch\": " << c.batch
    << ",\n  \"heads\": " << c.heads << ",\n  \"hdim\": " << c.hdim << ",\n  \"dtype\": \"" << fm::to_string(c.dtype)
    << "\",\n  \"causal\": " << (c.causal ? "true" : "false") << ",\n  \"baseline\": \"" << c.baseline
    << "\",\n  \"repeats\": " << c.repeats << ",\n  \"flops\": \"4*b*h*s*s*d, halved when causal\",\n  \"rows\": [";
  for (std::size_t n = 0; n < rows.size(); ++n) {
    const Row& r = rows[n];
    auto side = [&](const Measure& m) {
      std::ostringstream s;
      if (!m.ok) return std::string("null");
      s << "{\"ms\": " << m.ms << ", \"gflops\": " << r.gflop / (m.ms * 1e-3) << ", \"peak_extra_bytes\": " << m.peak_extra << "}";
      return s.str();
    };
    j << (n ? "," : "") << "\n    {\"seqlen\": " << r.seqlen << ", \"standard\": " << side(r.standard)
      << ", \"flash\": " << side(r.flash) << ", \"max_abs_err\": " << r.max_abs_err << ", \"max_rel_err\": " << r.max_rel_err
      << ", \"agree\": " << (r.agree ? "true" : "false") << "}";
  }
  j << "\n  ]\n}\n";
  return j.str();
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  try {
    parse(argc, argv, c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashmonoid-bench: %s\n", e.what());
    usage();
    return 2;
  }
  std::vector<Row> rows;
  std::string device = cpu_name() + " (" + std::to_string(omp_get_num_procs()) + " cores)";
  std::string kind = "cpu";
  try {
    bool want_cuda = c.device == "cuda" || (c.device == "auto" && fm::cuda_available());
#ifdef FLASHMONOID_WITH_CUDA
    if (want_cuda) {
      std::string gpu;
      if (run_cuda(c, rows, gpu)) {
        device = gpu;
        kind = "cuda";
      } else {
        rows.clear();
        std::fprintf(stderr, "falling back to the CPU\n");
      }
    }
#else
    if (want_cuda) std::fprintf(stderr, "this build has no CUDA backend; running on the CPU\n");
#endif
    if (kind == "cpu") run_cpu(c, rows);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nflashmonoid-bench: %s\n", e.what());
    return 1;
  }
  print_table(c, device, rows);
  std::string path = c.out.empty() ? std::string(FLASHMONOID_BENCH_RESULTS_DIR) + "/" + kind + ".json" : c.out;
  std::error_code ec;
  if (auto dir = std::filesystem::path(path).parent_path(); !dir.empty()) std::filesystem::create_directories(dir, ec);
  std::ofstream(path) << json(c, device, rows);
  std::printf("wrote %s\n", path.c_str());
  bool all_agree = std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.agree; });
  return all_agree ? 0 : 3;
}
