// flashmonoid forward/backward timings on the GPU, one JSON record per line-free list entry:
// {impl, pass, dtype, hdim, causal, batch, nheads, nheads_k, seqlen_q, seqlen_k, ms, tflops|tbps,
// device}. CUDA events around each call (training shapes: around a queue of calls, device_ms), warm-up
// first, median of the timed repetitions. Every
// training shape has batch·seqlen = 16k tokens and hidden 2048, so q, k and v are 64 MB each, above
// the 50 MB L2: repeated calls stream from HBM. Decoding shapes are 128 MB and more of K/V, but for
// b = 1 at 4k keys (17 MB; the probes' 1k, 4 MB): those stay in the L2 across a graph's calls, so
// they time short, latency-bound calls (comparable between builds and with the cuDNN peer, which
// runs them the same way), not HBM reads; the issue's bandwidth bars start at 64 MB.
// FLOPs: forward 4·b·h·s_q·s_k·d (halved when causal), backward 2.5x forward.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "api/pointer_source.hpp"  // the bindings' route, for --kvcache-host
#ifdef FLASHMONOID_TRACE
#include "cuda/common/trace.cuh"  // --kv-trace (a -DFLASHMONOID_TRACE=ON build)
namespace flashmonoid::cuda {
void set_trace_buffer(void* buffer);
}
#endif
#include "flashmonoid/flashmonoid.hpp"

namespace {

using flashmonoid::Device;
using flashmonoid::DType;
using flashmonoid::TensorView;

#define CHECK(call)                                                                             \
  do {                                                                                          \
    cudaError_t e_ = (call);                                                                    \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

constexpr int kWarmup = 3;
constexpr int kReps = 15;

// Fresh normal-ish bf16 data from a hash (no zeros: they run faster than real data).
__global__ void fill_random(__nv_bfloat16* x, std::int64_t n, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    const float u = (h >> 8) * (1.0f / 16777216.0f);
    x[i] = __float2bfloat16((u - 0.5f) * 3.4f);  // variance ~1
  }
}

struct Buf {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit Buf(std::size_t n, bool random = false) : bytes(n) {
    if (n) CHECK(cudaMalloc(&p, n));
    if (random) {
      static std::uint32_t seed = 12345;
      fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), static_cast<std::int64_t>(n / 2), seed++);
      CHECK(cudaGetLastError());
    }
  }
  ~Buf() { cudaFree(p); }
};

template <class V>
double median(V t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Median over kReps of f() timed with events on `stream` (no host synchronisation in the region),
// `before()` enqueued ahead of each first event (not timed).
template <class P, class F>
double event_ms(cudaStream_t stream, P&& before, F&& f) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < kReps; ++i) {
    before();
    CHECK(cudaEventRecord(a, stream));
    f();
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

template <class F>
double event_ms(cudaStream_t stream, F&& f) {
  return event_ms(stream, [] {}, f);
}

template <class F>
double median_ms(F&& f) {
  for (int i = 0; i < kWarmup; ++i) f();
  CHECK(cudaDeviceSynchronize());
  return event_ms(nullptr, f);
}

// Spins ~ns nanoseconds on one thread: queued ahead of a timed region, it lets the host enqueue the
// region's calls before its first event runs, so their host work is not timed.
__global__ void spin_kernel(long long ns) {
  const long long t0 = clock64();
  while (clock64() - t0 < ns * 2) {  // ~2 cycles per ns at the H100's 1.98 GHz
  }
}

// Device time per call of a training shape: kBatch calls back to back between two events, behind a
// 0.5 ms spin kernel, median of kReps such groups. A single call between events also timed the host
// work in front of its launch (the C++ forward's ~30 us of argument checks and tensor maps: 377
// against 459 TFLOP/s at hdim 128, 512 keys, H100), which a queue of calls hides.
constexpr int kBatch = 4;
template <class F>
double device_ms(F&& f) {
  for (int i = 0; i < kWarmup; ++i) f();
  CHECK(cudaDeviceSynchronize());
  return event_ms(nullptr, [&] {
           spin_kernel<<<1, 1>>>(500000);
           CHECK(cudaGetLastError());
         }, [&] {
           for (int i = 0; i < kBatch; ++i) f();
         }) / kBatch;
}

// Device time per call without the host's share: kGraphCalls calls captured into one CUDA graph on a
// side stream, replays timed with events (median), divided by the call count. A decoding call is
// ~50 us of GPU work, so per-call host work (argument checks, two launches) is a visible part of
// median_ms's number but is hidden in an engine that replays graphs; both are reported.
constexpr int kGraphCalls = 20;
template <class F>
double graph_ms(F&& f) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < kWarmup; ++i) f(s);
  CHECK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kGraphCalls; ++i) f(s);
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphLaunch(ge, s));
  CHECK(cudaStreamSynchronize(s));
  const double ms = event_ms(s, [&] { CHECK(cudaGraphLaunch(ge, s)); }) / kGraphCalls;
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  return ms;
}

// Host time of one call (argument checks, launches; no synchronisation), median over kReps.
template <class F>
double host_us(F&& f) {
  std::vector<double> t;
  for (int i = 0; i < kReps; ++i) {
    CHECK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  CHECK(cudaDeviceSynchronize());
  return median(t);
}

std::string device_name() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop.name;
}

std::vector<std::string> records;

void record(const char* pass, int d, bool causal, int b, int h, int hk, int sq, int sk, double ms, const char* metric,
            double value, const std::string& dev, const std::string& extra = "", const char* impl = "flashmonoid") {
  char line[640];
  std::snprintf(line, sizeof line,
                "{\"impl\": \"%s\", \"pass\": \"%s\", \"dtype\": \"bf16\", \"hdim\": %d, \"causal\": %s, "
                "\"batch\": %d, \"nheads\": %d, \"nheads_k\": %d, \"seqlen_q\": %d, \"seqlen_k\": %d, \"ms\": %.5f, "
                "\"%s\": %.3f, \"device\": \"%s\"%s}",
                impl, pass, d, causal ? "true" : "false", b, h, hk, sq, sk, ms, metric, value, dev.c_str(), extra.c_str());
  records.push_back(line);
  std::fprintf(stderr, "%s\n", line);
}

TensorView view4(void* p, DType t, int b, int s, int h, int d) { return TensorView(p, t, Device::cuda(0), {b, s, h, d}); }

bool g_with_sm80 = false;  // --with-sm80: also time the sm80 family forced
float g_softcap = 0.0f;    // --softcap X: the training shapes with a softcap (the score-modifier kernels)

