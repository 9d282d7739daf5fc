// The CUDA backward against the float64 reference, every test once per kernel family (sm80, and
// sm90 where the device and the shape allow it: the same rule as bwd_sm90_eligible), forced
// through Context::cuda_path. out and lse fed to the backward come from cpu::reference_forward, so
// that the test does not depend on the forward kernels. The FlashAttention rule
// decides: the GPU's max error against float64 must be at most 2x that of the same math done in
// the input dtype (cpu::reference_backward with Precision::input) on the same inputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "flashmonoid/attention.hpp"
#include "cuda/sm80/bwd_sm80.hpp"
#include "sm90/tile_bwd_sm90.hpp"

namespace {

using flashmonoid::DType;
using flashmonoid::TensorView;
using flashmonoid::cpu::Precision;
using fmtest::HostTensor;
using fmtest::shape_of;
using fmtest::Problem;
using fmtest::Shape;

#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A device copy of a host tensor, byte for byte (padding included), with the view retargeted.
struct DeviceTensor {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  TensorView view;
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h, bool copy = true) : bytes(h.buf.size()), view(h.view) {
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    if (copy) cudaMemcpy(ptr, h.buf.data(), bytes, cudaMemcpyHostToDevice);
    else cudaMemset(ptr, 0xFF, bytes);  // poison: 0xFFFF is NaN in fp16 and bf16
    view.data = ptr;
    view.device = flashmonoid::Device::cuda(0);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(ptr); }
  void poison() { cudaMemset(ptr, 0xFF, bytes); }
  void copy_to(HostTensor& h) const { cudaMemcpy(h.buf.data(), ptr, bytes, cudaMemcpyDeviceToHost); }
};

template <class T>
void launch_bucket(const flashmonoid::detail::BwdParams& p, const flashmonoid::cuda::BwdLaunch& l) {
  if (p.d <= 64) flashmonoid::cuda::run_bwd_sm80<T, 64>(p, l);
  else if (p.d <= 128) flashmonoid::cuda::run_bwd_sm80<T, 128>(p, l);
  else flashmonoid::cuda::run_bwd_sm80<T, 256>(p, l);
}

void launch_sm80(const flashmonoid::detail::BwdParams& p, void* ws, std::size_t ws_bytes) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const flashmonoid::cuda::BwdLaunch l{nullptr, ws, ws_bytes, sms};
  if (p.dtype == DType::bf16) launch_bucket<__nv_bfloat16>(p, l);
  else launch_bucket<__half>(p, l);
}

// Everything of one backward call on the GPU: inputs copied from the problem, outputs poisoned.
struct GpuCase {
  std::pair<HostTensor, HostTensor> fwd;  // out, lse of the float64 reference forward
  HostTensor& out;
  HostTensor& lse;
  DeviceTensor q, k, v, dout, o, l;
  std::unique_ptr<DeviceTensor> alibi, cu_q, cu_k, used_q, used_k;
  HostTensor dq_h, dk_h, dv_h;
  DeviceTensor dq, dk, dv;
  flashmonoid::Options opt;
  flashmonoid::Varlen vl{};
  bool varlen = false;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;
  flashmonoid::Context sched;  // the scheduling fields under test (sm_margin, persistent_kernels)

  GpuCase(const Problem& problem, bool deterministic)
      : fwd(problem.reference(Precision::f64)),
        out(fwd.first),
        lse(fwd.second),
        q(problem.q), k(problem.k), v(problem.v), dout(problem.dout), o(out), l(lse),
        dq_h(problem.new_out()), dk_h(problem.new_like_kv()), dv_h(problem.new_like_kv()),
        dq(dq_h, false), dk(dk_h, false), dv(dv_h, false) {
    opt = problem.opt;
    opt.deterministic = deterministic;
    varlen = problem.shape.varlen;
    if (problem.shape.alibi) {
      alibi = std::make_unique<DeviceTensor>(problem.alibi);
      opt.alibi_slopes = alibi->view;
    }
    if (problem.shape.varlen) {
      cu_q = std::make_unique<DeviceTensor>(problem.cu_q);
      cu_k = std::make_unique<DeviceTensor>(problem.cu_k);
      vl = flashmonoid::Varlen{cu_q->view, cu_k->view, problem.vl.max_seqlen_q, problem.vl.max_seqlen_k};
      if (!problem.shape.used_q.empty()) {
        used_q = std::make_unique<DeviceTensor>(problem.seqused_q);
        vl.seqused_q = used_q->view;
      }
      if (!problem.shape.used_k.empty()) {
        used_k = std::make_unique<DeviceTensor>(problem.seqused_k);
        vl.seqused_k = used_k->view;
      }
    }
    ws_bytes = flashmonoid::backward_workspace_size(q.view, k.view, opt, varlen ? &vl : nullptr);
    cudaMalloc(&ws, ws_bytes > 0 ? ws_bytes : 1);
  }
  ~GpuCase() { cudaFree(ws); }

