// Ring attention benchmark (issue 11): one process per GPU (tools/ring_gpu_run.sh). For each total
// sequence length and mask, times on every rank
//   single_gpu        flashmonoid on the whole sequence on one GPU (each rank runs it alone);
//   flashmonoid_ring  flashmonoid::ring::Ring on the rank's shard (zigzag for causal);
//   allgather_kv      ncclAllGather of K/V, local attention of the rank's queries against the whole
//                     K/V (and for the backward: dK/dV summed with ncclReduceScatter); its
//                     exposed_comm_ms is the time of those collectives (nothing overlaps them);
// and the ring once more with a transport that moves nothing (same schedule, kernels and buffers):
// exposed_comm_ms = T(ring) - T(ring without communication). efficiency = T(single_gpu) /
// (world_size x T(impl)), T(impl) the slowest rank's median. bf16, batch 1, hdim and heads as given.
// Writes JSON records {impl, pass, world_size, seqlen_total, causal, ms, efficiency,
// exposed_comm_ms, device, ...} to argv[1] (rank 0).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "dist/device_ops.hpp"
#include "dist/ring.hpp"
#include "flashmonoid/flashmonoid.hpp"
#include "flashmonoid/ring.hpp"
#include "nccl_bootstrap.hpp"

namespace {

namespace fm = flashmonoid;
namespace dist = flashmonoid::dist;
using fm::DType;
using fm::TensorView;

#define CK(call)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

__global__ void fill_random(__nv_bfloat16* p, std::int64_t n, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    p[i] = __float2bfloat16(static_cast<float>(x) * 0x1p-31f - 1.0f);
  }
}

// Device buffers owned by the benchmark (the library never allocates).
struct Buffers {
  std::vector<void*> ptrs;
  std::size_t bytes = 0;
  void* get(std::size_t n) {
    void* p = nullptr;
    CK(cudaMalloc(&p, n ? n : 1));
    ptrs.push_back(p);
    bytes += n;
    return p;
  }
  TensorView tensor(DType t, std::initializer_list<std::int64_t> dims, int dev, std::uint32_t seed = 0) {
    std::int64_t n = 1;
    for (auto d : dims) n *= d;
    void* p = get(n * fm::dtype_size(t));
    if (seed && t == DType::bf16) fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
    return TensorView(p, t, fm::Device::cuda(dev), dims);
  }
  ~Buffers() {
    for (void* p : ptrs) cudaFree(p);
  }
};

// The ring's schedule, kernels and buffers without communication: what the ring costs when its
// exchanges are free.
class NoTransport final : public dist::Transport {
 public:
  NoTransport(int rank, int world) : rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int start(dist::Message, dist::Message, int) override { return 0; }
  void wait(int) override {}

 private:
  int rank_, world_;
};

float median_ms(cudaStream_t s, int reps, const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<float> t;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, s));
    fn();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The slowest rank's value.
