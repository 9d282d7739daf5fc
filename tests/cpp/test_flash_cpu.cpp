// CPU flash forward/backward against the float64 reference over a randomized grid of shapes and
// every option; fp32 within 1e-5 relative, fp16/bf16 within 2x the error of the same math done in
// that dtype. Outputs are NaN-poisoned before each call so unwritten elements fail. Each grid runs
// through the public API (the process's ISA: `make test` runs this suite once as detected and once
// with FLASHMONOID_CPU_ISA=avx2) and with the 16-lane (AVX-512) kernels' source emulated on AVX2;
// the forward grid also in bf16 through the bf16-pair products (VDPBF16PS emulated, and the real
// instruction where the CPU has it).
#include <algorithm>
#include <cmath>

#include "attention_case.hpp"

namespace fmtest {
namespace {

using flashmonoid::Context;
using flashmonoid::CpuAlgorithm;
using flashmonoid::cpu::Precision;

// Rotating through features so that every seqlen pair meets several head dims, head layouts and
// masks without a full Cartesian product (which would not fit CI's 2 cores).
std::vector<Shape> forward_grid() {
  const int seqlens[] = {1, 2, 17, 113, 127, 128, 129, 1000};
  const int head_dims[] = {8, 40, 59, 64, 96, 111, 128, 256, 16, 32};
  const int heads[][2] = {{2, 2}, {4, 2}, {3, 1}};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  std::vector<Shape> out;
  int n = 0;
  for (int sq : seqlens) {
    for (int rel = 0; rel < 3; ++rel) {  // s_k < s_q, =, >
      int sk = rel == 0 ? std::max(1, sq / 2 - 1) : rel == 1 ? sq : sq + 37;
      if (sq == 1000) sk = rel == 0 ? 511 : rel == 1 ? 1000 : 1000 + 129;
      Shape s;
      s.b = sq >= 1000 ? 1 : 2;
      s.s_q = sq;
      s.s_k = sk;
      s.d = head_dims[n % 10];
      if (sq >= 1000 && s.d > 128) s.d = 96;
      s.h = heads[n % 3][0];
      s.h_k = heads[n % 3][1];
      s.dtype = dtypes[(n / 2) % 3];
      switch (n % 7) {
        case 0: break;
        case 1: s.causal = true; break;
        case 2: s.window_left = 5; s.window_right = 3; break;
        case 3: s.softcap = 2.5f; s.causal = true; break;
        case 4: s.alibi = true; break;
        case 5: s.dropout_p = 0.17f; break;
        case 6: s.window_left = sq + sk + 10; s.window_right = 0; s.alibi = true; break;  // window wider than the sequence
      }
      out.push_back(s);
      ++n;
    }
  }
  // No keys at all (out = 0, lse = -inf) and no queries, each dtype.
  for (DType t : dtypes)
    for (auto [sq, sk] : {std::pair{130, 0}, std::pair{0, 70}}) out.push_back(shape_of(t, 2, sq, sk, 4, 2, 64));
  // Varlen with empty and length-1 sequences, each dtype, with and without causal.
  for (DType t : dtypes)
    for (int c = 0; c < 2; ++c) {
      Shape s;
      s.varlen = true;
      s.b = 5;
      s.lens_q = {0, 1, 17, 64, 3};
      s.lens_k = {5, 1, 0, 129, 40};
      s.h = 4;
      s.h_k = 2;
      s.d = c ? 40 : 64;
      s.dtype = t;
      s.causal = c == 1;
      s.dropout_p = c ? 0.0f : 0.1f;
      out.push_back(s);
    }
  return out;
}

class FlashForward : public ::testing::TestWithParam<Shape> {};

void expect_forward_close(const Problem& pb, const HostTensor& out, const HostTensor& lse) {
  const Shape& s = pb.shape;
  auto [ref_o, ref_l] = pb.reference(Precision::f64);
  auto [lp_o, lp_l] = pb.reference(Precision::input);
  expect_close("out", s.dtype, out.values(), ref_o.values(), lp_o.values());
  // lse is fp32 for every dtype: its error comes only from fp32 accumulation of exact products.
  const double lse_err = max_abs_diff(lse.values(), ref_l.values());
  EXPECT_LE(lse_err, 1e-5 * std::max(1.0, max_abs(ref_l.values()))) << "lse";
}

TEST_P(FlashForward, MatchesFloat64Reference) {
  Problem pb(GetParam());
  auto [out, lse] = pb.forward(Context{});
  expect_forward_close(pb, out, lse);
}

TEST_P(FlashForward, SixteenLaneKernelsMatchFloat64Reference) {
  Problem pb(GetParam());
  auto [out, lse] = pb.flash(flashmonoid::cpu::kernels_avx512_emulated());
  expect_forward_close(pb, out, lse);
}

// The kernel tables with products from bf16 pairs: the emulated AVX512_BF16 and AMX tables, and the
// real ones where the CPU has them.
std::vector<const flashmonoid::cpu::Kernels*> bf16_tables() {
  namespace cpu = flashmonoid::cpu;
  std::vector<const cpu::Kernels*> t{&cpu::kernels_avx512_bf16_emulated(), &cpu::kernels_amx_emulated()};
  if (cpu::cpu_has(cpu::Isa::avx512_bf16)) t.push_back(&cpu::kernels_avx512_bf16());
  if (cpu::cpu_has(cpu::Isa::amx_bf16)) t.push_back(&cpu::kernels_amx());
  return t;
}

// Every shape of the grid with bf16 inputs, through the products from bf16 pairs.
TEST_P(FlashForward, Bf16ProductsMatchFloat64Reference) {
  Shape s = GetParam();
  s.dtype = DType::bf16;
  Problem pb(s);
  for (const flashmonoid::cpu::Kernels* kn : bf16_tables()) {
    SCOPED_TRACE(flashmonoid::cpu::to_string(kn->isa));
    auto [out, lse] = pb.flash(*kn);
    expect_forward_close(pb, out, lse);
  }
}

std::string name_of(const ::testing::TestParamInfo<Shape>& info) { return "case" + std::to_string(info.index); }

INSTANTIATE_TEST_SUITE_P(Grid, FlashForward, ::testing::ValuesIn(forward_grid()), name_of);

std::vector<Shape> backward_grid() {
  const int seqlens[][2] = {{1, 1}, {17, 17}, {113, 57}, {57, 113}, {128, 128}, {129, 200}, {200, 129}};
  const int head_dims[] = {8, 40, 59, 64, 96, 111, 128, 256};
  const int heads[][2] = {{2, 2}, {4, 2}, {3, 1}};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  std::vector<Shape> out;
  int n = 0;
  for (auto& sl : seqlens)
    for (int f = 0; f < 3; ++f) {
      Shape s;
      s.b = 2;
      s.s_q = sl[0];
      s.s_k = sl[1];
      s.d = head_dims[n % 8];
      s.h = heads[n % 3][0];
      s.h_k = heads[n % 3][1];
      s.dtype = dtypes[(n / 2) % 3];
      switch (n % 6) {
        case 0: break;
        case 1: s.causal = true; break;
        case 2: s.window_left = 7; s.window_right = 2; break;
        case 3: s.softcap = 3.0f; s.alibi = true; break;
        case 4: s.dropout_p = 0.2f; s.causal = true; break;
        case 5: s.alibi = true; s.window_left = 300; s.window_right = 300; break;
      }
      out.push_back(s);
      ++n;
    }
  // No queries (dK, dV all zero, no dQ partials to size) and no keys (dQ zero), every dtype; varlen
  // without any query row.
  for (DType t : dtypes) {
    for (auto [sq, sk] : {std::pair{0, 130}, std::pair{70, 0}}) {
      Shape s = shape_of(t, 2, sq, sk, 4, 2, 64);
      s.causal = t == DType::bf16;
      out.push_back(s);
    }
    out.push_back(shape_of(t, 0, 70, 130, 4, 2, 64));  // no batch entry
    Shape s = shape_of(t, 3, 0, 64, 4, 2, 40);
    s.varlen = true;
    s.lens_q = {0, 0, 0};
    s.lens_k = {5, 0, 64};
    out.push_back(s);
  }
  for (DType t : dtypes) {
    Shape s;
    s.varlen = true;
    s.b = 4;
    s.lens_q = {0, 1, 33, 70};
    s.lens_k = {3, 1, 0, 90};
    s.h = 4;
    s.h_k = 1;
    s.d = 32;
    s.dtype = t;
    s.causal = true;
    out.push_back(s);
  }
  return out;
}

class FlashBackward : public ::testing::TestWithParam<Shape> {};

void expect_backward_close(const Problem& pb, const HostTensor& ref_o, const HostTensor& ref_l,
                           const Problem::Grads& g) {
  const Shape& s = pb.shape;
  auto ref = pb.reference_backward(ref_o, ref_l, Precision::f64);
  auto lp = pb.reference_backward(ref_o, ref_l, Precision::input);
  expect_close("dq", s.dtype, g.dq.values(), ref.dq.values(), lp.dq.values());
  expect_close("dk", s.dtype, g.dk.values(), ref.dk.values(), lp.dk.values());
  expect_close("dv", s.dtype, g.dv.values(), ref.dv.values(), lp.dv.values());
}

TEST_P(FlashBackward, MatchesFloat64ReferenceBackward) {
  Problem pb(GetParam());
  auto [ref_o, ref_l] = pb.reference(Precision::f64);
  expect_backward_close(pb, ref_o, ref_l, pb.backward(ref_o, ref_l, Context{}));
}

TEST_P(FlashBackward, SixteenLaneKernelsMatchFloat64Reference) {
  Problem pb(GetParam());
  auto [ref_o, ref_l] = pb.reference(Precision::f64);
  expect_backward_close(pb, ref_o, ref_l, pb.flash_backward(ref_o, ref_l, flashmonoid::cpu::kernels_avx512_emulated()));
}

// Every shape of the backward grid with bf16 inputs, through the products from bf16 pairs.
TEST_P(FlashBackward, Bf16ProductsMatchFloat64Reference) {
  Shape s = GetParam();
  s.dtype = DType::bf16;
  Problem pb(s);
  auto [ref_o, ref_l] = pb.reference(Precision::f64);
  for (const flashmonoid::cpu::Kernels* kn : bf16_tables()) {
    SCOPED_TRACE(flashmonoid::cpu::to_string(kn->isa));
    expect_backward_close(pb, ref_o, ref_l, pb.flash_backward(ref_o, ref_l, *kn));
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, FlashBackward, ::testing::ValuesIn(backward_grid()), name_of);

TEST(FlashBackward, DeterministicAcrossRuns) {
  Shape s;
  s.b = 2;
  s.s_q = 200;
  s.s_k = 177;
  s.h = 4;
  s.h_k = 2;
  s.d = 64;
  s.causal = true;
  Problem pb(s);
  pb.opt.deterministic = true;
  auto [o, l] = pb.forward(Context{});
  auto a = pb.backward(o, l, Context{});
  for (int rep = 0; rep < 3; ++rep) {
    auto b = pb.backward(o, l, Context{});
    EXPECT_EQ(a.dq.buf, b.dq.buf);
    EXPECT_EQ(a.dk.buf, b.dk.buf);
    EXPECT_EQ(a.dv.buf, b.dv.buf);
  }
}

// Rows that see one key under dropout: O = round(V / (1 - p)), so D = rowsum(dO∘O) misses dP by
// a rounding residue where the exact dS is 0. The GPU tests' rule (expect_grads_meet_rule: the oracle
// takes D from the given output as the backward does), several fresh draws: over 4800 draws here
// its largest ratio error / budget was 0.43; with the oracle's D = Σ P∘dP and no storage term, 3 of
// 1800 draws failed (two dq, one dv; bench/NOTES.md, 2026-11-27).
TEST(FlashBackward, OneKeyRowsUnderDropoutMeetTheRule) {
  for (int d : {64, 128})
    for (int draw = 0; draw < 6; ++draw) {
      Shape s = shape_of(DType::bf16, 2, 131, 97, 4, 2, d);  // diag = -34: row 34 sees key 0 only
      s.causal = true;
      s.window_right = 0;
      s.softcap = 3.0f;
      s.dropout_p = 0.17f;
      SCOPED_TRACE(s.str() + " draw " + std::to_string(draw));
      const Problem pb(s);
      auto [o, l] = pb.forward(Context{});
      const auto g = pb.backward(o, l, Context{});
      expect_grads_meet_rule(pb, o, l, g.dq, g.dk, g.dv);
    }
}

// The decoding mainloop (flash_forward_decode: K/V rows read in place) called directly, on both
// kernel widths and the tables with bf16 pair products (bf16 caches then fold on pairs,
// decode_pairs), over few query rows per KV head: s_q 1..8, keys around the 64-key chunks (1, 63,
// 64, 65, 700), MHA/GQA/MQA, every score option and dropout, odd head dims, varlen with empty
// sequences, and KV heads in uneven groups (kDecodeGroupHeads) under dropout; then the same
// problems through flash_forward_tiled, which must agree with the reference as well (the dispatch
// boundary: decode_path switches between the two).
std::vector<Shape> decode_grid() {
  const int seqlens_k[] = {1, 63, 64, 65, 700};
  const int head_dims[] = {59, 64, 111, 128, 256, 40};
  const int heads[][2] = {{4, 4}, {8, 2}, {4, 1}, {16, 1}};
  std::vector<Shape> out;
  int n = 0;
  for (int sk : seqlens_k)
    for (int sq : {1, 2, 4, 8}) {
      Shape s;
      s.b = 2;
      s.s_q = sq;
      s.s_k = sk;
      s.d = head_dims[n % 6];
      s.h = heads[n % 4][0];
      s.h_k = heads[n % 4][1];
      if (sq * s.h / s.h_k > 32) s.h = 2 * s.h_k;
      s.dtype = n % 3 == 2 ? DType::f16 : n % 3 == 1 ? DType::bf16 : DType::f32;
      switch (n % 6) {
        case 0: break;
        case 1: s.causal = true; break;
        case 2: s.window_left = 30; s.window_right = 0; break;
        case 3: s.softcap = 3.0f; s.causal = true; break;
        case 4: s.alibi = true; s.window_left = 100; break;
        case 5: s.dropout_p = 0.2f; break;
      }
      out.push_back(s);
      ++n;
    }
  for (DType t : {DType::f32, DType::bf16}) {
    Shape s;
    s.varlen = true;
    s.b = 4;
    s.lens_q = {0, 1, 2, 1};
    s.lens_k = {5, 0, 300, 129};
    s.h = 8;
    s.h_k = 2;
    s.d = 72;
    s.dtype = t;
    s.causal = t == DType::bf16;
    out.push_back(s);
  }
  Shape groups;  // 12 KV heads: tasks over head groups of 8 and 4, dropout rows numbered by query head
  groups.s_q = 2;
  groups.s_k = 200;
  groups.h = 24;
  groups.h_k = 12;
  groups.d = 64;
  groups.dropout_p = 0.2f;
  out.push_back(groups);
  // bf16 with a softcap (the pair scores' scale goes onto the rows first, score_scale), odd d
  Shape softcap = shape_of(DType::bf16, 1, 2, 130, 8, 2, 59);
  softcap.softcap = 2.0f;
  softcap.causal = true;
  out.push_back(softcap);
  return out;
}

TEST(FlashDecode, MainloopsMatchFloat64Reference) {
  namespace cpu = flashmonoid::cpu;
  for (const Shape& s : decode_grid()) {
    SCOPED_TRACE(s.str());
    Problem pb(s);
    for (const cpu::Kernels* kn : {&cpu::kernels_avx2(), &cpu::kernels_avx512_emulated(),
                                   &cpu::kernels_avx512_bf16_emulated(), &cpu::kernels_amx_emulated()})
      for (auto fwd : {cpu::flash_forward_decode, cpu::flash_forward_tiled}) {
        SCOPED_TRACE(std::string(cpu::to_string(kn->isa)) + (fwd == cpu::flash_forward_decode ? " decode" : " tiled"));
        auto [out, lse] = pb.flash(*kn, 0, fwd);
        expect_forward_close(pb, out, lse);
      }
  }
}

// The decoding path's key splits, like the tiled path's, depend on the shape only, and so do its
// chunk keys; with few tasks per thread a task takes fewer KV heads (task_heads), which changes
// only the partition: the same bits for any thread count, and the rule met. Per shape, the KV heads
// per task at 1 / 2 / 3 / 5 / 16 / 64 threads:
// - 2 heads, 11 splits of 11 chunks: 2 / 2 / 2 / 2 / 1 / 1;
// - 8 heads at d = 256 (32-key chunks, 64 in groups of 4): 8 / 1 / 1 / 1 / 1 / 1 (fp32: 8 tasks per
//   thread, runs of 1 KiB);
// - 12 heads: 8+4 / 8+4 / 8+4 / 4 / 1 / 1;  7 heads: 7 / 7 / 4+3 / 2+2+2+1 / 1 / 1;
// - 8 heads over 9 splits: 8 / 4 / 4 / 4 / 4 / 1 (8 splits if counted from the 8 groups of 1);
//   in bf16 at d = 128 (2 tasks per thread, runs of 1 KiB): 8 / 8 / 8 / 4 / 4 / 1; head-major
//   (8 tasks per thread): 8 / 4 / 2 / 1 / 1 / 1.
// Dropout and ALiBi number rows and slopes by query head across the regrouping. The d = 256 shape's
// tasks of 8 heads (68 KiB of rows) walk heads outermost, those of 1 head (9 KiB) keys outermost
// (walk_heads_outer, with an L1 of 32 or 48 KiB): the same bits either way.
TEST(FlashDecode, BitIdenticalForAnyThreadCount) {
  namespace cpu = flashmonoid::cpu;
  Shape splits11 = shape_of(DType::f32, 1, 2, 700, 8, 2, 72);
  splits11.dropout_p = 0.1f;
  splits11.window_left = 600;
  Shape d256 = shape_of(DType::f32, 1, 2, 60, 16, 8, 256);
  d256.causal = true;
  d256.dropout_p = 0.15f;
  Shape heads12 = shape_of(DType::bf16, 1, 1, 100, 24, 12, 64);
  heads12.alibi = true;
  heads12.window_left = 70;
  Shape heads7 = shape_of(DType::f16, 1, 4, 65, 7, 7, 40);
  heads7.softcap = 3.0f;
  heads7.dropout_p = 0.1f;
  const Shape splits9 = shape_of(DType::f32, 1, 1, 576, 8, 8, 64);
  const Shape splits9_bf16 = shape_of(DType::bf16, 1, 1, 576, 8, 8, 128);
  Shape splits9_head_major = splits9;
  splits9_head_major.head_major_kv = true;
  for (const Shape& s : {splits11, d256, heads12, heads7, splits9, splits9_bf16, splits9_head_major}) {
    SCOPED_TRACE(s.str());
    Problem pb(s);
    for (const cpu::Kernels* kn : {&cpu::kernels_avx2(), &cpu::kernels_avx512_emulated(),
                                   &cpu::kernels_avx512_bf16_emulated()}) {
      SCOPED_TRACE(cpu::to_string(kn->isa));
      auto [o, l] = pb.flash(*kn, 1, cpu::flash_forward_decode);
      expect_forward_close(pb, o, l);
      for (int threads : {2, 3, 5, 16, 64}) {
        auto [o2, l2] = pb.flash(*kn, threads, cpu::flash_forward_decode);
        EXPECT_EQ(o.buf, o2.buf) << threads << " threads";
        EXPECT_EQ(l.buf, l2.buf) << threads << " threads";
      }
    }
  }
}

// A 2-byte cache larger than 32 MiB and the threads' L2s together (64 MiB here) walks heads
// outermost (decode_streams, walk_heads_outer) at 1 thread and, where the L2s hold 1 MiB or more,
// keys outermost at 64 requested threads (64 tasks): the rule met both ways, and the same bits.
TEST(FlashDecode, LargeCachesWalkEitherWayWithTheSameBits) {
  namespace cpu = flashmonoid::cpu;
  for (DType t : {DType::bf16, DType::f16}) {
    const Shape s = shape_of(t, 1, 1, 32768, 32, 8, 64);
    SCOPED_TRACE(s.str());
    Problem pb(s);
    {
      HostTensor o = pb.new_out(), l = pb.new_lse();
      const auto p =
          flashmonoid::detail::make_fwd_params(pb.q.view, pb.k.view, pb.v.view, o.view, l.view, pb.opt, pb.varlen());
      ASSERT_TRUE(cpu::decode_streams(p, 1));  // the premise: both walks below (with L2s of 1 MiB or more)
      if (cpu::cache_bytes(2, 0) >= (1 << 20)) ASSERT_FALSE(cpu::decode_streams(p, 64));
    }
    std::vector<const cpu::Kernels*> tables{&cpu::kernels_avx2(), &cpu::kernels_avx512_emulated()};
    if (t == DType::bf16) tables = bf16_tables();
    for (const cpu::Kernels* kn : tables) {
      SCOPED_TRACE(cpu::to_string(kn->isa));
      auto [o, l] = pb.flash(*kn, 1, cpu::flash_forward_decode);
      expect_forward_close(pb, o, l);
      auto [o2, l2] = pb.flash(*kn, 64, cpu::flash_forward_decode);
      EXPECT_EQ(o.buf, o2.buf);
      EXPECT_EQ(l.buf, l2.buf);
    }
  }
}

// decode_path: every sequence's s_q · group at most 32.
TEST(FlashDecode, DispatchSwitchesAboveThirtyTwoRowsPerKvHead) {
  const auto decode_path = [](const Shape& s) {
    Problem pb(s);
    HostTensor o = pb.new_out(), l = pb.new_lse();
    return flashmonoid::cpu::decode_path(
        flashmonoid::detail::make_fwd_params(pb.q.view, pb.k.view, pb.v.view, o.view, l.view, pb.opt, pb.varlen()));
  };
  Shape s;
  s.b = 2;
  s.s_k = 3;
  s.h_k = 1;
  s.d = 8;
  for (int group : {1, 2, 4, 8, 16, 32})
    for (int sq = 1; sq <= 33; ++sq) {
      s.s_q = sq;
      s.h = group;
      EXPECT_EQ(decode_path(s), sq * group <= 32) << "s_q " << sq << " group " << group;
    }
  s.varlen = true;  // the longest sequence decides
  s.b = 3;
  s.lens_q = {1, 9, 0};
  s.lens_k = {4, 4, 4};
  s.h = 4;
  EXPECT_FALSE(decode_path(s));
  s.lens_q = {1, 8, 0};
  EXPECT_TRUE(decode_path(s));
  Shape rows33;  // called directly past the boundary, the decoding mainloop refuses
  rows33.s_q = 33;
  rows33.s_k = 3;
  rows33.d = 8;
  Problem pb(rows33);
  expect_error([&] { pb.flash(flashmonoid::cpu::kernels_avx2(), 0, flashmonoid::cpu::flash_forward_decode); }, "q",
               "at most 32 query rows per KV head");
}

// Both passes' sums run in an order fixed by the shape (the forward's key splits and the
// backward's key chunks are counted from the shape): the same bits for any thread count, on every
// kernel table. GQA 3:1, dropout and a window so that several heads per chunk, the mask and the
// forward's split merge (s_k > 128 with few items) all count; bf16 inputs for the bf16-pair products.
TEST(FlashCpu, BitIdenticalForAnyThreadCount) {
  Shape s;
  s.b = 1;
  s.s_q = 150;
  s.s_k = 261;
  s.h = 6;
  s.h_k = 2;
  s.d = 72;
  s.dropout_p = 0.1f;
  s.window_left = 200;
  Problem pb(s);
  pb.opt.deterministic = true;
  s.dtype = DType::bf16;  // for the bf16-pair products
  Problem pb16(s);
  pb16.opt.deterministic = true;
  using flashmonoid::cpu::Kernels;
  const std::pair<const Problem*, const Kernels*> runs[] = {{&pb, &flashmonoid::cpu::kernels_avx2()},
                                                            {&pb, &flashmonoid::cpu::kernels_avx512_emulated()},
                                                            {&pb16, &flashmonoid::cpu::kernels_avx512_bf16_emulated()},
                                                            {&pb16, &flashmonoid::cpu::kernels_amx_emulated()}};
  for (auto [problem, kn] : runs) {
    SCOPED_TRACE(flashmonoid::to_string(problem->shape.dtype));
    auto [o, l] = problem->flash(*kn, 1);
    auto a = problem->flash_backward(o, l, *kn, 1);
    for (int threads : {2, 3}) {
      auto [o2, l2] = problem->flash(*kn, threads);
      EXPECT_EQ(o.buf, o2.buf) << threads << " threads";
      EXPECT_EQ(l.buf, l2.buf) << threads << " threads";
      auto b = problem->flash_backward(o, l, *kn, threads);
      EXPECT_EQ(a.dq.buf, b.dq.buf) << threads << " threads";
      EXPECT_EQ(a.dk.buf, b.dk.buf) << threads << " threads";
      EXPECT_EQ(a.dv.buf, b.dv.buf) << threads << " threads";
    }
  }
}

// Used lengths (Varlen::seqused_q / seqused_k): a padded batch run in place computes what the call
// over the same rows packed computes, bit for bit, forward and backward, and leaves every row past a
// slot's used length as it was (poisoned here): out, lse, dq, dk, dv.
TEST(FlashVarlen, UsedLengthsRunInPlaceAsThePackedCall) {
  const std::vector<int> used_q = {5, 0, 12, 3}, used_k = {7, 5, 1, 0};
  for (DType t : {DType::f32, DType::bf16}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(flashmonoid::to_string(t) + (causal ? " causal" : ""));
      Shape slots;
      slots.varlen = true;
      slots.b = 4;
      slots.h = 4;
      slots.h_k = 2;
      slots.d = 40;
      slots.dtype = t;
      slots.causal = causal;
      slots.lens_q = {9, 4, 12, 7};
      slots.lens_k = {11, 5, 12, 3};
      slots.used_q = used_q;
      slots.used_k = used_k;
      Problem pad(slots);
      Shape packed = slots;
      packed.lens_q = used_q;
      packed.lens_k = used_k;
      packed.used_q = packed.used_k = {};
      Problem pk(packed);
      pk.opt = pad.opt;
      const int* sq = pad.cu_q.view.ptr<int>();
      const int* sk = pad.cu_k.view.ptr<int>();
      const int* pq = pk.cu_q.view.ptr<int>();
      const int* pkk = pk.cu_k.view.ptr<int>();
      // Row r of `from` (h heads of d) <-> row r2 of `to`.
      auto for_rows = [](const HostTensor& a, std::int64_t ra, const HostTensor& b, std::int64_t rb, int width,
                         auto&& fn) {
        for (int j = 0; j < width; ++j) fn(a.get(ra * width + j), b.get(rb * width + j));
      };
      auto copy_rows = [](const HostTensor& from, const int* cf, HostTensor& to, const int* ct,
                          const std::vector<int>& used, int width) {
        for (int b = 0; b < 4; ++b)
          for (int i = 0; i < used[b]; ++i)
            for (int j = 0; j < width; ++j)
              to.set((ct[b] + i) * std::int64_t{width} + j, from.get((cf[b] + i) * std::int64_t{width} + j));
      };
      const int wq = slots.h * slots.d, wk = slots.h_k * slots.d;
      copy_rows(pad.q, sq, pk.q, pq, used_q, wq);
      copy_rows(pad.dout, sq, pk.dout, pq, used_q, wq);
      copy_rows(pad.k, sk, pk.k, pkk, used_k, wk);
      copy_rows(pad.v, sk, pk.v, pkk, used_k, wk);
      // Used rows equal the packed call's; rows past the used ones keep their poison.
      auto expect_rows = [&](const char* name, const HostTensor& got, const int* cg, const HostTensor& want,
                             const int* cw, const std::vector<int>& used, const std::vector<int>& slot, int width) {
        for (int b = 0; b < 4; ++b) {
          for (int i = 0; i < used[b]; ++i)
            for_rows(got, cg[b] + i, want, cw[b] + i, width, [&](float x, float y) {
              ASSERT_EQ(x, y) << name << " sequence " << b << " row " << i;
            });
          for (int i = used[b]; i < slot[b]; ++i)
            for (int j = 0; j < width; ++j)
              ASSERT_TRUE(std::isnan(got.get((cg[b] + i) * std::int64_t{width} + j))) << name << " written past the used rows";
        }
      };
      auto [o, l] = pad.forward(Context{});
      auto [ko, kl] = pk.forward(Context{});
      expect_rows("out", o, sq, ko, pq, used_q, slots.lens_q, wq);
      for (int hd = 0; hd < slots.h; ++hd)
        for (int b = 0; b < 4; ++b) {
          for (int i = 0; i < used_q[b]; ++i)
            ASSERT_EQ(l.get(hd * pad.total_q + sq[b] + i), kl.get(hd * pk.total_q + pq[b] + i)) << "lse";
          for (int i = used_q[b]; i < slots.lens_q[b]; ++i) ASSERT_TRUE(std::isnan(l.get(hd * pad.total_q + sq[b] + i)));
        }
      auto g = pad.backward(o, l, Context{});
      auto kg = pk.backward(ko, kl, Context{});
      expect_rows("dq", g.dq, sq, kg.dq, pq, used_q, slots.lens_q, wq);
      expect_rows("dk", g.dk, sk, kg.dk, pkk, used_k, slots.lens_k, wk);
      expect_rows("dv", g.dv, sk, kg.dv, pkk, used_k, slots.lens_k, wk);
    }
  }
}

// Used lengths with dropout and ALiBi (the keep-mask's row ids are the slots' rows): the flash path
// against the float64 reference, which the CUDA tests take as their oracle for such calls, on the used
// rows; neither writes the others.
TEST(FlashVarlen, UsedLengthsWithDropoutMatchTheReference) {
  Shape s;
  s.varlen = true;
  s.b = 3;
  s.h = 4;
  s.h_k = 2;
  s.d = 32;
  s.causal = true;
  s.alibi = true;
  s.dropout_p = 0.2f;
  s.lens_q = {40, 8, 33};
  s.lens_k = {70, 8, 33};
  s.used_q = {29, 0, 33};
  s.used_k = {61, 5, 0};
  Problem pb(s);
  auto [o, l] = pb.forward(Context{});
  auto [ro, rl] = pb.reference(Precision::f64);
  auto g = pb.backward(o, l, Context{});
  auto rg = pb.reference_backward(ro, rl, Precision::f64);
  auto compare = [&](const char* name, const HostTensor& got, const HostTensor& ref, bool q_side, int width) {
    const std::vector<std::int64_t> skip = pb.unused_rows(q_side);
    double err = 0.0, scale = 1.0;
    for (std::int64_t i = 0; i < got.numel(); ++i) {
      const std::int64_t row = i / width;
      const float x = got.get(i), y = ref.get(i);
      if (std::find(skip.begin(), skip.end(), row) != skip.end()) {
        ASSERT_TRUE(std::isnan(x) && std::isnan(y)) << name << " row " << row << " past the used rows was written";
        continue;
      }
      err = std::max(err, static_cast<double>(std::abs(x - y)));
      scale = std::max(scale, static_cast<double>(std::abs(y)));
    }
    EXPECT_LE(err, 2e-5 * scale) << name;
  };
  compare("out", o, ro, true, s.h * s.d);
  compare("dq", g.dq, rg.dq, true, s.h * s.d);
  compare("dk", g.dk, rg.dk, false, s.h_k * s.d);
  compare("dv", g.dv, rg.dv, false, s.h_k * s.d);
}

}  // namespace
}  // namespace fmtest