  // Poisons outputs and workspace, runs on the kernel family `path`, copies the gradients back.
  void run(flashmonoid::CudaPath path) {
    dq.poison();
    dk.poison();
    dv.poison();
    cudaMemset(ws, 0xFF, ws_bytes);
    flashmonoid::Context ctx = sched;
    ctx.workspace = ws;
    ctx.workspace_bytes = ws_bytes;
    ctx.cuda_path = path;
    if (varlen)
      flashmonoid::backward_varlen(dout.view, q.view, k.view, v.view, vl, o.view, l.view, dq.view, dk.view, dv.view,
                                   opt, ctx);
    else
      flashmonoid::backward(dout.view, q.view, k.view, v.view, o.view, l.view, dq.view, dk.view, dv.view, opt, ctx);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
    dq.copy_to(dq_h);
    dk.copy_to(dk_h);
    dv.copy_to(dv_h);
  }
};

bool hopper() {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major == 9;
}

// Whether the sm90 backward takes s (src/cuda/sm90/bwd_sm90.hpp's rule), so that a forced sm90 run
// is attempted exactly where it must not throw.
bool sm90_takes(const Shape& s, bool deterministic = false) {
  const bool mods = s.softcap > 0.0f || s.alibi || s.dropout_p > 0.0f;
  return s.d <= (deterministic ? 128 : 256) && !(mods && s.d <= 64);
}

class CudaBackward : public ::testing::TestWithParam<flashmonoid::CudaPath> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
    if (GetParam() == flashmonoid::CudaPath::sm90 && !hopper()) GTEST_SKIP() << "the sm90 backward needs a 9.x device";
  }
  // A test of the sm90 family that checked no shape could not fail: each one must check some (the
  // tests whose shapes sm90 never takes skip themselves).
  void TearDown() override {
    if (GetParam() == flashmonoid::CudaPath::sm90 && !IsSkipped() && !HasFailure())
      EXPECT_GT(ran_, 0) << "no shape of this test ran on the sm90 backward";
  }
  // Runs shape on this test's kernel family (skipped on sm90 where that family does not take it).
  void check_backward(const Shape& shape);
  // Runs shape deterministically `runs` times: every run bit-identical to the first, and the first
  // within the accuracy rule (skipped on sm90 where its deterministic backward does not take it).
  void check_deterministic(const Shape& shape, int runs);
  int ran_ = 0;
};

void CudaBackward::check_deterministic(const Shape& s, int runs) {
  if (GetParam() == flashmonoid::CudaPath::sm90 && !sm90_takes(s, true)) return;
  ++ran_;
  SCOPED_TRACE(s.str() + " deterministic");
  const Problem pb(s);
  GpuCase g(pb, true);
  g.run(GetParam());
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<std::uint8_t> dq0 = g.dq_h.buf, dk0 = g.dk_h.buf, dv0 = g.dv_h.buf;
  int mismatches = 0;
  for (int rep = 1; rep < runs; ++rep) {
    g.run(GetParam());
    if (::testing::Test::HasFatalFailure()) return;
    mismatches += g.dq_h.buf != dq0 || g.dk_h.buf != dk0 || g.dv_h.buf != dv0;
  }
  EXPECT_EQ(mismatches, 0) << "of " << runs - 1 << " repeated deterministic runs differed from the first";
  fmtest::expect_grads_meet_rule(pb, g.out, g.lse, g.dq_h, g.dk_h, g.dv_h);
}

void CudaBackward::check_backward(const Shape& shape) {
  SCOPED_TRACE(shape.str());
  const flashmonoid::CudaPath path = GetParam();
  if (path == flashmonoid::CudaPath::sm90 && !sm90_takes(shape)) return;
  ++ran_;
  const Problem pb(shape);
  GpuCase g(pb, false);
  g.run(path);
  if (::testing::Test::HasFatalFailure()) return;

  fmtest::expect_grads_meet_rule(pb, g.out, g.lse, g.dq_h, g.dk_h, g.dv_h);
}