float max_over_ranks(float x, const fmdist::Comm& c, cudaStream_t s) {
  float* d;
  CK(cudaMalloc(&d, sizeof(float)));
  CK(cudaMemcpy(d, &x, sizeof x, cudaMemcpyHostToDevice));
  fmdist::check_nccl(ncclAllReduce(d, d, 1, ncclFloat, ncclMax, c.comm, s), "ncclAllReduce");
  CK(cudaStreamSynchronize(s));
  CK(cudaMemcpy(&x, d, sizeof x, cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  return x;
}

// q, k, v, out, lse, dout, dq, dk, dv of one attention call over `rows` tokens, inputs random.
struct AttentionTensors {
  TensorView q, k, v, o, l, dout, dq, dk, dv;
};
AttentionTensors attention_tensors(Buffers& b, std::int64_t rows, int heads, int hdim, int dev, std::uint32_t& seed) {
  auto t = [&](bool input) { return b.tensor(DType::bf16, {1, rows, heads, hdim}, dev, input ? ++seed : 0); };
  AttentionTensors a;
  a.q = t(true);
  a.k = t(true);
  a.v = t(true);
  a.o = t(false);
  a.l = b.tensor(DType::f32, {1, heads, rows}, dev);
  a.dout = t(true);
  a.dq = t(false);
  a.dk = t(false);
  a.dv = t(false);
  return a;
}

TensorView rows(const TensorView& t, std::int64_t a, std::int64_t e) {
  TensorView s = t;
  s.data = static_cast<char*>(t.data) + a * t.stride[1] * static_cast<std::int64_t>(fm::dtype_size(t.dtype));
  s.shape[1] = e - a;
  return s;
}

std::vector<std::int64_t> parse_list(const char* s) {
  std::vector<std::int64_t> out;
  for (const char* p = s; *p;) {
    out.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s OUT.json [--seqlens 131072,262144] [--heads 32] [--hdim 128] [--reps 3] [--causal 1,0] "
                 "[--sm-margin 0[,16,...]] [--passes fwd,fwd_bwd]\n",
                 argv[0]);
    return 1;
  }
  std::vector<std::int64_t> seqlens{131072, 262144}, causals{1, 0}, sm_margins{0};
  int heads = 32, hdim = 128, reps = 3;
  bool passes[2] = {true, true};  // fwd, fwd_bwd
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seqlens") seqlens = parse_list(argv[i + 1]);
    else if (a == "--heads") heads = std::atoi(argv[i + 1]);
    else if (a == "--hdim") hdim = std::atoi(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--causal") causals = parse_list(argv[i + 1]);
    else if (a == "--sm-margin") sm_margins = parse_list(argv[i + 1]);  // the ring's forwards leave SMs to NCCL
    else if (a == "--passes") {
      const std::string list = std::string(",") + argv[i + 1] + ",";
      passes[0] = list.find(",fwd,") != std::string::npos;
      passes[1] = list.find(",fwd_bwd,") != std::string::npos;
    }
  }
  const fmdist::Comm c = fmdist::init_comm();
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, c.device));
  const std::string device = std::string(prop.name) + " x" + std::to_string(c.world);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  fm::Context ctx;
  ctx.stream = s;
  const int P = c.world, dev = c.device;
  std::string json = "[\n";
  auto record = [&](const char* impl, const char* pass, std::int64_t S, bool causal, float ms, float single_ms,
                    double exposed, std::size_t mem, const std::string& extra) {
    char line[1024];
    std::snprintf(line, sizeof line,
                  "  {\"impl\": \"%s\", \"pass\": \"%s\", \"world_size\": %d, \"seqlen_total\": %lld, \"causal\": %s, "
                  "\"ms\": %.3f, \"efficiency\": %.4f, \"exposed_comm_ms\": %s, \"device\": \"%s\", \"heads\": %d, "
                  "\"hdim\": %d, \"dtype\": \"bf16\", \"batch\": 1, \"memory_bytes_per_gpu\": %zu%s},\n",
                  impl, pass, std::string(impl) == "single_gpu" ? 1 : P, static_cast<long long>(S),
                  causal ? "true" : "false", ms,
                  std::string(impl) == "single_gpu" ? 1.0 : single_ms / (P * ms),
                  exposed < 0 ? "null" : std::to_string(exposed).c_str(), device.c_str(), heads, hdim, mem,
                  extra.c_str());
    json += line;
    if (c.rank == 0) std::printf("%s", line);
    std::fflush(stdout);
  };

  // Median of `reps` runs of fn, or nothing when that pass was not asked for.
  auto timed = [&](int pass, const std::function<void()>& fn) { return passes[pass] ? median_ms(s, reps, fn) : 0.0f; };
  for (std::int64_t S : seqlens)
    for (std::int64_t causal_flag : causals) {
      const bool causal = causal_flag != 0;
      if (S % (2 * P) != 0) {
        std::fprintf(stderr, "seqlen %lld: the benchmark wants a multiple of 2 x world size\n", static_cast<long long>(S));
        continue;
      }
      fm::Options opt;
      opt.causal = causal;
      const auto layout = causal ? fm::ring::Layout::zigzag : fm::ring::Layout::contiguous;
      fm::ring::Ring ring(c.comm, S, layout);
      const std::int64_t n = ring.local_len();
      std::uint32_t seed = 1234 + static_cast<std::uint32_t>(c.rank) * 7919;

      // ---- single GPU on the whole sequence ----
      float single[2];
      std::size_t single_mem;
      {
        Buffers b;
        const auto [q, k, v, o, l, dout, dq, dk, dv] = attention_tensors(b, S, heads, hdim, dev, seed);
        const std::size_t wb = fm::backward_workspace_size(q, k, opt);
        fm::Context wctx = ctx;
        wctx.workspace = b.get(wb);
        wctx.workspace_bytes = wb;
        single_mem = b.bytes;
        single[0] = timed(0, [&] { fm::forward(q, k, v, o, l, opt, ctx); });
        single[1] = timed(1, [&] {
          fm::forward(q, k, v, o, l, opt, ctx);
          fm::backward(dout, q, k, v, o, l, dq, dk, dv, opt, wctx);
        });
      }
      for (int p = 0; p < 2; ++p) {
        if (!passes[p]) continue;
        single[p] = max_over_ranks(single[p], c, s);
        record("single_gpu", p ? "fwd_bwd" : "fwd", S, causal, single[p], single[p], -1, single_mem, "");
      }

      // ---- the ring ----
      {
        Buffers b;
        const auto [q, k, v, o, l, dout, dq, dk, dv] = attention_tensors(b, n, heads, hdim, dev, seed);
        const std::size_t wb = std::max(ring.forward_workspace_size(q, k, opt), ring.backward_workspace_size(q, k, opt));
        fm::Context rctx = ctx;
        rctx.workspace = b.get(wb);
        rctx.workspace_bytes = wb;
        const std::size_t mem = b.bytes;
        NoTransport none(c.rank, P);
        dist::CudaOps ops(s);
        const dist::RingSchedule sched = dist::make_schedule(P, S, causal ? dist::Layout::zigzag : dist::Layout::contiguous, opt);
        for (const std::int64_t sm_margin : sm_margins) {
          rctx.sm_margin = static_cast<int>(sm_margin);
          float t[2], quiet[2];
          t[0] = timed(0, [&] { ring.forward(q, k, v, o, l, opt, rctx); });
          t[1] = timed(1, [&] {
            ring.forward(q, k, v, o, l, opt, rctx);
            ring.backward(dout, q, k, v, o, l, dq, dk, dv, opt, rctx);
          });
          quiet[0] = timed(0, [&] { dist::ring_forward(q, k, v, o, l, opt, sched, none, ops, rctx); });
          quiet[1] = timed(1, [&] {
            dist::ring_forward(q, k, v, o, l, opt, sched, none, ops, rctx);
            dist::ring_backward(dout, q, k, v, o, l, dq, dk, dv, opt, sched, none, ops, rctx);
          });
          for (int p = 0; p < 2; ++p) {
            if (!passes[p]) continue;
            const float ms = max_over_ranks(t[p], c, s), q_ms = max_over_ranks(quiet[p], c, s);
            record("flashmonoid_ring", p ? "fwd_bwd" : "fwd", S, causal, ms, single[p], std::max(0.0f, ms - q_ms), mem,
                   ", \"ms_without_comm\": " + std::to_string(q_ms) + ", \"layout\": \"" +
                       (causal ? "zigzag" : "contiguous") + "\", \"sm_margin\": " + std::to_string(sm_margin));
          }
        }
      }

      // ---- all-gather K/V, then local attention against the whole sequence ----
      {
        Buffers b;
        const std::int64_t kv_elems = n * heads * hdim;  // one shard of k (or v)
        TensorView q = b.tensor(DType::bf16, {1, n, heads, hdim}, dev, ++seed), o = b.tensor(DType::bf16, {1, n, heads, hdim}, dev),
                   dout = b.tensor(DType::bf16, {1, n, heads, hdim}, dev, ++seed), dq = b.tensor(DType::bf16, {1, n, heads, hdim}, dev);
        TensorView kv_local = b.tensor(DType::bf16, {2, n, heads, hdim}, dev, ++seed);  // (k, v) of the shard
        TensorView gathered = b.tensor(DType::bf16, {2 * P, n, heads, hdim}, dev);  // every rank's (k, v)
        TensorView kf = b.tensor(DType::bf16, {1, S, heads, hdim}, dev), vf = b.tensor(DType::bf16, {1, S, heads, hdim}, dev);
        TensorView dkf = b.tensor(DType::f32, {1, S, heads, hdim}, dev), dvf = b.tensor(DType::f32, {1, S, heads, hdim}, dev);
        TensorView dkv_shards = b.tensor(DType::f32, {2 * P, n, heads, hdim}, dev);
        TensorView dkv_local = b.tensor(DType::f32, {2, n, heads, hdim}, dev);
        TensorView seg_lse = b.tensor(DType::f32, {1, heads, n}, dev);
        TensorView seg_dq = b.tensor(DType::bf16, {1, n, heads, hdim}, dev);
        TensorView seg_dk = b.tensor(DType::bf16, {1, S, heads, hdim}, dev), seg_dv = b.tensor(DType::bf16, {1, S, heads, hdim}, dev);
        std::size_t wb = 0;
        for (auto [g0, g1] : ring.shard_ranges(c.rank)) {
          const TensorView qs = rows(q, 0, g1 - g0), ks = rows(kf, 0, causal ? g1 : S);
          wb = std::max(wb, fm::backward_workspace_size(qs, ks, opt));
        }
        fm::Context actx = ctx;
        actx.workspace = b.get(wb);
        actx.workspace_bytes = wb;
        const std::size_t mem = b.bytes;
        dist::CudaOps ops(s);
        auto shard_view = [&](const TensorView& base, int r, int which, DType t) {  // (1, n, h, d) of rank r
          const std::size_t es = fm::dtype_size(t);
          return TensorView(static_cast<char*>(base.data) + (static_cast<std::size_t>(r) * 2 + which) * kv_elems * es, t,
                            fm::Device::cuda(dev), {1, n, heads, hdim});
        };
        // Calls fn(g0, g1, local) for each token range [g0, g1) of rank r, stored from local row `local`.
        auto each_range = [&](int r, auto fn) {
          std::int64_t local = 0;
          for (auto [g0, g1] : ring.shard_ranges(r)) {
            fn(g0, g1, local);
            local += g1 - g0;
          }
        };
        // Gathered shards -> the whole K/V in sequence order.
        const std::function<void()> gather_kv = [&] {
          fmdist::check_nccl(ncclAllGather(kv_local.data, gathered.data, 2 * kv_elems * 2, ncclUint8, c.comm, s), "ncclAllGather");
          for (int r = 0; r < P; ++r)
            each_range(r, [&](std::int64_t g0, std::int64_t g1, std::int64_t at) {
              ops.copy(rows(kf, g0, g1), rows(shard_view(gathered, r, 0, DType::bf16), at, at + g1 - g0), false);
              ops.copy(rows(vf, g0, g1), rows(shard_view(gathered, r, 1, DType::bf16), at, at + g1 - g0), false);
            });
        };
        // lse of the range stored from local row `at`: (1, heads, m), contiguous, disjoint per range.
        auto seg_lse_view = [&](std::int64_t at, std::int64_t m) {
          return TensorView(static_cast<float*>(seg_lse.data) + heads * at, DType::f32, fm::Device::cuda(dev), {1, heads, m});
        };
        // Each local query range against the keys it may see (causal: the prefix up to its end).
        auto forward = [&] {
          gather_kv();
          each_range(c.rank, [&](std::int64_t g0, std::int64_t g1, std::int64_t at) {
            const std::int64_t kend = causal ? g1 : S;
            fm::forward(rows(q, at, at + g1 - g0), rows(kf, 0, kend), rows(vf, 0, kend), rows(o, at, at + g1 - g0),
                        seg_lse_view(at, g1 - g0), opt, ctx);
          });
        };
        const std::function<void()> reduce_scatter = [&] {
          fmdist::check_nccl(ncclReduceScatter(dkv_shards.data, dkv_local.data, 2 * kv_elems, ncclFloat, ncclSum, c.comm, s),
                             "ncclReduceScatter");
        };
        auto backward = [&] {
          ops.fill(dkf, 0.0f);
          ops.fill(dvf, 0.0f);
          each_range(c.rank, [&](std::int64_t g0, std::int64_t g1, std::int64_t at) {
            const std::int64_t kend = causal ? g1 : S, m = g1 - g0;
            fm::backward(rows(dout, at, at + m), rows(q, at, at + m), rows(kf, 0, kend), rows(vf, 0, kend),
                         rows(o, at, at + m), seg_lse_view(at, m), rows(seg_dq, 0, m), rows(seg_dk, 0, kend),
                         rows(seg_dv, 0, kend), opt, actx);
            ops.copy(rows(dq, at, at + m), rows(seg_dq, 0, m), false);
            ops.copy(rows(dkf, 0, kend), rows(seg_dk, 0, kend), true);
            ops.copy(rows(dvf, 0, kend), rows(seg_dv, 0, kend), true);
          });
          for (int r = 0; r < P; ++r)  // sequence order -> shard order, then the sum over ranks
            each_range(r, [&](std::int64_t g0, std::int64_t g1, std::int64_t at) {
              ops.copy(rows(shard_view(dkv_shards, r, 0, DType::f32), at, at + g1 - g0), rows(dkf, g0, g1), false);
              ops.copy(rows(shard_view(dkv_shards, r, 1, DType::f32), at, at + g1 - g0), rows(dvf, g0, g1), false);
            });
          reduce_scatter();
        };
        float t[2];
        t[0] = timed(0, forward);
        t[1] = timed(1, [&] {
          forward();
          backward();
        });
        // Nothing overlaps this baseline's communication: all of it is exposed.
        const float gather_ms = median_ms(s, reps, gather_kv);
        const float comm[2] = {gather_ms, gather_ms + timed(1, reduce_scatter)};
        for (int p = 0; p < 2; ++p) {
          if (!passes[p]) continue;
          const float ms = max_over_ranks(t[p], c, s), exposed = max_over_ranks(comm[p], c, s);
          record("allgather_kv", p ? "fwd_bwd" : "fwd", S, causal, ms, single[p], exposed, mem, "");
        }
      }
    }
  if (json.size() > 2) json.erase(json.size() - 2, 1);  // the last comma
  json += "]\n";
  if (c.rank == 0) {
    FILE* f = std::fopen(argv[1], "w");
    if (f) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  ncclCommDestroy(c.comm);
  return 0;
}
