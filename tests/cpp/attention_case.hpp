// One randomized attention problem on the host: inputs, options, and runners for the reference
// (float64 and input-precision) and any other algorithm, for forward and backward comparisons.
#pragma once

#include <optional>
#include <string>

#include "api/validate.hpp"
#include "cpu/cpu_backend.hpp"
#include "test_util.hpp"

namespace flashmonoid::cpu {
// src/cpu/kernels_avx512.cpp compiled for AVX2 (tests/cpp/CMakeLists.txt): the 16-lane kernels'
// source, runnable on any CPU of the build's baseline.
const Kernels& kernels_avx512_emulated();
// src/cpu/kernels_avx512_bf16.cpp compiled for AVX2: the same plus the products from bf16 pairs,
// VDPBF16PS and VCVTNE2PS2BF16 emulated (src/cpu/simd_bf16.hpp).
const Kernels& kernels_avx512_bf16_emulated();
// src/cpu/kernels_amx.cpp compiled for AVX2: those products on emulated AMX tiles (blocking,
// configurations and remainders as on the real tiles).
const Kernels& kernels_amx_emulated();
}  // namespace flashmonoid::cpu

namespace fmtest {

struct Shape {
  int b = 1, s_q = 1, s_k = 1, h = 1, h_k = 1, d = 64;
  DType dtype = DType::f32;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  float dropout_p = 0.0f;
  bool varlen = false;
  std::vector<int> lens_q, lens_k;  // varlen sequence lengths (b entries)
  std::vector<int> used_q, used_k;  // varlen used lengths (Varlen::seqused_*), lens_* then the slots
  bool padded_strides = true;       // non-contiguous head/row strides
  bool head_major_kv = false;       // K/V held (b, h_k, s_k, d) in memory (torch's layout), not varlen

  std::string str() const {
    std::string s = "b" + std::to_string(b) + " sq" + std::to_string(s_q) + " sk" + std::to_string(s_k) + " h" +
                    std::to_string(h) + "/" + std::to_string(h_k) + " d" + std::to_string(d) + " " +
                    flashmonoid::to_string(dtype);
    if (causal) s += " causal";
    if (window_left >= 0 || window_right >= 0)
      s += " window(" + std::to_string(window_left) + "," + std::to_string(window_right) + ")";
    if (softcap > 0) s += " softcap" + std::to_string(softcap);
    if (alibi) s += " alibi";
    if (dropout_p > 0) s += " dropout" + std::to_string(dropout_p);
    if (varlen) s += " varlen";
    if (!used_q.empty() || !used_k.empty()) s += " used";
    if (head_major_kv) s += " head-major K/V";
    return s;
  }
};

// A dense shape without masks or modifiers.
inline Shape shape_of(DType t, int b, int sq, int sk, int h, int hk, int d) {
  Shape s;
  s.dtype = t;
  s.b = b;
  s.s_q = sq;
  s.s_k = sk;
  s.h = h;
  s.h_k = hk;
  s.d = d;
  return s;
}

struct Problem {
  Shape shape;
  HostTensor q, k, v, dout, alibi, cu_q, cu_k, seqused_q, seqused_k;
  flashmonoid::Options opt;
  flashmonoid::Varlen vl;
  std::int64_t total_q = 0, total_k = 0;