TEST_P(CudaBackward, HeadDimsAndDtypes) {
  for (DType t : {DType::bf16, DType::f16})
    for (int d : {32, 40, 64, 96, 128, 160, 256}) check_backward(shape_of(t, 2, 77, 131, 2, 2, d));
}

TEST_P(CudaBackward, SeqlensBothWays) {
  for (auto [sq, sk] : {std::pair{1, 1}, {1, 200}, {200, 1}, {63, 65}, {129, 257}, {300, 45}, {45, 300}})
    check_backward(shape_of(DType::bf16, 2, sq, sk, 2, 1, 64));
}

TEST_P(CudaBackward, CausalAndWindows) {
  for (auto [sq, sk] : {std::pair{113, 113}, {70, 190}, {190, 70}}) {
    for (int d : {64, 128}) {
      Shape s = shape_of(DType::bf16, 2, sq, sk, 4, 2, d);
      s.causal = true;
      s.window_right = 0;
      check_backward(s);
      s.causal = false;
      s.window_left = 17;
      s.window_right = 5;
      check_backward(s);
      s.window_left = 40;
      s.window_right = -1;
      check_backward(s);
    }
  }
}

TEST_P(CudaBackward, GqaMqa) {
  check_backward(shape_of(DType::bf16, 1, 150, 150, 8, 2, 128));
  check_backward(shape_of(DType::f16, 2, 97, 211, 6, 1, 64));
  Shape s = shape_of(DType::bf16, 1, 130, 170, 4, 1, 256);
  s.causal = true;
  s.window_right = 0;
  check_backward(s);
}

TEST_P(CudaBackward, SoftcapAlibi) {
  for (int d : {64, 96, 128, 256}) {
    Shape s = shape_of(DType::bf16, 2, 99, 140, 4, 2, d);
    s.softcap = 5.0f;
    check_backward(s);
    s.softcap = 0.0f;
    s.alibi = true;
    s.causal = true;
    s.window_right = 0;
    check_backward(s);
  }
  // Several key and query blocks, a window, GQA, all modifiers at once (fp16).
  for (int d : {128, 256}) {
    Shape s = shape_of(DType::f16, 1, 333, 410, 4, 2, d);
    s.softcap = 8.0f;
    s.alibi = true;
    s.window_left = 150;
    s.window_right = 20;
    s.dropout_p = 0.1f;
    check_backward(s);
  }
}

TEST_P(CudaBackward, Dropout) {
  for (int d : {64, 128, 256}) {
    Shape s = shape_of(DType::bf16, 2, 131, 97, 4, 2, d);
    s.dropout_p = 0.17f;
    check_backward(s);
    s.causal = true;
    s.window_right = 0;
    s.softcap = 3.0f;
    check_backward(s);
  }
}

TEST_P(CudaBackward, Varlen) {
  for (int d : {64, 128, 256}) {
    Shape s = shape_of(DType::bf16, 4, 0, 0, 4, 2, d);
    s.varlen = true;
    s.lens_q = {1, 130, 64, 77};
    s.lens_k = {33, 100, 0, 200};
    s.s_q = 130;
    s.s_k = 200;
    check_backward(s);
    s.causal = true;
    s.window_right = 0;
    s.dropout_p = 0.1f;
    check_backward(s);
  }
}

// Used lengths (Varlen::seqused_q / seqused_k): padded slots run in place, a slot's rows past its used
// ones keep their poison (expect_grads_meet_rule), an entry without used queries and one without used
// keys among them; the sm90 producer skips the key blocks past the used keys as its consumers do.
TEST_P(CudaBackward, UsedLengths) {
  for (int d : {64, 128}) {
    Shape s = shape_of(DType::bf16, 3, 0, 0, 4, 2, d);
    s.varlen = true;
    s.lens_q = {200, 64, 150};
    s.lens_k = {200, 64, 150};
    s.used_q = {130, 0, 150};
    s.used_k = {177, 9, 0};
    s.s_q = 150;
    s.s_k = 177;
    check_backward(s);
    s.causal = true;
    s.window_right = 0;
    s.dropout_p = 0.1f;
    check_backward(s);
  }
}