// A training shape: 16k tokens, hidden 2048, bf16 random q, k, v; its out and lse; its forward FLOPs.
struct TrainShape {
  int b, h;
  std::size_t elems;
  Buf q, k, v, o, lse;
  TensorView qv, kv, vv, ov, lv;
  flashmonoid::Options opt;
  double flops;
  TrainShape(int d, bool causal, int s)
      : b(16384 / s), h(2048 / d), elems(static_cast<std::size_t>(b) * s * h * d), q(elems * 2, true),
        k(elems * 2, true), v(elems * 2, true), o(elems * 2), lse(static_cast<std::size_t>(b) * h * s * 4),
        qv(view4(q.p, DType::bf16, b, s, h, d)), kv(view4(k.p, DType::bf16, b, s, h, d)),
        vv(view4(v.p, DType::bf16, b, s, h, d)), ov(view4(o.p, DType::bf16, b, s, h, d)),
        lv(lse.p, DType::f32, Device::cuda(0), {b, h, s}),
        flops(4.0 * b * h * static_cast<double>(s) * s * d / (causal ? 2 : 1)) {
    opt.causal = causal;
    opt.softcap = g_softcap;
  }
};

void bench_train(int d, bool causal, int s, bool with_bwd, const std::string& dev) {
  TrainShape t(d, causal, s);
  const int b = t.b, h = t.h;
  const std::size_t elems = t.elems;
  const TensorView &qv = t.qv, &kv = t.kv, &vv = t.vv, &ov = t.ov, &lv = t.lv;
  const flashmonoid::Options& opt = t.opt;
  const double flops = t.flops;
  // The default kernels (sm90 on Hopper), then (--with-sm80) the sm80 family forced, for the comparison.
  // With the workspace a caller passes (the sm90 forward's split tail; Python passes it too).
  const std::size_t fwd_ws = flashmonoid::forward_workspace_size(qv, kv, opt);
  Buf fwd_work(fwd_ws);
  flashmonoid::Context fwd_ctx;
  fwd_ctx.workspace = fwd_work.p;
  fwd_ctx.workspace_bytes = fwd_ws;
  const double fwd = device_ms([&] { flashmonoid::forward(qv, kv, vv, ov, lv, opt, fwd_ctx); });
  char mods[48] = "";
  if (opt.softcap > 0.0f) std::snprintf(mods, sizeof mods, ", \"softcap\": %g", opt.softcap);
  record("fwd", d, causal, b, h, h, s, s, fwd, "tflops", flops / fwd / 1e9, dev, mods);
  flashmonoid::Context sm80;
  sm80.cuda_path = flashmonoid::CudaPath::sm80;
  if (g_with_sm80) {
    const double fwd80 = device_ms([&] { flashmonoid::forward(qv, kv, vv, ov, lv, opt, sm80); });
    record("fwd", d, causal, b, h, h, s, s, fwd80, "tflops", flops / fwd80 / 1e9, dev, mods, "flashmonoid_sm80");
  }
  if (!with_bwd) return;
  try {
    Buf dout(elems * 2, true), dq(elems * 2), dk(elems * 2), dv(elems * 2);
    TensorView dov = view4(dout.p, DType::bf16, b, s, h, d), dqv = view4(dq.p, DType::bf16, b, s, h, d),
               dkv = view4(dk.p, DType::bf16, b, s, h, d), dvv = view4(dv.p, DType::bf16, b, s, h, d);
    const std::size_t ws = flashmonoid::backward_workspace_size(qv, kv, opt);
    Buf work(ws);
    flashmonoid::Context ctx;
    ctx.workspace = work.p;
    ctx.workspace_bytes = ws;
    const double bwd =
        device_ms([&] { flashmonoid::backward(dov, qv, kv, vv, ov, lv, dqv, dkv, dvv, opt, ctx); });
    record("bwd", d, causal, b, h, h, s, s, bwd, "tflops", 2.5 * flops / bwd / 1e9, dev);
    // The sm80 family forced (--with-sm80), and the deterministic mode (issue 9's bar: >= 0.85x the
    // default).
    if (g_with_sm80) {
      flashmonoid::Context ctx80 = ctx;
      ctx80.cuda_path = flashmonoid::CudaPath::sm80;
      const double bwd80 =
          device_ms([&] { flashmonoid::backward(dov, qv, kv, vv, ov, lv, dqv, dkv, dvv, opt, ctx80); });
      record("bwd", d, causal, b, h, h, s, s, bwd80, "tflops", 2.5 * flops / bwd80 / 1e9, dev, "", "flashmonoid_sm80");
    }
    if (d == 128 && s >= 4096) {
      flashmonoid::Options det = opt;
      det.deterministic = true;
      const double bwd_det =
          device_ms([&] { flashmonoid::backward(dov, qv, kv, vv, ov, lv, dqv, dkv, dvv, det, ctx); });
      record("bwd", d, causal, b, h, h, s, s, bwd_det, "tflops", 2.5 * flops / bwd_det / 1e9, dev, "",
             "flashmonoid_deterministic");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bwd d%d s%d: %s\n", d, s, e.what());
  }
}

// The forward's partial last round (issue 8, tile_fwd_sm90.hpp: fwd_split_tail): TFLOP/s of the
// default kernels without the workspace, with it (the split tail, hdim 64), and without it on
// ctx.sm_margin 4 (128 blocks on the H100), rounds alternated, medians.
void grid_probe() {
  constexpr int kRounds = 3;
  std::printf("%-5s %-6s %-6s %9s %9s %9s\n", "hdim", "causal", "s", "no_ws", "ws", "margin4");
  for (int d : {64, 128, 256})
    for (bool causal : {false, true})
      for (int s : {512, 1024, 2048, 4096, 16384}) {
        TrainShape sh(d, causal, s);
        const std::size_t ws = flashmonoid::forward_workspace_size(sh.qv, sh.kv, sh.opt);
        Buf work(ws);
        std::vector<double> t[3];
        for (int r = 0; r < kRounds; ++r)
          for (int m = 0; m < 3; ++m) {
            flashmonoid::Context ctx;
            if (m == 1) {
              ctx.workspace = work.p;
              ctx.workspace_bytes = ws;
            }
            if (m == 2) ctx.sm_margin = 4;
            t[m].push_back(device_ms([&] { flashmonoid::forward(sh.qv, sh.kv, sh.vv, sh.ov, sh.lv, sh.opt, ctx); }));
          }
        std::printf("%-5d %-6d %-6d", d, causal ? 1 : 0, s);
        for (auto& x : t) {
          std::sort(x.begin(), x.end());
          std::printf(" %9.1f", sh.flops / x[kRounds / 2] / 1e9);
        }
        std::printf("\n");
      }
}

// The decoding shape: s_q new tokens (1 unless said), 32 query heads over 8 KV heads, hdim 128, bf16.
struct DecodeProblem {
  static constexpr int h = 32, hk = 8, d = 128;
  int b, sk;
  std::size_t kv_bytes;  // of K, and of V
  Buf q, o, lse, k, v;
  TensorView qv, ov, kv, vv, lv;
  DecodeProblem(int b_, int sk_, int sq = 1)
      : b(b_), sk(sk_), kv_bytes(static_cast<std::size_t>(b_) * sk_ * hk * d * 2),
        q(static_cast<std::size_t>(b_) * sq * h * d * 2, true), o(static_cast<std::size_t>(b_) * sq * h * d * 2),
        lse(static_cast<std::size_t>(b_) * h * sq * 4), k(kv_bytes, true), v(kv_bytes, true),
        qv(view4(q.p, DType::bf16, b_, sq, h, d)), ov(view4(o.p, DType::bf16, b_, sq, h, d)),
        kv(view4(k.p, DType::bf16, b_, sk_, hk, d)), vv(view4(v.p, DType::bf16, b_, sk_, hk, d)),
        lv(lse.p, DType::f32, Device::cuda(0), {b_, h, sq}) {}
  void run(const flashmonoid::Context& ctx) { flashmonoid::forward(qv, kv, vv, ov, lv, {}, ctx); }
  // Graph-replayed time of one call with ctx on the graph's stream.
  double graph_ms(const flashmonoid::Context& ctx) {
    return ::graph_ms([&](cudaStream_t s) {
      flashmonoid::Context c = ctx;
      c.stream = s;
      run(c);
    });
  }
  double tbps(double ms) const { return 2.0 * kv_bytes / ms / 1e9; }
};

void bench_decode(int b, int sk, const std::string& dev) {
  DecodeProblem pb(b, sk);
  const std::size_t ws = flashmonoid::forward_workspace_size(pb.qv, pb.kv);
  Buf work(ws);
  flashmonoid::Context ctx;
  ctx.workspace = work.p;
  ctx.workspace_bytes = ws;
  const double ms = median_ms([&] { pb.run(ctx); });
  const double host = host_us([&] { pb.run(ctx); });
  char extra[96];
  std::snprintf(extra, sizeof extra, ", \"timing\": \"events\", \"host_us\": %.1f", host);
  const int h = DecodeProblem::h, hk = DecodeProblem::hk, d = DecodeProblem::d;
  record("fwd", d, false, b, h, hk, 1, sk, ms, "tbps", pb.tbps(ms), dev, extra);
  const double gms = pb.graph_ms(ctx);
  record("fwd", d, false, b, h, hk, 1, sk, gms, "tbps", pb.tbps(gms), dev, ", \"timing\": \"graph\"");
}

// Decoding with forced split counts, graph-replayed (a tuning sweep, printed only).
void sweep_decode_splits(int b, int sk) {
  DecodeProblem pb(b, sk);
  Buf work(std::size_t{64} << 20);
  std::fprintf(stderr, "decoding b = %d, s_k = %d\n", b, sk);
  for (int splits : {2, 4, 8, 12, 16, 20, 24, 28, 32, 33, 48, 64}) {
    flashmonoid::Context ctx;
    ctx.workspace = work.p;
    ctx.workspace_bytes = work.bytes;
    ctx.num_splits = splits;
    const double gms = pb.graph_ms(ctx);
    std::fprintf(stderr, "splits %3d: %.2f us, %.3f TB/s\n", splits, gms * 1e3, pb.tbps(gms));
  }
}

// Issue 8's choice for split-KV decoding (s_q <= 16): the sm80 kernels (GQA packing, split keys)
// against the sm90 ones, graph-replayed K/V TB/s, printed. The sm90 forward takes s_q > 64 only
// (fwd_sm90.hpp: kFwdSm90MinRows); build with -DFLASHMONOID_SM90_MIN_ROWS=1 for its column.
void decode_paths() {
  std::printf("%-4s %-7s %-4s %12s %12s\n", "b", "s_k", "s_q", "sm80 TB/s", "sm90 TB/s");
  for (int b : {1, 8, 32})
    for (int sk : {4096, 32768})
      for (int sq : {1, 4, 16}) {
        DecodeProblem pb(b, sk, sq);
        // Not forward_workspace_size: in the probe build it answers for the sm90 path, which would
        // leave the forced sm80 one without room for its splits.
        Buf work(std::size_t{64} << 20);
        double tb[2] = {0, 0};
        for (int a = 0; a < 2; ++a) {
          flashmonoid::Context ctx;
          ctx.workspace = work.p;
          ctx.workspace_bytes = work.bytes;
          ctx.cuda_path = a == 0 ? flashmonoid::CudaPath::sm80 : flashmonoid::CudaPath::sm90;
          try {
            tb[a] = pb.tbps(pb.graph_ms(ctx));
          } catch (const std::exception& e) {
            std::fprintf(stderr, "b %d s_k %d s_q %d: %s\n", b, sk, sq, e.what());
          }
        }
        std::printf("%-4d %-7d %-4d %12.3f %12.3f\n", b, sk, sq, tb[0], tb[1]);
      }
}

// KV-cache decoding through forward_kvcache (issue 10's bars): 32 query heads over 8 KV heads,
// hdim 128, bf16; the cache holds s_k keys after the call (s_k - s_new before it, s_new = s_q when
// appending). page 0 = contiguous cache, else pages of that many rows under a shuffled block table.
// tbps counts the K/V bytes the attention reads (2 · b · s_k · h_k · d · 2), next to the device's
// copy bandwidth measured in the same run.
struct KvDecode {
  static constexpr int h = 32, hk = 8;
  int d;  // head dim: 128 (the issue's shapes), 256 for --kv-probe-d256
  int b, sk, page, sq;
  bool append, rotary;
  int splits = 0;  // ctx.num_splits (0: the heuristic)
  flashmonoid::CallLaunch call_launch = flashmonoid::CallLaunch::automatic;  // ctx.call_launch
  std::size_t kv_bytes;
  Buf q, o, lse, k, v, k_new, v_new, cos, sin, seqlens, table;
  std::unique_ptr<Buf> work;
  flashmonoid::KVCache cache;
  flashmonoid::Rotary rot;
  TensorView qv, ov, lv, knv, vnv;
  flashmonoid::Options opt;

  static std::size_t rows(int b, int sk, int d = 128) { return static_cast<std::size_t>(b) * sk * hk * d * 2; }
  // shuffle: pages of a sequence scattered over the pool (the benchmark's case); false: in pool
  // order, which puts every row where a contiguous cache has it (only the gather's arithmetic differs).
  // head_major: a contiguous cache whose heads are outermost in memory ((b, h_k, s, d), SDPA's usual
  // layout, strided as (b, s, h_k, d)), where a K/V tile of one head is one contiguous run.
  KvDecode(int b_, int sk_, int page_, int sq_, bool append_, bool rotary_, bool shuffle = true, bool head_major = false,
           int d_ = 128)
      : d(d_), b(b_), sk(sk_), page(page_), sq(sq_), append(append_), rotary(rotary_), kv_bytes(rows(b_, sk_, d_)),
        q(static_cast<std::size_t>(b_) * sq_ * h * d_ * 2, true), o(static_cast<std::size_t>(b_) * sq_ * h * d_ * 2),
        lse(static_cast<std::size_t>(b_) * h * sq_ * 4), k(kv_bytes, true), v(kv_bytes, true),
        k_new(append_ ? rows(b_, sq_, d_) : 0, append_), v_new(append_ ? rows(b_, sq_, d_) : 0, append_),
        cos(rotary_ ? static_cast<std::size_t>(sk_) * d_ : 0, rotary_), sin(rotary_ ? static_cast<std::size_t>(sk_) * d_ : 0, rotary_),
        seqlens(static_cast<std::size_t>(b_) * 4), table(page_ ? static_cast<std::size_t>(b_) * (sk_ / page_) * 4 : 0) {
    const Device dev = Device::cuda(0);
    std::vector<int> lens(b, sk - (append ? sq : 0));
    CHECK(cudaMemcpy(seqlens.p, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    cache.seqlens = TensorView(seqlens.p, DType::i32, dev, {b});
    if (page) {
      const int per_seq = sk / page, pages = b * per_seq;
      std::vector<int> perm(pages);
      for (int i = 0; i < pages; ++i) perm[i] = i;
      std::uint32_t x = 12345;  // a fixed shuffle: pages of a sequence scattered over the pool
      for (int i = pages - 1; shuffle && i > 0; --i) {
        x = x * 1664525u + 1013904223u;
        std::swap(perm[i], perm[x % (i + 1)]);
      }
      CHECK(cudaMemcpy(table.p, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
      cache.k = TensorView(k.p, DType::bf16, dev, {pages, page, hk, d});
      cache.v = TensorView(v.p, DType::bf16, dev, {pages, page, hk, d});
      cache.block_table = TensorView(table.p, DType::i32, dev, {b, per_seq});
    } else if (head_major) {
      const std::int64_t hs = static_cast<std::int64_t>(sk) * d;
      cache.k = TensorView(k.p, DType::bf16, dev, {b, sk, hk, d}, {hk * hs, d, hs, 1});
      cache.v = TensorView(v.p, DType::bf16, dev, {b, sk, hk, d}, {hk * hs, d, hs, 1});
    } else {
      cache.k = view4(k.p, DType::bf16, b, sk, hk, d);
      cache.v = view4(v.p, DType::bf16, b, sk, hk, d);
    }
    if (rotary) {
      rot.cos = TensorView(cos.p, DType::bf16, dev, {sk, d / 2});
      rot.sin = TensorView(sin.p, DType::bf16, dev, {sk, d / 2});
      rot.interleaved = false;
    }
    qv = view4(q.p, DType::bf16, b, sq, h, d);
    ov = view4(o.p, DType::bf16, b, sq, h, d);
    lv = TensorView(lse.p, DType::f32, dev, {b, h, sq});
    if (append) {
      knv = view4(k_new.p, DType::bf16, b, sq, hk, d);
      vnv = view4(v_new.p, DType::bf16, b, sq, hk, d);
    }
    opt.causal = true;
    // Room for forced split counts too (the probe's): the partials of up to 160 splits.
    work = std::make_unique<Buf>(flashmonoid::forward_kvcache_workspace_size(qv, cache, knv, rot, opt) +
                                 static_cast<std::size_t>(160) * b * sq * h * (d + 1) * 4 + 4096);
  }
  flashmonoid::Context context(cudaStream_t stream) const {
    flashmonoid::Context ctx;
    ctx.stream = stream;
    ctx.workspace = work->p;
    ctx.workspace_bytes = work->bytes;
    ctx.num_splits = splits;
    ctx.call_launch = call_launch;
    return ctx;
  }
  void run(cudaStream_t stream) {
    flashmonoid::forward_kvcache(qv, cache, knv, vnv, rot, ov, lv, opt, context(stream));
  }
  // The Python bindings' route: pointers vouched for by DLPack, no cudaPointerGetAttributes.
  void run_dlpack(cudaStream_t stream) {
    flashmonoid::detail::forward_kvcache(qv, cache, knv, vnv, rot, ov, lv, opt, context(stream),
                                         flashmonoid::detail::PointerSource::dlpack, true);
  }
  double tbps(double ms) const { return 2.0 * kv_bytes / ms / 1e9; }
};

double g_copy_tbps = 0.0;

#ifdef FLASHMONOID_TRACE
// The block timeline of one decoding call (src/cuda/common/trace.cuh), graph-replayed back to back
// as bench_kvcache times it: the last call's marks, in us after the first block of the call started
// (the append's, else the forward's). Rows: each kernel's events over its blocks (min / 10% / median
// / 90% / max), then per-block durations from clock64 (cycles).
void kv_trace(int b, int sk, int page, int sq, bool append) {
  namespace fc = flashmonoid::cuda;
  Buf trace(fc::kTraceBytes);
  CHECK(cudaMemset(trace.p, 0, fc::kTraceBytes));
  fc::set_trace_buffer(trace.p);
  KvDecode pb(b, sk, page, sq, append, append);
  const double ms = graph_ms([&](cudaStream_t s) { pb.run(s); });
  fc::set_trace_buffer(nullptr);
  std::vector<unsigned long long> h(fc::kTraceBytes / 8);
  CHECK(cudaMemcpy(h.data(), trace.p, fc::kTraceBytes, cudaMemcpyDeviceToHost));
  auto at = [&](int k, int blk, int e, int c) {
    return h[((static_cast<std::size_t>(k) * fc::kTraceBlocks + blk) * fc::kTraceEvents + e) * 2 + c];
  };
  int blocks[fc::kTraceKernels];  // blocks that marked their entry, per kernel
  for (int k = 0; k < fc::kTraceKernels; ++k)
    for (blocks[k] = 0; blocks[k] < fc::kTraceBlocks && at(k, blocks[k], 0, 0) != 0;) ++blocks[k];
  const int first = blocks[0] > 0 ? 0 : 1;
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < blocks[first]; ++i) t0 = std::min(t0, at(first, i, 0, 0));
  auto row = [](const char* name, std::vector<double> v) {
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    auto q = [&](double f) { return v[static_cast<std::size_t>(f * (v.size() - 1) + 0.5)]; };
    std::printf("  %-34s %9.2f %9.2f %9.2f %9.2f %9.2f\n", name, q(0), q(0.1), q(0.5), q(0.9), q(1));
  };
  std::printf("kv-trace b %d s_k %d page %d s_q %d append %d: %.2f us per call, %.3f of copy\n", b, sk, page, sq,
              append, ms * 1e3, pb.tbps(ms) / g_copy_tbps);
  std::printf("  %-34s %9s %9s %9s %9s %9s\n", "(us after the call's first block)", "min", "10%", "median", "90%",
              "max");
  const char* kernels[] = {"append", "forward", "combine"};
  const char* events[fc::kTraceKernels][fc::kTraceEvents] = {{"after wait", "launched", "-", "exit"},
                                                             {"entry", "after wait", "mainloop done", "exit"},
                                                             {"entry", "after wait", "folded", "exit"}};
  std::vector<unsigned long long> stamps;
  for (int k = 0; k < fc::kTraceKernels; ++k) {
    const int n = blocks[k];
    for (int e = 0; e < fc::kTraceEvents; ++e) {
      std::vector<double> v;
      for (int i = 0; i < n; ++i)
        if (at(k, i, e, 0) != 0) {
          v.push_back((static_cast<double>(at(k, i, e, 0)) - static_cast<double>(t0)) / 1e3);
          stamps.push_back(at(k, i, e, 0));
        }
      const std::string name = std::string(kernels[k]) + " (" + std::to_string(n) + ") " + events[k][e];
      row(name.c_str(), v);
    }
  }
  // clock64 durations within a forward block (entry -> after wait -> mainloop done -> exit) and a
  // combine block (entry -> after wait -> splits folded -> exit).
  for (int k = 1; k < fc::kTraceKernels; ++k)
    for (int e = 1; e < fc::kTraceEvents; ++e) {
      std::vector<double> v;
      for (int i = 0; i < blocks[k]; ++i)
        if (at(k, i, e, 0) != 0 && at(k, i, e - 1, 0) != 0)
          v.push_back(static_cast<double>(at(k, i, e, 1) - at(k, i, e - 1, 1)));
      const std::string name = std::string(kernels[k]) + " cycles " + events[k][e - 1] + " -> " + events[k][e];
      row(name.c_str(), v);
    }
  std::sort(stamps.begin(), stamps.end());
  unsigned long long step = ~0ull;
  for (std::size_t i = 1; i < stamps.size(); ++i)
    if (stamps[i] != stamps[i - 1]) step = std::min(step, stamps[i] - stamps[i - 1]);
  std::printf("  globaltimer: smallest step between distinct stamps %llu ns\n", step);
}
#endif

void bench_kvcache(int b, int sk, int page, int sq, bool append, bool rotary, const std::string& dev) {
  constexpr std::size_t kMaxBytes = std::size_t{60} << 30;  // skip shapes over the H100's memory
  if (2 * KvDecode::rows(b, sk) > kMaxBytes) return;
  KvDecode pb(b, sk, page, sq, append, rotary);
  const double gms = graph_ms([&](cudaStream_t s) { pb.run(s); });
  const double host = host_us([&] { pb.run(nullptr); });
  char extra[256];
  std::snprintf(extra, sizeof extra,
                ", \"page_size\": %d, \"append\": %s, \"rotary\": %s, \"timing\": \"graph\", \"copy_tbps\": %.3f, "
                "\"host_us\": %.1f",
                page, append ? "true" : "false", rotary ? "true" : "false", g_copy_tbps, host);
  record("decode", pb.d, true, b, KvDecode::h, KvDecode::hk, sq, sk, gms, "tbps", pb.tbps(gms), dev, extra);
}

void bench_kvcache_all(const std::string& dev) {
  for (int b : {1, 8, 32, 64})
    for (int sk : {4096, 32768, 131072}) {
      bench_kvcache(b, sk, 0, 1, false, false, dev);  // the plain cache read: the bandwidth bar's baseline
      for (int page : {0, 1, 16, 64, 256}) bench_kvcache(b, sk, page, 1, true, true, dev);  // 1: SGLang-style pages
      bench_kvcache(b, sk, 0, 4, true, true, dev);  // speculative decoding, causal among 4 new tokens
    }
}

// Paged decoding against contiguous, taken apart (issue 10, bench/NOTES.md): graph-replayed TB/s of
// K/V, with append and rotary, for the page table shuffled or in pool order, at the heuristic's split
// count (two blocks per multiprocessor) and at half of it (one block per multiprocessor, the heuristic
// before 2026-11-26), on the shapes where page 16 lagged (b <= 8); those two rows with --kv-probe-all.
// Short caches (b = 1, 1k and 4k keys: L2-resident, see the top of the file) and the plain paged
// read (no append: a serving engine that writes its cache in a kernel of its own) as well.
void kv_probe(bool all, int d = 128) {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("%-4s %-7s %-20s %8s %8s\n", "b", "s_k", "variant", "TB/s", "x copy");
  const std::vector<std::pair<int, int>> shapes =
      d == 128 ? std::vector<std::pair<int, int>>{{1, 1024}, {1, 4096}, {1, 32768}, {8, 4096}, {1, 131072}, {8, 32768}, {8, 131072}}
               : std::vector<std::pair<int, int>>{{1, 1024}, {1, 4096}, {1, 16384}, {4, 4096}, {1, 65536}, {8, 32768}};
  for (auto [b, sk] : shapes) {
    const int one_per_sm = std::max(1, sms / (8 * b));  // 8 KV heads: b · 8 packed blocks
    struct V {
      const char* name;
      int page, sq, splits;
      bool append, shuffle;
    };
    for (const V& v : {V{"plain", 0, 1, 0, false, true}, V{"plain page16", 16, 1, 0, false, true},
                       V{"contiguous", 0, 1, 0, true, true},
                       V{"contiguous 1/SM", 0, 1, one_per_sm, true, true}, V{"page16", 16, 1, 0, true, true},
                       V{"page16 in order", 16, 1, 0, true, false}, V{"page16 1/SM", 16, 1, one_per_sm, true, true},
                       V{"page64", 64, 1, 0, true, true}, V{"s_q 4", 0, 4, 0, true, true}}) {
      if (!all && (v.splits != 0 || !v.shuffle)) continue;
      KvDecode pb(b, sk, v.page, v.sq, v.append, v.append, v.shuffle, false, d);
      pb.splits = v.splits;
      const double gms = graph_ms([&](cudaStream_t s) { pb.run(s); });
      std::printf("%-4d %-7d %-20s %8.3f %8.3f\n", b, sk, v.name, pb.tbps(gms), pb.tbps(gms) / g_copy_tbps);
    }
  }
}

// The cache's layout (issue 10): graph-replayed x copy of the plain read and the append + rotary
// call over a (b, s, h_k, d) cache (flash-attn's layout, the benchmark's) and over the same shape
// with the heads outermost in memory (SDPA's (b, h_k, s, d), which the cuDNN peer reads).
void kv_layout_probe() {
  std::printf("%-4s %-7s %-24s %8s %8s\n", "b", "s_k", "variant", "TB/s", "x copy");
  for (auto [b, sk] : {std::pair{1, 4096}, {1, 32768}, {8, 4096}, {1, 131072}, {8, 32768}})
    for (bool head_major : {false, true})
      for (bool append : {false, true}) {
        KvDecode pb(b, sk, 0, 1, append, append, true, head_major);
        const double gms = graph_ms([&](cudaStream_t s) { pb.run(s); });
        const std::string name = std::string(append ? "append" : "plain") + (head_major ? " head-major" : "");
        std::printf("%-4d %-7d %-24s %8.3f %8.3f\n", b, sk, name.c_str(), pb.tbps(gms), pb.tbps(gms) / g_copy_tbps);
      }
}

// Forced split counts on the 134 MB decoding shapes (issue 10): graph-replayed x copy per variant
// for the heuristic (0: one wave of two blocks per SM) and for several waves of shorter splits,
// which the block scheduler hands to whichever multiprocessor frees a slot first.
// short: b = 1 over 1-4k keys, where the key tiles per split rather than the resident blocks can cap
// the heuristic's splits (min_tiles_per_split in fwd_split_sm80.cu).
void kv_splits_probe(bool short_caches) {
  std::printf("%-4s %-7s %-10s %6s %8s\n", "b", "s_k", "variant", "splits", "x copy");
  struct Shape {
    int b, sk;
    std::vector<int> splits;
  };
  const std::vector<Shape> shapes =
      short_caches ? std::vector<Shape>{{1, 1024, {0, 8, 16, 24, 33}}, {1, 2048, {0, 8, 16, 24, 33}},
                                        {1, 4096, {0, 8, 24, 32, 33}}}
                   : std::vector<Shape>{{1, 32768, {0, 16, 20, 24, 28, 64}}, {8, 4096, {0, 2, 3, 8}},
                                        {1, 131072, {0, 16, 24, 64}}};
  for (const Shape& sh : shapes) {
    struct V {
      const char* name;
      int page, sq;
      bool append;
    };
    for (const V& v :
         {V{"plain", 0, 1, false}, V{"append", 0, 1, true}, V{"page16", 16, 1, true}, V{"s_q4", 0, 4, true}}) {
      KvDecode pb(sh.b, sh.sk, v.page, v.sq, v.append, v.append);
      for (int splits : sh.splits) {
        pb.splits = splits;
        const double gms = graph_ms([&](cudaStream_t s) { pb.run(s); });
        std::printf("%-4d %-7d %-10s %6d %8.3f\n", sh.b, sh.sk, v.name, splits, pb.tbps(gms) / g_copy_tbps);
      }
    }
  }
}

// Calls queued back to back from C++ without a graph of the caller's (an engine's eager decoding
// loop): wall time per call, so the host or the device, whichever is slower, over b = 1 caches of
// 1-32k keys (4-134 MB) with append and rotary, the call's kernels as the cached graph and one by one
// (Context::call_launch); where the graph's saved host time stops mattering is where the automatic
// choice (kGraphKvBytes in kvcache.cu) belongs. 500 calls and one synchronisation, median of 5 runs.
void kv_eager_probe() {
  std::printf("%-7s %8s %14s %14s\n", "s_k", "MB", "graph us/call", "kernels us/call");
  for (int sk : {1024, 4096, 8192, 12288, 16384, 32768}) {
    KvDecode pb(1, sk, 0, 1, true, true);
    double us[2];
    int m = 0;
    for (auto mode : {flashmonoid::CallLaunch::graph, flashmonoid::CallLaunch::kernels}) {
      pb.call_launch = mode;
      for (int i = 0; i < 50; ++i) pb.run(nullptr);
      CHECK(cudaDeviceSynchronize());
      std::vector<double> per_call;
      for (int r = 0; r < 5; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 500; ++i) pb.run(nullptr);
        CHECK(cudaDeviceSynchronize());
        per_call.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 500);
      }
      std::sort(per_call.begin(), per_call.end());
      us[m++] = per_call[2];
    }
    std::printf("%-7d %8.1f %14.2f %14.2f\n", sk, 2.0 * sk * KvDecode::hk * pb.d * 2 / 1e6, us[0], us[1]);
  }
}

// Host time of forward_kvcache in C++, the floor under the Python call (issue 10's bar: 15 us per
// decoding call): b = 1, 32/8 heads, hdim 128, 512 keys, s_q = 1, a 1-token append with rotary,
// contiguous and page 16. kHostCalls calls queued back to back and one synchronisation (512 keys
// keep the GPU ahead of the host, so the clock times the host); least of 5 runs, us per call.
// impl "flashmonoid_cpp": the public call, which asks the runtime about every pointer;
// "flashmonoid_cpp_dlpack": the bindings' route (PointerSource::dlpack), alignment checks only.
// Also, contiguous through the bindings' route, the same call with fewer launches: no append or
// rotary (the forward and the split-KV combine), and unsplit as well (the forward alone); records
// carry "launches". Each twice: the call's kernels as the cached graph (Context::call_launch, the
// default at 512 keys) and one by one; records carry "call_launch".
void bench_kvcache_host(const std::string& dev) {
  constexpr int kHostCalls = 1000, kRuns = 5;
  struct Variant {
    int page;
    bool append;
    int splits, launches;
  };
  for (const Variant& var : {Variant{0, true, 0, 3}, Variant{16, true, 0, 3}, Variant{0, false, 0, 2}, Variant{0, false, 1, 1}}) {
    const int page = var.page;
    KvDecode pb(1, 512, page, 1, var.append, var.append);
    pb.splits = var.splits;
    for (bool dlpack : {false, true})
      for (auto mode : {flashmonoid::CallLaunch::graph, flashmonoid::CallLaunch::kernels}) {
        if (!var.append && !dlpack) continue;
        pb.call_launch = mode;
        auto call = [&] { dlpack ? pb.run_dlpack(nullptr) : pb.run(nullptr); };
        for (int i = 0; i < 50; ++i) call();
        CHECK(cudaDeviceSynchronize());
        std::vector<double> per_call;
        for (int r = 0; r < kRuns; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < kHostCalls; ++i) call();
          const auto t1 = std::chrono::steady_clock::now();
          CHECK(cudaDeviceSynchronize());
          per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kHostCalls);
        }
        const double us = *std::min_element(per_call.begin(), per_call.end());
        char extra[240];
        std::snprintf(extra, sizeof extra,
                      ", \"page_size\": %d, \"append\": %s, \"rotary\": %s, \"calls\": %d, \"launches\": %d, "
                      "\"call_launch\": \"%s\"",
                      page, var.append ? "true" : "false", var.append ? "true" : "false", kHostCalls, var.launches,
                      mode == flashmonoid::CallLaunch::graph ? "graph" : "kernels");
        record("decode_host", pb.d, true, 1, KvDecode::h, KvDecode::hk, 1, 512, us / 1000.0, "host_us", us, dev,
               extra, dlpack ? "flashmonoid_cpp_dlpack" : "flashmonoid_cpp");
      }
  }
}