  explicit Problem(const Shape& s) : shape(s) {
    const int pad = s.padded_strides ? 8 : 0;  // extra elements per row: exercises strides
    auto make = [&](int rows_per_batch, int heads, std::int64_t total) {
      if (s.varlen) {
        std::vector<std::int64_t> dims{total, heads, s.d};
        std::vector<std::int64_t> st{static_cast<std::int64_t>(heads) * s.d + pad, s.d, 1};
        return HostTensor(s.dtype, dims, st);
      }
      std::vector<std::int64_t> dims{s.b, rows_per_batch, heads, s.d};
      const std::int64_t row = static_cast<std::int64_t>(heads) * s.d + pad;
      std::vector<std::int64_t> st{row * rows_per_batch, row, s.d, 1};
      return HostTensor(s.dtype, dims, st);
    };
    if (s.varlen) {
      cu_q = HostTensor(DType::i32, {s.b + 1});
      cu_k = HostTensor(DType::i32, {s.b + 1});
      int* cq = cu_q.view.ptr<int>();
      int* ck = cu_k.view.ptr<int>();
      cq[0] = ck[0] = 0;
      int mq = 0, mk = 0;
      for (int i = 0; i < s.b; ++i) {
        cq[i + 1] = cq[i] + s.lens_q[i];
        ck[i + 1] = ck[i] + s.lens_k[i];
        mq = std::max(mq, s.lens_q[i]);
        mk = std::max(mk, s.lens_k[i]);
      }
      total_q = cq[s.b];
      total_k = ck[s.b];
      vl = flashmonoid::Varlen{cu_q.view, cu_k.view, mq, mk};
      // Used lengths: the slots above hold them; max_seqlen bounds them.
      auto used = [&](const std::vector<int>& u, HostTensor& t, flashmonoid::TensorView& view, std::int64_t& max) {
        if (u.empty()) return;
        t = HostTensor(DType::i32, {s.b});
        max = 0;
        for (int i = 0; i < s.b; ++i) {
          t.view.ptr<int>()[i] = u[i];
          max = std::max<std::int64_t>(max, u[i]);
        }
        view = t.view;
      };
      used(s.used_q, seqused_q, vl.seqused_q, vl.max_seqlen_q);
      used(s.used_k, seqused_k, vl.seqused_k, vl.max_seqlen_k);
    } else {
      total_q = static_cast<std::int64_t>(s.b) * s.s_q;
      total_k = static_cast<std::int64_t>(s.b) * s.s_k;
    }
    // (b, s_k, h_k, d) views of head-major memory: a head's rows of d (+ pad) one after another.
    auto make_head_major = [&] {
      const std::int64_t row = s.d + pad;
      return HostTensor(s.dtype, {s.b, s.s_k, s.h_k, s.d}, {row * s.s_k * s.h_k, row, row * s.s_k, 1});
    };
    q = make(s.s_q, s.h, total_q);
    k = s.head_major_kv ? make_head_major() : make(s.s_k, s.h_k, total_k);
    v = s.head_major_kv ? make_head_major() : make(s.s_k, s.h_k, total_k);
    dout = make(s.s_q, s.h, total_q);
    q.fill_normal();
    k.fill_normal();
    v.fill_normal();
    dout.fill_normal();
    opt.causal = s.causal;
    opt.window_left = s.window_left;
    opt.window_right = s.window_right;
    opt.softcap = s.softcap;
    opt.dropout_p = s.dropout_p;
    opt.dropout_seed = rng()();
    opt.dropout_offset = rng()() >> 20;
    if (s.alibi) {
      alibi = HostTensor(DType::f32, {s.b, s.h});
      std::uniform_real_distribution<float> u(0.0f, 0.5f);
      for (std::int64_t i = 0; i < alibi.numel(); ++i) alibi.set(i, u(rng()));
      opt.alibi_slopes = alibi.view;
    }
  }

  HostTensor new_out() const {
    HostTensor o = shape.varlen ? HostTensor(shape.dtype, {total_q, shape.h, shape.d})
                                : HostTensor(shape.dtype, {shape.b, shape.s_q, shape.h, shape.d});
    o.poison();
    return o;
  }
  HostTensor new_lse() const {
    HostTensor l = shape.varlen ? HostTensor(DType::f32, {shape.h, total_q}) : HostTensor(DType::f32, {shape.b, shape.h, shape.s_q});
    l.poison();
    return l;
  }
  HostTensor new_like_kv() const {
    HostTensor o = shape.varlen ? HostTensor(shape.dtype, {total_k, shape.h_k, shape.d})
                                : HostTensor(shape.dtype, {shape.b, shape.s_k, shape.h_k, shape.d});
    o.poison();
    return o;
  }
  const flashmonoid::Varlen* varlen() const { return shape.varlen ? &vl : nullptr; }

  // Packed rows past each slot's used rows (used lengths; none otherwise), of q's side or k's.
  std::vector<std::int64_t> unused_rows(bool q_side) const {
    std::vector<std::int64_t> rows;
    const std::vector<int>& used = q_side ? shape.used_q : shape.used_k;
    if (used.empty()) return rows;
    const int* cu = (q_side ? cu_q : cu_k).view.ptr<int>();
    for (int b = 0; b < shape.b; ++b)
      for (int r = cu[b] + used[b]; r < cu[b + 1]; ++r) rows.push_back(r);
    return rows;
  }