// Keys without queries (dK = dV = 0) and queries without keys (dQ = 0): calls with no query row, no
// key row or no batch entry at all (the kernels' grids are sized by both: the API zeroes the
// gradients itself), and varlen sequences without queries beside ones with.
TEST_P(CudaBackward, KeysWithoutQueriesAndQueriesWithoutKeys) {
  for (DType t : {DType::bf16, DType::f16}) {
    check_backward(shape_of(t, 2, 0, 130, 4, 2, 64));
    check_backward(shape_of(t, 2, 70, 0, 4, 2, 128));
    check_backward(shape_of(t, 0, 33, 47, 4, 2, 64));  // no batch entry
    Shape s = shape_of(t, 3, 0, 0, 4, 2, 128);
    s.varlen = true;
    s.lens_q = {0, 0, 0};
    s.lens_k = {5, 0, 64};
    s.s_k = 64;
    check_backward(s);
    s.lens_q = {1, 0, 70};
    s.lens_k = {33, 100, 5};
    s.s_q = 70;
    s.s_k = 100;
    s.causal = t == DType::f16;
    check_backward(s);
  }
}

// Several key blocks (64, 128) and query blocks (64, 128) per sequence: the sm90 ring wraps, causal
// blocks start at different query blocks, GQA groups of 4 walk 4 heads per key block.
TEST_P(CudaBackward, LongerSequences) {
  for (int d : {64, 128, 256}) {
    Shape s = shape_of(DType::bf16, 2, 700, 700, 8, 2, d);
    s.causal = true;
    s.window_right = 0;
    check_backward(s);
    Shape w = shape_of(DType::f16, 1, 513, 900, 4, 4, d);
    w.window_left = 200;
    w.window_right = 31;
    check_backward(w);
    check_backward(shape_of(DType::bf16, 1, 1000, 385, 4, 1, d));
  }
}

TEST_P(CudaBackward, Randomized) {
  std::mt19937 r(20240611u);
  auto pick = [&](std::initializer_list<int> xs) { return *(xs.begin() + r() % xs.size()); };
  for (int n = 0; n < 12; ++n) {
    const int hk = pick({1, 2, 3});
    Shape s = shape_of(r() % 2 ? DType::bf16 : DType::f16, pick({1, 2, 3}), 1 + r() % 300, 1 + r() % 300,
                   hk * pick({1, 2, 4}), hk, 8 * (1 + r() % 32));
    if (r() % 3 == 0) {
      s.causal = true;
      s.window_right = 0;
    } else if (r() % 3 == 0) {
      s.window_left = static_cast<int>(r() % 64);
      s.window_right = static_cast<int>(r() % 64);
    }
    if (r() % 4 == 0) s.softcap = 4.0f;
    if (r() % 4 == 0) s.alibi = true;
    if (r() % 4 == 0) s.dropout_p = 0.2f;
    check_backward(s);
  }
}

// 50 deterministic runs are bit-identical (no float atomics: dQ added in key-block order), and
// the deterministic result also passes the accuracy rule.
// On sm90 the key blocks wait for each other per query block (semaphores): a sliding window makes
// the first key block that a query block sees differ from 0, and 700 keys make 6 key blocks.
TEST_P(CudaBackward, DeterministicBitIdentical) {
  for (int d : {64, 128, 256, 96}) {
    Shape s = shape_of(DType::bf16, 2, d == 96 ? 650 : 400, d == 96 ? 700 : 350, 4, 2, d);
    s.causal = d == 128;
    if (s.causal) s.window_right = 0;
    if (d == 96) {
      s.window_left = 200;
      s.window_right = 30;
    }
    check_deterministic(s, 50);
  }
}

// Under a causal mask at hdim >= 128 the sm90 backward runs its blocks key block major within groups
// of batch·KV heads whose Q, dO and fp32 dQ rows fill 16 MB (launch_bwd_sm90.cuh: bwd_group_heads).
// 512 query rows, 4 query heads per KV head: 2 MB per KV head at hdim 128, 4 MB at hdim 256, so
// 10 batch·KV heads run as groups of 8 + 2 and 4 + 4 + 2: several groups and a smaller last one
// (the other tests' shapes make one group), by default and deterministically (whose dQ turns rely on
// each head's key blocks starting in order). The grouping is sm90's; sm80 runs the shapes too.
TEST_P(CudaBackward, GroupedBlockOrder) {
  for (int d : {128, 256}) {
    Shape s = shape_of(DType::bf16, 2, 512, 512, 20, 5, d);
    s.causal = true;
    s.window_right = 0;
    check_backward(s);
    if (d == 128) check_deterministic(s, 10);
  }
}