__global__ void empty_kernel() {}
struct KiloArgs {
  unsigned char bytes[1024];
};
__global__ void kilo_kernel(const __grid_constant__ KiloArgs) {}

// Host cost of the CUDA calls a forward makes, each timed alone (median of 15 runs of 200 calls).
void host_costs() {
  void* dptr = nullptr;
  CHECK(cudaMalloc(&dptr, 1 << 20));
  auto per_call = [](auto&& f) {
    std::vector<double> t;
    for (int r = 0; r < 15; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 200; ++i) f();
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200);
      CHECK(cudaDeviceSynchronize());
    }
    return median(t);
  };
  int dev = 0, n = 0;
  cudaPointerAttributes attr{};
  std::fprintf(stderr, "cudaPointerGetAttributes: %.3f us\n", per_call([&] { CHECK(cudaPointerGetAttributes(&attr, dptr)); }));
  std::fprintf(stderr, "cudaGetDevice: %.3f us\n", per_call([&] { CHECK(cudaGetDevice(&dev)); }));
  std::fprintf(stderr, "cudaDeviceGetAttribute: %.3f us\n",
               per_call([&] { CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0)); }));
  std::fprintf(stderr, "cudaFuncSetAttribute: %.3f us\n", per_call([&] {
                 CHECK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
               }));
  std::fprintf(stderr, "launch (empty kernel): %.3f us\n", per_call([&] { empty_kernel<<<1, 32>>>(); }));
  // What our launches add to that: a 1 KB __grid_constant__ argument (FwdParams-sized), and
  // cudaLaunchKernelEx with the programmatic-serialization attribute (pdl.cuh: launch_kernel).
  const KiloArgs kilo{};
  std::fprintf(stderr, "launch (1 KB argument): %.3f us\n", per_call([&] { kilo_kernel<<<1, 32>>>(kilo); }));
  auto launch_ex = [&](auto kernel, bool pdl, auto... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(1);
    config.blockDim = dim3(32);
    config.attrs = attr;
    config.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&config, kernel, args...));
  };
  std::fprintf(stderr, "cudaLaunchKernelEx, no attribute: %.3f us\n", per_call([&] { launch_ex(empty_kernel, false); }));
  std::fprintf(stderr, "cudaLaunchKernelEx, PDL attribute: %.3f us\n", per_call([&] { launch_ex(empty_kernel, true); }));
  std::fprintf(stderr, "cudaLaunchKernelEx, PDL, 1 KB argument: %.3f us\n",
               per_call([&] { launch_ex(kilo_kernel, true, kilo); }));
  cudaStreamCaptureStatus capture{};
  std::fprintf(stderr, "cudaStreamIsCapturing: %.3f us\n", per_call([&] { CHECK(cudaStreamIsCapturing(nullptr, &capture)); }));
  std::fprintf(stderr, "cudaGetLastError: %.3f us\n", per_call([&] { (void)cudaGetLastError(); }));
  cudaFree(dptr);
}

