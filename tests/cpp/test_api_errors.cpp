// Every rule of the public API has a test that checks the error names the argument and the rule.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "attention_case.hpp"

namespace fmtest {
namespace {

using flashmonoid::Error;
using flashmonoid::TensorView;

struct Call {
  Shape s;
  Problem pb;
  HostTensor out, lse;
  Call() : s(make_shape()), pb(s), out(pb.new_out()), lse(pb.new_lse()) {}
  static Shape make_shape() {
    Shape s;
    s.b = 2;
    s.s_q = 5;
    s.s_k = 7;
    s.h = 4;
    s.h_k = 2;
    s.d = 16;
    return s;
  }
  void run(TensorView q, TensorView k, TensorView v, TensorView o, TensorView l) const {
    flashmonoid::forward(q, k, v, o, l, pb.opt);
  }
  void run() const { run(pb.q.view, pb.k.view, pb.v.view, out.view, lse.view); }
};

TEST(ApiErrors, DtypeMismatch) {
  Call c;
  HostTensor k16(DType::f16, {2, 7, 2, 16});
  expect_error([&] { c.run(c.pb.q.view, k16.view, c.pb.v.view, c.out.view, c.lse.view); }, "k", "dtype fp16 differs from q's fp32");
  HostTensor lse16(DType::f16, {2, 4, 5});
  expect_error([&] { c.run(c.pb.q.view, c.pb.k.view, c.pb.v.view, c.out.view, lse16.view); }, "lse", "dtype must be fp32");
  HostTensor qi(DType::i32, {2, 5, 4, 16});
  expect_error([&] { c.run(qi.view, c.pb.k.view, c.pb.v.view, c.out.view, c.lse.view); }, "q", "dtype must be fp32, fp16 or bf16");
}

TEST(ApiErrors, ShapeMismatch) {
  Call c;
  HostTensor v(DType::f32, {2, 6, 2, 16});
  expect_error([&] { c.run(c.pb.q.view, c.pb.k.view, v.view, c.out.view, c.lse.view); }, "v", "must be (2, 7, 2, 16)");
  HostTensor o(DType::f32, {2, 5, 4, 8});
  expect_error([&] { c.run(c.pb.q.view, c.pb.k.view, c.pb.v.view, o.view, c.lse.view); }, "out", "the shape of q");
  HostTensor l(DType::f32, {2, 5, 4});
  expect_error([&] { c.run(c.pb.q.view, c.pb.k.view, c.pb.v.view, c.out.view, l.view); }, "lse", "(b, h, s_q)");
  HostTensor q3(DType::f32, {2, 5, 64});
  expect_error([&] { c.run(q3.view, c.pb.k.view, c.pb.v.view, c.out.view, c.lse.view); }, "q", "expected 4 dimensions");
}

TEST(ApiErrors, HeadsNotDivisible) {
  Call c;
  HostTensor k(DType::f32, {2, 7, 3, 16}), v(DType::f32, {2, 7, 3, 16});
  expect_error([&] { c.run(c.pb.q.view, k.view, v.view, c.out.view, c.lse.view); }, "k", "must be a multiple of the number of KV heads");
}

TEST(ApiErrors, HeadDimOutOfRange) {
  Call c;
  HostTensor q(DType::f32, {1, 2, 1, 300}), k(DType::f32, {1, 2, 1, 300}), o(DType::f32, {1, 2, 1, 300}), l(DType::f32, {1, 1, 2});
  expect_error([&] { c.run(q.view, k.view, k.view, o.view, l.view); }, "q", "outside the supported range [1, 256]");
}

TEST(ApiErrors, NonContiguousLastDim) {
  Call c;
  TensorView q = c.pb.q.view;
  q.shape[3] = 8;
  q.stride[3] = 2;
  TensorView o = c.out.view;
  o.shape[3] = 8;
  HostTensor k(DType::f32, {2, 7, 2, 8});
  expect_error([&] { c.run(q, k.view, k.view, o, c.lse.view); }, "q", "last dimension must be contiguous");
}

TEST(ApiErrors, CuSeqlens) {
  Shape s;
  s.varlen = true;
  s.b = 3;
  s.lens_q = {2, 3, 4};
  s.lens_k = {2, 3, 4};
  s.h = 2;
  s.h_k = 2;
  s.d = 8;
  Problem pb(s);
  HostTensor o = pb.new_out(), l = pb.new_lse();
  auto run = [&] { flashmonoid::forward_varlen(pb.q.view, pb.k.view, pb.v.view, pb.vl, o.view, l.view, pb.opt); };
  int* cq = pb.cu_q.view.ptr<int>();
  cq[2] = 1;  // 0, 2, 1, 9
  expect_error(run, "cu_seqlens_q", "must be non-decreasing");
  cq[2] = 6;
  cq[3] = 10;  // lengths 2, 4, 4 but only 9 packed rows
  expect_error(run, "cu_seqlens_q", "past the packed tensor");
  cq[2] = 5;
  cq[3] = 9;
  pb.vl.max_seqlen_k = 3;
  expect_error(run, "cu_seqlens_k", "> max_seqlen_k = 3");
  pb.vl.max_seqlen_k = 4;
  HostTensor cu64(DType::f32, {4});
  pb.vl.cu_seqlens_k = cu64.view;
  expect_error(run, "cu_seqlens_k", "dtype must be int32");
}

TEST(ApiErrors, SeqUsed) {
  Shape s;
  s.varlen = true;
  s.b = 3;
  s.lens_q = {2, 3, 4};
  s.lens_k = {2, 3, 4};
  s.h = 2;
  s.h_k = 2;
  s.d = 8;
  Problem pb(s);
  HostTensor o = pb.new_out(), l = pb.new_lse();
  auto run = [&] { flashmonoid::forward_varlen(pb.q.view, pb.k.view, pb.v.view, pb.vl, o.view, l.view, pb.opt); };
  HostTensor used(DType::i32, {3});
  int* u = used.view.ptr<int>();
  u[0] = 1, u[1] = 3, u[2] = 2;
  pb.vl.seqused_k = used.view;
  run();  // valid: slots of 2, 3, 4 keys, 1, 3, 2 of them used
  u[1] = 4;
  expect_error(run, "seqused_k", "entry 1 (4) must lie in [0, 3], the rows of its slot in cu_seqlens_k");
  u[1] = -1;
  expect_error(run, "seqused_k", "must lie in [0, 3]");
  u[1] = 3;
  pb.vl.max_seqlen_k = 2;  // bounds the used lengths, not the slots
  expect_error(run, "seqused_k", "entry 1 (3) > max_seqlen_k = 2");
  pb.vl.max_seqlen_k = 3;
  run();  // the slot of 4 keys exceeds max_seqlen_k: allowed with used lengths
  HostTensor two(DType::i32, {2});
  pb.vl.seqused_q = two.view;
  expect_error(run, "seqused_q", "must be (b) = (3), one entry per sequence");
  HostTensor f(DType::f32, {3});
  pb.vl.seqused_q = f.view;
  expect_error(run, "seqused_q", "dtype must be int32");
  pb.vl.seqused_q = used.view;
  HostTensor table(DType::i32, {3, 1});
  pb.vl.block_table = table.view;  // seqused_k may count a paged call's keys (test_kvcache.cpp), not seqused_q
  expect_error(run, "seqused_q", "with a block_table cu_seqlens_q gives each sequence's query rows");
}

TEST(ApiErrors, MixedDevices) {
  Call c;
  TensorView k = c.pb.k.view;
  k.device = flashmonoid::Device::cuda(0);
  expect_error([&] { c.run(c.pb.q.view, k, c.pb.v.view, c.out.view, c.lse.view); }, "k", "all tensors must share a device");
}

// A view without elements has nothing to lay out: any strides pass the layout rules, as PyTorch's
// empty tensors carry strides computed as if the empty dimension were 1 (lse (2, 4, 0): strides
// (4, 1, 1)) and a sum's gradient is expanded (stride 0). The calls write what they must: dK, dV of
// keys no query sees are 0.
TEST(ApiErrors, EmptyViewsAreContiguous) {
  const flashmonoid::Device cpu{};
  constexpr int kKv = 2 * 3 * 4 * 16;
  std::vector<float> none(1), k(kKv, 0.5f), v(kKv, 0.25f), dk(kKv, NAN), dv(kKv, NAN);
  auto kv_view = [&](std::vector<float>& x) { return TensorView(x.data(), DType::f32, cpu, {2, 3, 4, 16}); };
  const TensorView q(none.data(), DType::f32, cpu, {2, 0, 4, 16}, {256, 64, 16, 1});
  const TensorView lse(none.data(), DType::f32, cpu, {2, 4, 0}, {4, 1, 1});
  const TensorView dout(none.data(), DType::f32, cpu, {2, 0, 4, 16}, {0, 0, 0, 0});
  EXPECT_TRUE(lse.is_contiguous());
  EXPECT_FALSE(TensorView(none.data(), DType::f32, cpu, {2, 4, 3}, {12, 1, 4}).is_contiguous());
  EXPECT_NO_THROW(flashmonoid::forward(q, kv_view(k), kv_view(v), q, lse, flashmonoid::Options{}));
  EXPECT_NO_THROW(flashmonoid::backward(dout, q, kv_view(k), kv_view(v), q, lse, q, kv_view(dk), kv_view(dv),
                                        flashmonoid::Options{}));
  for (int i = 0; i < kKv; ++i) ASSERT_TRUE(dk[i] == 0.0f && dv[i] == 0.0f) << "element " << i;
}

TEST(ApiErrors, NullPointers) {
  Call c;
  TensorView v = c.pb.v.view;
  v.data = nullptr;
  expect_error([&] { c.run(c.pb.q.view, c.pb.k.view, v, c.out.view, c.lse.view); }, "v", "data pointer is null");
}

// The size and support queries validate shapes only: views without data pass every shape rule (no
// invented pointers) and the same shapes with a bad head count still fail.
TEST(ApiErrors, ShapeOnlyValidationForQueries) {
  Call c;
  TensorView q = c.pb.q.view, k = c.pb.k.view, out = c.out.view, lse = c.lse.view;
  q.data = k.data = out.data = lse.data = nullptr;
  const auto p = flashmonoid::detail::make_fwd_params(q, k, k, out, lse, c.pb.opt, nullptr, flashmonoid::detail::Check::shapes);
  EXPECT_EQ(p.h, c.pb.shape.h);
  EXPECT_EQ(p.seqlen_k, c.pb.shape.s_k);
  expect_error([&] { flashmonoid::detail::make_fwd_params(q, k, k, out, lse, c.pb.opt, nullptr); }, "q",
               "data pointer is null");
  TensorView k3 = k;
  k3.shape[2] = 3;
  expect_error([&] { flashmonoid::detail::make_fwd_params(q, k3, k3, out, lse, c.pb.opt, nullptr, flashmonoid::detail::Check::shapes); },
               "k", "multiple of the number of KV heads");
}

TEST(ApiErrors, Options) {
  Call c;
  c.pb.opt.dropout_p = 1.0f;
  expect_error([&] { c.run(); }, "options.dropout_p", "must be in [0, 1)");
  c.pb.opt.dropout_p = -0.1f;
  expect_error([&] { c.run(); }, "options.dropout_p", "must be in [0, 1)");
  c.pb.opt.dropout_p = 0.0f;
  c.pb.opt.window_left = -2;
  expect_error([&] { c.run(); }, "options.window_left", "must be >= -1");
  c.pb.opt.window_left = -1;
  c.pb.opt.window_right = -5;
  expect_error([&] { c.run(); }, "options.window_right", "must be >= -1");
  c.pb.opt.window_right = -1;
  c.pb.opt.softcap = -1.0f;
  expect_error([&] { c.run(); }, "options.softcap", "must be finite and >= 0");
  c.pb.opt.softcap = 0.0f;
  HostTensor slopes(DType::f32, {3});
  c.pb.opt.alibi_slopes = slopes.view;
  expect_error([&] { c.run(); }, "options.alibi_slopes", "must be (h) = (4) or (b, h) = (2, 4)");
}

TEST(ApiErrors, ContextSmMargin) {
  Call c;
  flashmonoid::Context ctx;
  ctx.sm_margin = -1;
  expect_error([&] { flashmonoid::forward(c.pb.q.view, c.pb.k.view, c.pb.v.view, c.out.view, c.lse.view, c.pb.opt, ctx); },
               "ctx.sm_margin", "must be >= 0");
  ctx.sm_margin = 4;  // a margin is a CUDA scheduling hint: the CPU runs the call unchanged
  flashmonoid::forward(c.pb.q.view, c.pb.k.view, c.pb.v.view, c.out.view, c.lse.view, c.pb.opt, ctx);
  const HostTensor ref_out = c.pb.new_out(), ref_lse = c.pb.new_lse();
  flashmonoid::forward(c.pb.q.view, c.pb.k.view, c.pb.v.view, ref_out.view, ref_lse.view, c.pb.opt);
  EXPECT_EQ(c.out.buf, ref_out.buf);
  EXPECT_EQ(c.lse.buf, ref_lse.buf);
}

TEST(ApiErrors, OutputAliasingInput) {
  Call c;
  TensorView o = c.out.view;
  o.data = c.pb.q.view.data;
  expect_error([&] { c.run(c.pb.q.view, c.pb.k.view, c.pb.v.view, o, c.lse.view); }, "out", "overlaps the memory of q");
  // Backward: a gradient on top of an input.
  HostTensor dk = c.pb.new_like_kv(), dv = c.pb.new_like_kv(), dq = c.pb.new_out();
  c.run();
  expect_error(
      [&] {
        flashmonoid::backward(c.pb.dout.view, c.pb.q.view, c.pb.k.view, c.pb.v.view, c.out.view, c.lse.view, dq.view,
                              dk.view, c.pb.v.view, c.pb.opt);
      },
      "dv", "overlaps the memory of v");
}

TEST(ApiErrors, MergeArguments) {
  HostTensor o(DType::f32, {1, 3, 2, 4}), l(DType::f32, {1, 2, 3}), o2(DType::f32, {1, 3, 2, 5}), l2(DType::f32, {1, 2, 3});
  std::vector<TensorView> outs{o2.view}, lses{l2.view};
  expect_error([&] { flashmonoid::merge(outs, lses, o.view, l.view); }, "outs[0]", "must equal out's (1, 3, 2, 4)");
  std::vector<TensorView> none;
  expect_error([&] { flashmonoid::merge(none, none, o.view, l.view); }, "outs", "at least one");
}

TEST(ApiErrors, CudaWithoutBackendIsClear) {
  if (flashmonoid::cuda_available()) GTEST_SKIP() << "a GPU is present; covered by the CUDA tests";
  Call c;
  auto to_cuda = [](TensorView t) {
    t.device = flashmonoid::Device::cuda(0);
    return t;
  };
  try {
    c.run(to_cuda(c.pb.q.view), to_cuda(c.pb.k.view), to_cuda(c.pb.v.view), to_cuda(c.out.view), to_cuda(c.lse.view));
    ADD_FAILURE() << "no error for CUDA tensors without a usable GPU";
  } catch (const flashmonoid::Error& e) {
    EXPECT_FALSE(std::string(e.what()).empty());
  }
}

}  // namespace
}  // namespace fmtest