// The sm90 backward's persistent blocks walk many work items each when FLASHMONOID_SM90_BWD_BLOCKS
// caps them at 3 (the other tests' shapes give most blocks a single item): the Q/dO ring, the score
// buffers' parity and the K/V hand-over run on across items, under causal masks and GQA, with varlen
// items that have no keys (skipped), dropout and score modifiers, and in the deterministic order.
TEST_P(CudaBackward, PersistentBlocksWalkManyItems) {
  if (GetParam() != flashmonoid::CudaPath::sm90) GTEST_SKIP() << "the sm80 backward is not persistent";
  struct BlocksCap {
    BlocksCap() { setenv("FLASHMONOID_SM90_BWD_BLOCKS", "0", 1); }
    ~BlocksCap() { unsetenv("FLASHMONOID_SM90_BWD_BLOCKS"); }
  } cap;
  {  // The cap is read on this path: a value that is not a positive count is refused by name.
    const Problem pb(shape_of(DType::bf16, 1, 64, 64, 2, 2, 64));
    GpuCase g(pb, false);
    try {
      g.run(GetParam());
      ADD_FAILURE() << "FLASHMONOID_SM90_BWD_BLOCKS=0 was accepted";
    } catch (const flashmonoid::Error& e) {
      EXPECT_EQ(e.argument(), "FLASHMONOID_SM90_BWD_BLOCKS") << e.what();
    }
  }
  setenv("FLASHMONOID_SM90_BWD_BLOCKS", "3", 1);
  for (int d : {64, 128, 256}) {
    Shape s = shape_of(DType::bf16, 2, 200, 333, 4, 2, d);
    s.causal = true;
    s.window_right = 0;
    check_backward(s);
    Shape v = shape_of(DType::f16, 5, 0, 0, 4, 2, d);
    v.varlen = true;
    v.lens_q = {70, 1, 150, 64, 9};
    v.lens_k = {300, 0, 20, 129, 1};
    v.s_q = 150;
    v.s_k = 300;
    v.window_left = 90;
    v.window_right = 10;
    v.dropout_p = 0.1f;
    v.softcap = 6.0f;
    check_backward(v);
  }
  Shape det = shape_of(DType::bf16, 2, 300, 350, 4, 2, 128);
  det.causal = true;
  det.window_right = 0;
  check_deterministic(det, 5);
}

// The sm90 backward's grid: persistent (one block per SM, less ctx.sm_margin) or one block per work
// item (ctx.persistent_kernels = false, as the ring runs it beside an exchange). Every block takes
// its items from the same counter in the same order, so the deterministic backward gives the same
// bits on every grid, and the default one meets the rule on each. The shape has more work items
// (key blocks of the sm90 tile x batch x KV heads) than the device has SMs, so that the three grids
// differ: one block per item, one per SM, and 7 blocks (the margin leaves 7 SMs) that walk ~20 items
// each.
TEST_P(CudaBackward, PersistentPerItemAndMarginGiveTheSameBits) {
  if (GetParam() != flashmonoid::CudaPath::sm90) GTEST_SKIP() << "the sm80 backward is one block per item anyway";
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (int d : {64, 128}) {
    Shape s = shape_of(DType::bf16, 2, 300, 1100, 16, 8, d);
    s.causal = d == 64;
    if (s.causal) s.window_right = 0;
    SCOPED_TRACE(s.str());
    const int block_n = flashmonoid::cuda::bwd_tile_sm90(d).block_n;
    const int items = (s.s_k + block_n - 1) / block_n * s.b * s.h_k;
    ASSERT_GT(items, sms) << "the shape must give the per-item grid more blocks than the persistent one";
    ++ran_;
    const Problem pb(s);
    flashmonoid::Context per_item, margin;
    per_item.persistent_kernels = false;
    margin.sm_margin = sms - 7;
    GpuCase base(pb, true);
    base.run(GetParam());
    if (::testing::Test::HasFatalFailure()) return;
    fmtest::expect_grads_meet_rule(pb, base.out, base.lse, base.dq_h, base.dk_h, base.dv_h);
    for (const flashmonoid::Context& sched : {per_item, margin}) {
      GpuCase det(pb, true);
      det.sched = sched;
      det.run(GetParam());
      if (::testing::Test::HasFatalFailure()) return;
      EXPECT_TRUE(det.dq_h.buf == base.dq_h.buf && det.dk_h.buf == base.dk_h.buf && det.dv_h.buf == base.dv_h.buf)
          << "deterministic gradients differ with persistent_kernels " << sched.persistent_kernels << ", sm_margin "
          << sched.sm_margin;
      GpuCase g(pb, false);
      g.sched = sched;
      g.run(GetParam());
      if (::testing::Test::HasFatalFailure()) return;
      fmtest::expect_grads_meet_rule(pb, g.out, g.lse, g.dq_h, g.dk_h, g.dv_h);
    }
  }
}