void bench_copy(const std::string& dev) {
  const std::size_t bytes = std::size_t{1} << 30;
  Buf a(bytes, true), c(bytes);
  const double ms = median_ms([&] { CHECK(cudaMemcpyAsync(c.p, a.p, bytes, cudaMemcpyDeviceToDevice)); });
  char line[256];
  g_copy_tbps = 2.0 * bytes / ms / 1e9;
  std::snprintf(line, sizeof line,
                "{\"impl\": \"device_copy\", \"pass\": \"copy\", \"bytes\": %zu, \"ms\": %.5f, \"tbps\": %.3f, "
                "\"device\": \"%s\"}",
                2 * bytes, ms, g_copy_tbps, dev.c_str());
  records.push_back(line);
  std::fprintf(stderr, "%s\n", line);
}

// The forward allocates nothing: its extra memory is exactly what the caller passes (out, lse and
// the split workspace, 0 for this shape). Measured as device memory in use around the call.
void memory_64k(const std::string& dev) {
  const int b = 1, h = 16, d = 64, s = 65536;
  const std::size_t elems = static_cast<std::size_t>(b) * s * h * d;
  Buf q(elems * 2, true), k(elems * 2, true), v(elems * 2, true);
  std::size_t free0 = 0, total = 0, free1 = 0;
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemGetInfo(&free0, &total));
  Buf o(elems * 2), lse(static_cast<std::size_t>(b) * h * s * 4);
  TensorView qv = view4(q.p, DType::bf16, b, s, h, d), kv = view4(k.p, DType::bf16, b, s, h, d),
             vv = view4(v.p, DType::bf16, b, s, h, d), ov = view4(o.p, DType::bf16, b, s, h, d);
  TensorView lv(lse.p, DType::f32, Device::cuda(0), {b, h, s});
  const std::size_t ws = flashmonoid::forward_workspace_size(qv, kv);
  flashmonoid::forward(qv, kv, vv, ov, lv);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemGetInfo(&free1, &total));
  char line[384];
  std::snprintf(line, sizeof line,
                "{\"impl\": \"flashmonoid\", \"pass\": \"fwd_memory\", \"dtype\": \"bf16\", \"hdim\": %d, \"batch\": %d, "
                "\"nheads\": %d, \"seqlen_q\": %d, \"seqlen_k\": %d, \"extra_bytes\": %zu, \"out_lse_bytes\": %zu, "
                "\"workspace_bytes\": %zu, \"device\": \"%s\"}",
                d, b, h, s, s, free0 - free1, o.bytes + lse.bytes, ws, dev.c_str());
  records.push_back(line);
  std::fprintf(stderr, "%s\n", line);
}