  // Forward with the public API (ctx selects the CPU algorithm) into fresh poisoned outputs.
  std::pair<HostTensor, HostTensor> forward(const flashmonoid::Context& ctx) const {
    HostTensor o = new_out(), l = new_lse();
    if (shape.varlen)
      flashmonoid::forward_varlen(q.view, k.view, v.view, vl, o.view, l.view, opt, ctx);
    else
      flashmonoid::forward(q.view, k.view, v.view, o.view, l.view, opt, ctx);
    return {std::move(o), std::move(l)};
  }
  // The reference at a given precision, called directly.
  std::pair<HostTensor, HostTensor> reference(flashmonoid::cpu::Precision prec) const {
    HostTensor o = new_out(), l = new_lse();
    auto p = flashmonoid::detail::make_fwd_params(q.view, k.view, v.view, o.view, l.view, opt, varlen());
    flashmonoid::cpu::reference_forward(p, prec);
    return {std::move(o), std::move(l)};
  }

  // The flash forward with a given kernel table (e.g. the emulated AVX-512 one), bypassing dispatch;
  // fwd: flash_forward (which picks the mainloop), or flash_forward_tiled / flash_forward_decode.
  using FlashFn = void (*)(const flashmonoid::detail::FwdParams&, int, const flashmonoid::cpu::Kernels&);
  std::pair<HostTensor, HostTensor> flash(const flashmonoid::cpu::Kernels& kn, int threads = 0,
                                          FlashFn fwd = flashmonoid::cpu::flash_forward) const {
    HostTensor o = new_out(), l = new_lse();
    auto p = flashmonoid::detail::make_fwd_params(q.view, k.view, v.view, o.view, l.view, opt, varlen());
    fwd(p, threads, kn);
    return {std::move(o), std::move(l)};
  }