// Timing, off by default (--gtest_also_run_disabled_tests): bf16, 16k tokens, hidden 2048,
// backward FLOPs = 2.5 · 4·b·h·s²·d (halved when causal), median of 20 runs after 3 warm-ups.
TEST(CudaBackwardSm80, DISABLED_Timing) {
  for (int d : {64, 128, 256})
  for (int seqlen : {4096, 16384})
    for (bool causal : {false, true})
      for (bool det : {false, true}) {
        if (det && d != 128) continue;
        const int b = 16384 / seqlen, h = 2048 / d;
        flashmonoid::detail::BwdParams p;
        p.dtype = DType::bf16;
        p.batch = b;
        p.h = p.h_k = h;
        p.d = d;
        p.seqlen_q = p.seqlen_k = seqlen;
        p.total_q = p.total_k = static_cast<std::int64_t>(b) * seqlen;
        p.scale = 1.0f / std::sqrt(static_cast<float>(d));
        p.scale_log2 = p.scale * 1.4426950408889634f;
        p.causal = causal;
        p.window_right = causal ? 0 : -1;
        p.deterministic = det;
        const flashmonoid::detail::Strides st{static_cast<std::int64_t>(seqlen) * h * d, h * d, d};
        p.q_stride = p.k_stride = p.v_stride = p.o_stride = st;
        p.do_stride = p.dq_stride = p.dk_stride = p.dv_stride = st;
        const std::size_t elems = static_cast<std::size_t>(b) * seqlen * h * d;
        std::vector<std::uint16_t> host(elems);
        std::mt19937 r(1);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (auto& x : host) x = flashmonoid::cpu::float_to_bf16(nd(r));
        void* bufs[8];
        for (void*& ptr : bufs) {
          CHECK_CUDA(cudaMalloc(&ptr, elems * 2));
          CHECK_CUDA(cudaMemcpy(ptr, host.data(), elems * 2, cudaMemcpyHostToDevice));
        }
        p.q = bufs[0];
        p.k = bufs[1];
        p.v = bufs[2];
        p.out = bufs[3];
        p.dout = bufs[4];
        p.dq = bufs[5];
        p.dk = bufs[6];
        p.dv = bufs[7];
        float* lse = nullptr;
        CHECK_CUDA(cudaMalloc(&lse, p.total_q * h * sizeof(float)));
        std::vector<float> lse_h(p.total_q * h, std::log(static_cast<float>(seqlen)) + 2.0f);
        CHECK_CUDA(cudaMemcpy(lse, lse_h.data(), lse_h.size() * 4, cudaMemcpyHostToDevice));
        p.lse = lse;
        p.device = flashmonoid::Device::cuda(0);
        const std::size_t ws_bytes = flashmonoid::cuda::bwd_workspace_bytes(p);
        void* ws = nullptr;
        CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        std::vector<float> ms;
        for (int rep = 0; rep < 23; ++rep) {
          cudaEventRecord(e0);
          launch_sm80(p, ws, ws_bytes);
          cudaEventRecord(e1);
          CHECK_CUDA(cudaEventSynchronize(e1));
          float t = 0;
          cudaEventElapsedTime(&t, e0, e1);
          if (rep >= 3) ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        const double med = ms[ms.size() / 2];
        const double flops = 2.5 * 4.0 * b * h * static_cast<double>(seqlen) * seqlen * d * (causal ? 0.5 : 1.0);
        std::printf("flashmonoid bwd bf16 hdim %d seqlen %d batch %d heads %d causal %d deterministic %d: %.3f ms, %.1f TFLOP/s\n",
                    d, seqlen, b, h, causal, det, med, flops / med * 1e-9);
        for (void* ptr : bufs) cudaFree(ptr);
        cudaFree(lse);
        cudaFree(ws);
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
      }
}

INSTANTIATE_TEST_SUITE_P(Path, CudaBackward, ::testing::Values(flashmonoid::CudaPath::sm80, flashmonoid::CudaPath::sm90),
                         [](const auto& info) { return info.param == flashmonoid::CudaPath::sm80 ? "sm80" : "sm90"; });

}  // namespace