// The records as a JSON list, to out_path or stdout.
void write_records(const char* out_path) {
  FILE* f = out_path ? std::fopen(out_path, "w") : stdout;
  std::fprintf(f, "[\n");
  for (std::size_t i = 0; i < records.size(); ++i) std::fprintf(f, "  %s%s\n", records[i].c_str(), i + 1 < records.size() ? "," : "");
  std::fprintf(f, "]\n");
  if (f != stdout) std::fclose(f);
}

}  // namespace

// Usage: flashmonoid-gpu-bench [OUT.json] [--no-bwd] [--with-sm80] [--softcap X] [--case HDIM CAUSAL SEQLEN] [--decode-only] [--sweep]
//        [--kvcache-only | --no-kvcache] [--kvcache-host] [--host-costs]
// --case runs one training shape (for a profiler; repeated, several in the order given), --decode-only
// the decoding shapes, --sweep the host cost of single CUDA calls (--host-costs: only those) and the
// decoding shapes over forced split counts, --kvcache-only
// the device copy and the forward_kvcache decoding shapes (pass "decode"), --no-kvcache all but those,
// --kvcache-host only the host time of the C++ forward_kvcache (pass "decode_host"), --grid-probe the
// forward's partial last round (grid_probe), --kv-trace B S_K PAGE S_Q APPEND one decoding call's
// block timeline (kv_trace; a -DFLASHMONOID_TRACE=ON build), --kv-splits the 134 MB decoding shapes
// over forced split counts (kv_splits_probe), --kv-splits-short b = 1 over 1-4k keys, --kv-eager
// back-to-back calls without a caller's graph, the call's kernels as a graph or one by one, --kv-layout
// the plain and append calls over (b, s, h_k, d) and head-major caches (kv_layout_probe),
// --kv-probe-d256 kv_probe's variants at head dim 256 (Gemma's; shapes of the same bytes as hdim 128's).
int main(int argc, char** argv) {
  const std::string dev = device_name();
  const char* out_path = nullptr;
  bool with_bwd = true, decode_only = false, kvcache_only = false, with_kvcache = true, kvcache_host = false;
  bool kv_probe_only = false, kv_probe_all = false, kv_splits_only = false, kv_splits_short = false;
  bool kv_layout_only = false;
  int kv_probe_d = 128;
  std::vector<std::array<int, 3>> cases;  // (hdim, causal, seqlen)
  std::vector<std::array<int, 5>> traces;  // --kv-trace (b, s_k, page, s_q, append)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--no-bwd")) with_bwd = false;
    else if (!std::strcmp(argv[i], "--with-sm80")) g_with_sm80 = true;
    else if (!std::strcmp(argv[i], "--softcap") && i + 1 < argc) g_softcap = static_cast<float>(std::atof(argv[++i]));
    else if (!std::strcmp(argv[i], "--decode-only")) decode_only = true;
    else if (!std::strcmp(argv[i], "--kvcache-only")) kvcache_only = true;
    else if (!std::strcmp(argv[i], "--no-kvcache")) with_kvcache = false;
    else if (!std::strcmp(argv[i], "--kvcache-host")) kvcache_host = true;
    else if (!std::strcmp(argv[i], "--kv-probe")) kv_probe_only = true;
    else if (!std::strcmp(argv[i], "--grid-probe")) {
      grid_probe();
      return 0;
    }
    else if (!std::strcmp(argv[i], "--kv-probe-all")) kv_probe_only = kv_probe_all = true;
    else if (!std::strcmp(argv[i], "--kv-probe-d256")) kv_probe_only = true, kv_probe_d = 256;
    else if (!std::strcmp(argv[i], "--kv-splits")) kv_splits_only = true;
    else if (!std::strcmp(argv[i], "--kv-eager")) {
      kv_eager_probe();
      return 0;
    }
    else if (!std::strcmp(argv[i], "--kv-layout")) kv_layout_only = true;
    else if (!std::strcmp(argv[i], "--kv-splits-short")) kv_splits_only = kv_splits_short = true;
    else if (!std::strcmp(argv[i], "--kv-case") && i + 4 < argc) {
      // One decoding shape (b, s_k, page, s_q; append and rotary), 20 calls on the default stream
      // and graph-replayed TB/s: for profilers (ncu -k ... on these calls).
      KvDecode pb(std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3]), std::atoi(argv[i + 4]), true,
                  true);
      for (int r = 0; r < 20; ++r) pb.run(nullptr);
      CHECK(cudaDeviceSynchronize());
      std::printf("kv-case b %d s_k %d page %d s_q %d: %.3f TB/s\n", pb.b, pb.sk, pb.page, pb.sq,
                  pb.tbps(graph_ms([&](cudaStream_t s) { pb.run(s); })));
      return 0;
    }
    else if (!std::strcmp(argv[i], "--kv-trace") && i + 5 < argc) {
      // A decoding shape's block timeline (b, s_k, page, s_q, append 0/1), repeatable; a
      // -DFLASHMONOID_TRACE=ON build.
      traces.push_back({std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3]), std::atoi(argv[i + 4]),
                        std::atoi(argv[i + 5])});
      i += 5;
    }
    else if (!std::strcmp(argv[i], "--host-costs")) {
      host_costs();
      return 0;
    }
    else if (!std::strcmp(argv[i], "--decode-paths")) {
      decode_paths();
      return 0;
    }
    else if (!std::strcmp(argv[i], "--sweep")) {
      host_costs();
      sweep_decode_splits(1, 32768);
      sweep_decode_splits(1, 131072);
      sweep_decode_splits(8, 32768);
      sweep_decode_splits(8, 131072);
      return 0;
    }
    else if (!std::strcmp(argv[i], "--case") && i + 3 < argc) {
      cases.push_back({std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3])});
      i += 3;
    } else out_path = argv[i];
  }
  if (!traces.empty()) {
#ifdef FLASHMONOID_TRACE
    bench_copy(dev);
    for (const auto& t : traces) kv_trace(t[0], t[1], t[2], t[3], t[4] != 0);
    return 0;
#else
    std::fprintf(stderr, "--kv-trace needs a build with -DFLASHMONOID_TRACE=ON\n");
    return 1;
#endif
  }
  if (!cases.empty()) {
    for (const auto& c : cases) bench_train(c[0], c[1] != 0, c[2], with_bwd, dev);
    return 0;
  }
  if (kvcache_host) {
    bench_kvcache_host(dev);
    write_records(out_path);
    return 0;
  }
  bench_copy(dev);
  if (kv_probe_only) {
    kv_probe(kv_probe_all, kv_probe_d);
    return 0;
  }
  if (kv_splits_only) {
    kv_splits_probe(kv_splits_short);
    return 0;
  }
  if (kv_layout_only) {
    kv_layout_probe();
    return 0;
  }
  if (kvcache_only) decode_only = true;
  if (!decode_only)
    for (int d : {64, 128, 256})
      for (bool causal : {false, true})
        for (int s : {512, 1024, 2048, 4096, 8192, 16384}) bench_train(d, causal, s, with_bwd, dev);
  if (!decode_only && !kvcache_only)
    for (int d : {96, 192})
      for (bool causal : {false, true}) bench_train(d, causal, 16384, false, dev);
  if (!kvcache_only) {
    for (int b : {1, 8})
      for (int sk : {32768, 131072}) bench_decode(b, sk, dev);
    memory_64k(dev);
  }
  if (with_kvcache) bench_kvcache_all(dev);
  write_records(out_path);
  return 0;
}
