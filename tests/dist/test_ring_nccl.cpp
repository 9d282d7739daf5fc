// Ring attention on GPUs over NCCL, one process per GPU (tools/ring_gpu_run.sh launches them with
// RANK / WORLD_SIZE / FM_SEED set; without WORLD_SIZE >= 2 every test skips). Every rank builds the
// same whole-sequence problem (seeded by FM_SEED, fresh per run), runs flashmonoid::ring::Ring on
// its shard, and holds its rows of out, lse, dq, dk, dv to the FlashAttention rule against the
// float64 reference of the whole sequence; single-GPU flashmonoid on the whole sequence is held to
// the same rule and the largest ring - single-GPU difference is printed.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "attention_case.hpp"
#include "dist/ring.hpp"
#include "flashmonoid/ring.hpp"
#include "nccl_bootstrap.hpp"
#include "ring_shards.hpp"

namespace fmtest {
namespace {

namespace dist = flashmonoid::dist;
using flashmonoid::Context;
using flashmonoid::TensorView;
using flashmonoid::cpu::Precision;

fmdist::Comm& comm() {
  static fmdist::Comm c = fmdist::init_comm();
  return c;
}

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// A device copy of a contiguous host tensor; back() returns a host tensor of the same shape.
struct DeviceTensor {
  void* ptr = nullptr;
  TensorView view;
  DeviceTensor(const HostTensor& h, int device, bool upload = true) {
    const std::size_t bytes = h.numel() * flashmonoid::dtype_size(h.view.dtype);
    cudaMalloc(&ptr, bytes);
    if (upload)
      cudaMemcpy(ptr, h.view.data, bytes, cudaMemcpyHostToDevice);
    else
      cudaMemset(ptr, 0xff, bytes);  // poisoned (NaN in every float dtype)
    view = h.view;
    view.data = ptr;
    view.device = flashmonoid::Device::cuda(device);
  }
  ~DeviceTensor() { cudaFree(ptr); }
  HostTensor back() const {
    std::vector<std::int64_t> dims(view.shape, view.shape + view.ndim);
    HostTensor h(view.dtype, dims);
    cudaMemcpy(h.view.data, ptr, h.numel() * flashmonoid::dtype_size(view.dtype), cudaMemcpyDeviceToHost);
    return h;
  }
};

struct DeviceScratch {
  void* ptr = nullptr;
  explicit DeviceScratch(std::size_t bytes) { cudaMalloc(&ptr, bytes ? bytes : 1); }
  ~DeviceScratch() { cudaFree(ptr); }
};

struct GpuCase {
  Shape shape;
  flashmonoid::ring::Layout layout;
};
void PrintTo(const GpuCase& c, std::ostream* os) {
  *os << (c.layout == flashmonoid::ring::Layout::zigzag ? "zigzag " : "contiguous ") << c.shape.str();
}

std::vector<GpuCase> cases() {
  using flashmonoid::ring::Layout;
  std::vector<GpuCase> out;
  auto add = [&](int s, int h, int h_k, int d, DType t, bool causal, Layout l, int wl = -1, float softcap = 0) {
    Shape sh = fmtest::shape_of(t, 1, s, s, h, h_k, d);
    sh.causal = causal;
    sh.window_left = wl;
    sh.softcap = softcap;
    sh.padded_strides = false;
    out.push_back({sh, l});
  };
  add(1027, 8, 2, 128, DType::bf16, true, Layout::zigzag);         // GQA, causal, odd length
  add(1024, 4, 4, 64, DType::f16, false, Layout::contiguous);      // plain split
  add(1000, 8, 1, 128, DType::bf16, false, Layout::contiguous);    // MQA
  add(1100, 4, 2, 64, DType::bf16, true, Layout::zigzag, 200, 30); // window + softcap
  add(777, 4, 2, 128, DType::bf16, true, Layout::contiguous);      // causal without zigzag: skipped steps
  return out;
}

// Values of the reference with this rank's rows replaced by the ring's: the rule's error is then
// the error of this rank's rows, its budget that of the whole sequence.
std::vector<double> with_rows(const HostTensor& ref, const HostTensor& local, const std::vector<dist::Segment>& segs,
                              bool lse) {
  HostTensor t(ref.view.dtype, std::vector<std::int64_t>(ref.view.shape, ref.view.shape + ref.view.ndim));
  for (std::int64_t i = 0; i < ref.numel(); ++i) t.set(i, ref.get(i));
  lse ? unshard_lse(t, local, segs) : unshard(t, local, segs);
  return t.values();
}

class RingNccl : public ::testing::TestWithParam<GpuCase> {};

TEST_P(RingNccl, MatchesFloat64ReferenceAndSingleGpu) {
  if (fmdist::env_int("WORLD_SIZE", 1) < 2) GTEST_SKIP() << "run through tools/ring_gpu_run.sh (WORLD_SIZE >= 2)";
  const fmdist::Comm& c = comm();
  const GpuCase& gc = GetParam();
  static int case_index = 0;  // every rank runs the cases in the same order: same inputs everywhere
  rng().seed(static_cast<std::uint64_t>(fmdist::env_int("FM_SEED", 1)) * 1000 + case_index++);
  Problem pb(gc.shape);
  const Shape& s = gc.shape;
  flashmonoid::ring::Ring ring(c.comm, s.s_q, gc.layout);
  const dist::RingSchedule sched = dist::make_schedule(
      c.world, s.s_q, gc.layout == flashmonoid::ring::Layout::zigzag ? dist::Layout::zigzag : dist::Layout::contiguous,
      pb.opt);
  const auto segs = sched.segments(c.rank);
  const std::int64_t n = ring.local_len();
  ASSERT_EQ(n, sched.local_len(c.rank));

  auto [ref_o, ref_l] = pb.reference(Precision::f64);
  auto [lp_o, lp_l] = pb.reference(Precision::input);
  auto ref = pb.reference_backward(ref_o, ref_l, Precision::f64);
  auto lp = pb.reference_backward(ref_o, ref_l, Precision::input);

  // The ring: forward, then backward with the reference (out, lse) as the single-device tests do.
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  Context ctx;
  ctx.stream = stream;
  DeviceTensor q(shard(pb.q, segs, n), c.device), k(shard(pb.k, segs, n), c.device), v(shard(pb.v, segs, n), c.device);
  DeviceTensor dout(shard(pb.dout, segs, n), c.device), ro(shard(ref_o, segs, n), c.device),
      rl(shard_lse(ref_l, segs, n), c.device);
  DeviceTensor o(shard(ref_o, segs, n), c.device, false), l(shard_lse(ref_l, segs, n), c.device, false);
  DeviceTensor dq(shard(pb.q, segs, n), c.device, false), dk(shard(pb.k, segs, n), c.device, false),
      dv(shard(pb.v, segs, n), c.device, false);
  DeviceScratch ws(std::max(ring.forward_workspace_size(q.view, k.view, pb.opt),
                            ring.backward_workspace_size(q.view, k.view, pb.opt)));
  ctx.workspace = ws.ptr;
  ctx.workspace_bytes = std::max(ring.forward_workspace_size(q.view, k.view, pb.opt),
                                 ring.backward_workspace_size(q.view, k.view, pb.opt));
  ring.forward(q.view, k.view, v.view, o.view, l.view, pb.opt, ctx);
  ring.backward(dout.view, q.view, k.view, v.view, ro.view, rl.view, dq.view, dk.view, dv.view, pb.opt, ctx);
  CUDA_OK(cudaStreamSynchronize(stream));

  expect_close("ring out", s.dtype, with_rows(ref_o, o.back(), segs, false), ref_o.values(), lp_o.values());
  EXPECT_LE(max_abs_diff(with_rows(ref_l, l.back(), segs, true), ref_l.values()),
            1e-5 * std::max(1.0, max_abs(ref_l.values())))
      << "ring lse";
  expect_close("ring dq", s.dtype, with_rows(ref.dq, dq.back(), segs, false), ref.dq.values(), lp.dq.values());
  expect_close("ring dk", s.dtype, with_rows(ref.dk, dk.back(), segs, false), ref.dk.values(), lp.dk.values());
  expect_close("ring dv", s.dtype, with_rows(ref.dv, dv.back(), segs, false), ref.dv.values(), lp.dv.values());

  // Single-GPU flashmonoid on the whole sequence, same inputs.
  DeviceTensor fq(pb.q, c.device), fk(pb.k, c.device), fv(pb.v, c.device), fdout(pb.dout, c.device),
      fro(ref_o, c.device), frl(ref_l, c.device);
  DeviceTensor fo(ref_o, c.device, false), fl(ref_l, c.device, false), fdq(pb.q, c.device, false),
      fdk(pb.k, c.device, false), fdv(pb.v, c.device, false);
  const std::size_t fbytes = flashmonoid::backward_workspace_size(fq.view, fk.view, pb.opt);
  DeviceScratch fws(fbytes);
  Context fctx;
  fctx.stream = stream;
  fctx.workspace = fws.ptr;
  fctx.workspace_bytes = fbytes;
  flashmonoid::forward(fq.view, fk.view, fv.view, fo.view, fl.view, pb.opt, fctx);
  flashmonoid::backward(fdout.view, fq.view, fk.view, fv.view, fro.view, frl.view, fdq.view, fdk.view, fdv.view,
                        pb.opt, fctx);
  CUDA_OK(cudaStreamSynchronize(stream));
  const HostTensor single_o = fo.back(), single_dk = fdk.back();
  expect_close("single-GPU out", s.dtype, single_o.values(), ref_o.values(), lp_o.values());
  expect_close("single-GPU dk", s.dtype, single_dk.values(), ref.dk.values(), lp.dk.values());
  std::printf("[rank %d] %s: max |ring - single GPU| out %.3g dk %.3g\n", c.rank, gc.shape.str().c_str(),
              max_abs_diff(with_rows(single_o, o.back(), segs, false), single_o.values()),
              max_abs_diff(with_rows(single_dk, dk.back(), segs, false), single_dk.values()));
  CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Gpu, RingNccl, ::testing::ValuesIn(cases()));

}  // namespace
}  // namespace fmtest