  struct Grads {
    HostTensor dq, dk, dv;
  };
  Grads flash_backward(const HostTensor& out, const HostTensor& lse, const flashmonoid::cpu::Kernels& kn,
                       int threads = 0) const {
    Grads g{new_out(), new_like_kv(), new_like_kv()};
    auto p = flashmonoid::detail::make_bwd_params(dout.view, q.view, k.view, v.view, out.view, lse.view, g.dq.view,
                                                  g.dk.view, g.dv.view, opt, varlen());
    flashmonoid::cpu::flash_backward(p, threads, kn);
    return g;
  }
  Grads backward(const HostTensor& out, const HostTensor& lse, const flashmonoid::Context& ctx) const {
    Grads g{new_out(), new_like_kv(), new_like_kv()};
    if (shape.varlen)
      flashmonoid::backward_varlen(dout.view, q.view, k.view, v.view, vl, out.view, lse.view, g.dq.view, g.dk.view,
                                   g.dv.view, opt, ctx);
    else
      flashmonoid::backward(dout.view, q.view, k.view, v.view, out.view, lse.view, g.dq.view, g.dk.view, g.dv.view,
                            opt, ctx);
    return g;
  }
  Grads reference_backward(const HostTensor& out, const HostTensor& lse, flashmonoid::cpu::Precision prec) const {
    Grads g{new_out(), new_like_kv(), new_like_kv()};
    auto p = flashmonoid::detail::make_bwd_params(dout.view, q.view, k.view, v.view, out.view, lse.view, g.dq.view,
                                                  g.dk.view, g.dv.view, opt, varlen());
    flashmonoid::cpu::reference_backward(p, prec);
    return g;
  }
};

// to <- from element by element (to's dtype; from fp16 / bf16 into fp32 exactly).
inline void copy_values(const HostTensor& from, HostTensor& to) {
  for (std::int64_t i = 0; i < from.numel(); ++i) to.set(i, from.get(i));
}

// The same inputs as fp32 tensors, so that the float64 oracle's gradients are not rounded to the
// input dtype on the way out.
inline Problem as_f32(const Problem& pb) {
  Shape s = pb.shape;
  s.dtype = DType::f32;
  Problem f(s);
  copy_values(pb.q, f.q);
  copy_values(pb.k, f.k);
  copy_values(pb.v, f.v);
  copy_values(pb.dout, f.dout);
  f.opt = pb.opt;  // same seed, offset, alibi slopes (host views of pb)
  f.vl = pb.vl;
  return f;
}

// The FlashAttention rule for gradients in fp16 / bf16, against the exact backward of the inputs the
// kernel receives:
// - The oracle runs in float64 on pb's inputs in fp32 tensors (gradients not rounded on the way
//   out) and on the forward output `out` given to the backward, with D = rowsum(dO∘O) of that output
//   as FlashAttention's backward defines it (Precision::f64_given_out). With Σ P∘dP instead, rows
//   that see one key under dropout (O = round(V / (1 - p)), exact dS = 0) leave the rounding residue
//   of O in every backward's dS, and the input-dtype emulation's rounding of dP cancels part of it by
//   chance: 1 draw in ~900 failed there (bench/NOTES.md, 2026-11-27).
// - Ours may exceed 2x the emulation's error by the rounding of merely storing the exact result in
//   the output dtype (unit_roundoff · |exact|, per element): both outputs are stored rounded, and
//   where the emulation's fp32 sum lands on the exact result's nearest neighbour by luck while ours,
//   as accurate before storing, lands one step away, ours reads up to twice its error plus that
//   rounding (a dv element of 194 rounded probabilities: ours 0.045, the emulation 0.017, its largest
//   0.022).
// - An absolute floor: where the input-dtype math is exact (one key without dropout: dS = P (dP - D)
//   = 0), D and dP come from differently ordered fp32 sums and leave ~1e-6 (measured 3.7e-6 on dk
//   with O(1) inputs); expect_close's floor is relative to the reference magnitude, which is 0 there.
inline void expect_grads_meet_rule(const Problem& pb, const HostTensor& out, const HostTensor& lse,
                                   const HostTensor& dq, const HostTensor& dk, const HostTensor& dv) {
  constexpr double kAbsFloor = 1e-5;
  using flashmonoid::cpu::Precision;
  const Problem f32 = as_f32(pb);
  HostTensor o_given = f32.new_out();
  copy_values(out, o_given);
  const auto fwd64 = f32.reference(Precision::f64);
  const auto oracle = f32.reference_backward(o_given, fwd64.second, Precision::f64_given_out);
  const auto lowp = pb.reference_backward(out, lse, Precision::input);
  const double u = unit_roundoff(pb.shape.dtype);
  // With used lengths the rows past them must keep their poison and are left out of the comparison.
  auto check = [&](const char* what, const HostTensor& got, const HostTensor& ref, const HostTensor& lp, bool q_side) {
    const std::vector<double> r = ref.values(), g = got.values(), l = lp.values();
    std::vector<char> skip(r.size(), 0);
    const std::int64_t width = static_cast<std::int64_t>(q_side ? pb.shape.h : pb.shape.h_k) * pb.shape.d;
    for (std::int64_t row : pb.unused_rows(q_side))
      for (std::int64_t j = 0; j < width; ++j) skip[row * width + j] = 1;
    double excess = 0.0, lowp_err = 0.0, err = 0.0;  // excess: the largest error beyond storing the exact value
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (skip[i]) {
        EXPECT_TRUE(std::isnan(g[i])) << what << ": element " << i << " past the used rows was written";
        continue;
      }
      if (!std::isfinite(g[i])) {  // a poisoned or overflowed element
        excess = std::numeric_limits<double>::infinity();
        break;
      }
      excess = std::max(excess, std::abs(g[i] - r[i]) - u * std::abs(r[i]));
      lowp_err = std::max(lowp_err, std::abs(l[i] - r[i]));
      err = std::max(err, std::abs(g[i] - r[i]));
    }
    EXPECT_LE(excess, 2.0 * lowp_err + kAbsFloor)
        << what << ": max error beyond storage rounding " << excess << " (max error " << err << ") > 2x the "
        << flashmonoid::to_string(pb.shape.dtype) << " reference's error (" << lowp_err << ") + " << kAbsFloor;
  };
  check("dq", dq, oracle.dq, lowp.dq, true);
  check("dk", dk, oracle.dk, lowp.dk, false);
  check("dv", dv, oracle.dv, lowp.dv, false);
}

}  // namespace fmtest
