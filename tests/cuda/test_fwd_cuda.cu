// CUDA forward against the CPU float64 reference over a randomized grid (odd lengths, s_q != s_k
// both ways, head dims 8..256, GQA/MQA, causal, windows, softcap, ALiBi, varlen, dropout), split-KV
// decoding, the dropout mask bit for bit, the merge kernel and the backend's error messages.
// Tolerance: the FlashAttention rule, error vs float64 at most 2x the error of the same math in
// the input dtype (plus a 1e-6 relative floor for exact cases). Outputs are NaN-poisoned on the
// device before every launch, so an unwritten element fails.
#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <cmath>
#include <tuple>
#include <memory>
#include <random>
#include <vector>

#include "attention_case.hpp"
#include "common/block_range.cuh"
#include "device_tensor.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace fmtest {
namespace {

using flashmonoid::Context;
using flashmonoid::Device;
using flashmonoid::cpu::Precision;

// fp32 copy of a host tensor (exact for fp16/bf16): the float64 reference on it writes an fp32
// output, an oracle not rounded to the low-precision dtype.
HostTensor to_f32(const HostTensor& h) {
  if (!h.view.defined()) return HostTensor();
  std::vector<std::int64_t> dims(h.view.shape, h.view.shape + h.view.ndim);
  HostTensor f(DType::f32, dims);
  for (std::int64_t i = 0; i < h.numel(); ++i) f.set(i, h.get(i));
  return f;
}

struct GpuResult {
  HostTensor out, lse;
};

// Forward through the public API on device copies of pb's inputs. splits: ctx.num_splits
// (0 = heuristic); the workspace is sized for max(splits, heuristic). path forces a kernel family.
// ctx carries the scheduling fields under test (persistent_kernels, sm_margin); workspace, splits and
// path are set here.
GpuResult gpu_forward(const Problem& pb, int splits = 0, flashmonoid::CudaPath path = flashmonoid::CudaPath::automatic,
                      Context ctx = {}, bool with_workspace = true) {
  DeviceTensor q(pb.q), k(pb.k), v(pb.v), alibi(pb.alibi), cu_q(pb.cu_q), cu_k(pb.cu_k), used_q(pb.seqused_q),
      used_k(pb.seqused_k);
  GpuResult r{pb.new_out(), pb.new_lse()};
  DeviceTensor out(r.out), lse(r.lse);  // NaN-poisoned
  flashmonoid::Options opt = pb.opt;
  if (pb.shape.alibi) opt.alibi_slopes = alibi.view;
  flashmonoid::Varlen vl = pb.vl;
  if (pb.shape.varlen) {
    vl.cu_seqlens_q = cu_q.view;
    vl.cu_seqlens_k = cu_k.view;
    if (!pb.shape.used_q.empty()) vl.seqused_q = used_q.view;
    if (!pb.shape.used_k.empty()) vl.seqused_k = used_k.view;
  }
  const flashmonoid::Varlen* vlp = pb.shape.varlen ? &vl : nullptr;
  std::size_t ws = flashmonoid::forward_workspace_size(q.view, k.view, opt, vlp);
  if (splits > 1) {
    auto p = flashmonoid::detail::make_fwd_params(q.view, k.view, v.view, out.view, lse.view, opt, vlp);
    // Generous: (d + 1) fp32 per (split, head, row) plus alignment.
    ws = std::max<std::size_t>(ws, static_cast<std::size_t>(splits) * p.h * p.total_q * (p.d + 1) * 4 + 1024);
  }
  DeviceBuffer work(with_workspace ? ws : 0);
  ctx.workspace = work.ptr;
  ctx.workspace_bytes = work.bytes;
  ctx.num_splits = splits;
  ctx.cuda_path = path;
  if (vlp)
    flashmonoid::forward_varlen(q.view, k.view, v.view, vl, out.view, lse.view, opt, ctx);
  else
    flashmonoid::forward(q.view, k.view, v.view, out.view, lse.view, opt, ctx);
  cuda_ok(cudaDeviceSynchronize());
  out.copy_to(r.out);
  lse.copy_to(r.lse);
  return r;
}

// GPU vs the fp32-output float64 reference, with the input-precision reference setting the budget.
// With used lengths the rows past them must keep their poison; they are left out (set to 0 in all).
void check_against_reference(const Problem& pb, GpuResult g) {
  HostTensor q32 = to_f32(pb.q), k32 = to_f32(pb.k), v32 = to_f32(pb.v);
  HostTensor o32(DType::f32, std::vector<std::int64_t>(g.out.view.shape, g.out.view.shape + g.out.view.ndim));
  HostTensor l32 = pb.new_lse();
  auto p = flashmonoid::detail::make_fwd_params(q32.view, k32.view, v32.view, o32.view, l32.view, pb.opt, pb.varlen());
  flashmonoid::cpu::reference_forward(p, Precision::f64);
  auto [lp_o, lp_l] = pb.reference(Precision::input);
  const std::int64_t width = static_cast<std::int64_t>(pb.shape.h) * pb.shape.d;
  for (std::int64_t r : pb.unused_rows(true)) {
    for (std::int64_t j = 0; j < width; ++j) {
      EXPECT_TRUE(std::isnan(g.out.get(r * width + j))) << "out row " << r << " past the used rows was written";
      for (HostTensor* t : {&g.out, &o32, &lp_o}) t->set(r * width + j, 0.0f);
    }
    for (int hd = 0; hd < pb.shape.h; ++hd) {
      EXPECT_TRUE(std::isnan(g.lse.get(hd * pb.total_q + r))) << "lse row " << r << " past the used rows was written";
      for (HostTensor* t : {&g.lse, &l32}) t->set(hd * pb.total_q + r, 0.0f);
    }
  }
  expect_close("out", pb.shape.dtype, g.out.values(), o32.values(), lp_o.values());
  const double lse_err = max_abs_diff(g.lse.values(), l32.values());
  EXPECT_LE(lse_err, 1e-5 * std::max(1.0, max_abs(l32.values()))) << "lse";
}

std::vector<Shape> gpu_grid() {
  const int seqlens[] = {1, 17, 113, 128, 129, 300, 1000};
  const int head_dims[] = {64, 40, 128, 96, 256, 32, 8, 16, 72, 200};
  const int heads[][2] = {{2, 2}, {4, 2}, {3, 1}, {8, 2}};
  const DType dtypes[] = {DType::bf16, DType::f16};
  std::vector<Shape> out;
  int n = 0;
  for (int sq : seqlens) {
    for (int rel = 0; rel < 3; ++rel) {  // s_k < s_q, =, >
      const int sk = rel == 0 ? std::max(1, sq / 2 - 1) : rel == 1 ? sq : sq + 37 + 64 * (n % 3);
      Shape s;
      s.b = sq >= 300 ? 1 : 2;
      s.s_q = sq;
      s.s_k = sk;
      s.d = head_dims[n % 10];
      s.h = heads[n % 4][0];
      s.h_k = heads[n % 4][1];
      s.dtype = dtypes[n % 2];
      switch (n % 8) {
        case 0: break;
        case 1: s.causal = true; break;
        case 2: s.window_left = 5; s.window_right = 3; break;
        case 3: s.softcap = 2.5f; s.causal = true; break;
        case 4: s.alibi = true; break;
        case 5: s.dropout_p = 0.17f; break;
        case 6: s.window_left = 70; s.window_right = 0; s.alibi = true; break;
        case 7: s.causal = true; s.dropout_p = 0.3f; s.softcap = 10.0f; break;
      }
      out.push_back(s);
      ++n;
    }
  }
  for (DType t : dtypes)
    for (int c = 0; c < 2; ++c) {
      Shape s;
      s.varlen = true;
      s.b = 5;
      s.lens_q = {0, 1, 17, 200, 3};
      s.lens_k = {5, 1, 0, 129, 300};
      s.h = 4;
      s.h_k = 2;
      s.d = c ? 40 : 128;
      s.dtype = t;
      s.causal = c == 1;
      s.dropout_p = c ? 0.0f : 0.1f;
      out.push_back(s);
    }
  // Long key ranges: at hdim 128 (and 96) s_k >= 2048 takes the stages of two 32-key tiles on
  // devices with the shared memory (tile_fwd_sm80.hpp); windows, odd tile counts and causal ends put
  // skipped tiles into the aligned groups.
  struct Long {
    int sq, sk, d, h, h_k;
    DType t;
    int feature;
  };
  const Long longs[] = {{300, 2049, 128, 4, 2, DType::bf16, 1}, {2100, 2100, 96, 2, 2, DType::f16, 2},
                        {129, 2500, 128, 3, 1, DType::bf16, 3}, {200, 2222, 128, 2, 1, DType::f16, 4},
                        {77, 4099, 128, 2, 2, DType::bf16, 0}};
  for (const Long& l : longs) {
    Shape s;
    s.b = 1;
    s.s_q = l.sq;
    s.s_k = l.sk;
    s.d = l.d;
    s.h = l.h;
    s.h_k = l.h_k;
    s.dtype = l.t;
    switch (l.feature) {
      case 1: s.causal = true; break;
      case 2: s.window_left = 300; s.window_right = 40; break;
      case 3: s.softcap = 5.0f; s.alibi = true; break;
      case 4: s.dropout_p = 0.2f; break;
    }
    out.push_back(s);
  }
  Shape lv;
  lv.varlen = true;
  lv.b = 3;
  lv.lens_q = {100, 0, 700};
  lv.lens_k = {2300, 50, 2049};
  lv.h = 4;
  lv.h_k = 2;
  lv.d = 128;
  lv.dtype = DType::bf16;
  lv.causal = true;
  out.push_back(lv);
  // No keys at all (out = 0, lse = -inf): a prefill-sized q, which would take sm90 with keys.
  for (DType t : dtypes) out.push_back(shape_of(t, 2, 130, 0, 4, 2, 64));
  // No query row (an empty output; the workspace query's split heuristic sees zero row blocks), and
  // neither side.
  for (DType t : dtypes) {
    out.push_back(shape_of(t, 2, 0, 130, 4, 2, 64));
    Shape none = shape_of(t, 2, 0, 0, 4, 2, 128);
    none.causal = true;
    out.push_back(none);
  }
  // Used lengths (Varlen::seqused_*): padded slots run in place (flashmonoid.sdpa's padded route), an
  // entry without used queries and one without used keys among them. Last, so the cases above keep
  // their numbers (the device script's sanitizer filters name them).
  for (DType t : dtypes)
    for (int c = 0; c < 2; ++c) {
      Shape s;
      s.varlen = true;
      s.b = 3;
      s.lens_q = {300, 64, 200};
      s.lens_k = {300, 64, 200};
      s.used_q = {257, 0, 200};
      s.used_k = {300, 17, 0};
      s.h = 4;
      s.h_k = 2;
      s.d = c ? 64 : 128;
      s.dtype = t;
      s.causal = c == 1;
      s.dropout_p = c ? 0.0f : 0.1f;
      out.push_back(s);
    }
  return out;
}

// Whether the sm90 kernels can run s here (a Hopper device, a prefill shape); the same rule as
// src/cuda/sm90/fwd_sm90.hpp, so that a forced sm90 run is skipped exactly where it must throw.
bool sm90_runs(const Shape& s) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess || major != 9) return false;
  int max_q = s.s_q, total_k = s.b * s.s_k;
  if (s.varlen) {
    const std::vector<int>& lens_q = s.used_q.empty() ? s.lens_q : s.used_q;  // max_seqlen_q
    max_q = *std::max_element(lens_q.begin(), lens_q.end());
    total_k = std::accumulate(s.lens_k.begin(), s.lens_k.end(), 0);
  }
  return max_q >= 65 && total_k > 0;
}

// Sharper shapes for the sm90 kernels: several 128-row blocks, ragged 128- and 80-key tiles, GQA,
// every head-dim bucket, the score-modifier variant.
std::vector<Shape> sm90_grid() {
  std::vector<Shape> out;
  const int dims[] = {64, 128, 256, 96, 64, 192};
  int n = 0;
  for (int sq : {65, 257, 1031})
    for (int d : dims) {
      Shape s;
      s.b = sq > 500 ? 1 : 2;
      s.s_q = sq;
      s.s_k = n % 3 == 0 ? sq : n % 3 == 1 ? sq + 333 : std::max(70, sq / 2 + 1);
      s.d = d;
      s.h = n % 2 ? 4 : 6;
      s.h_k = n % 2 ? 1 : 3;
      s.dtype = n % 2 ? DType::f16 : DType::bf16;
      switch (n % 6) {
        case 1: s.causal = true; break;
        case 2: s.window_left = 90; s.window_right = 17; break;
        case 3: s.softcap = 20.0f; s.alibi = true; s.causal = true; break;
        case 4: s.dropout_p = 0.15f; break;
        default: break;
      }
      out.push_back(s);
      ++n;
    }
  // hdim 64 under causal-like masks: the 128-row short_band variant up to 2048 query rows (a window,
  // GQA, a head dim of 32 inside the bucket, whose TMA store writes half of each box), the 192-row
  // one above; hdim 128's short_band (the narrow diagonal step) up to 8192 rows: 2600 of them, and
  // keys beyond the rows (the diagonal then falls inside key tiles, not at their start).
  struct Band {
    int sq, sk, d, window_left, window_right;  // no window: causal
  };
  for (const Band& c : {Band{1031, 1031, 64, -1, -1}, Band{300, 633, 32, -1, -1}, Band{1031, 1100, 64, 90, 17},
                        Band{2100, 2100, 64, -1, -1}, Band{2600, 2600, 128, -1, -1}, Band{700, 1000, 128, -1, -1}}) {
    Shape s = shape_of(c.d == 32 ? DType::f16 : DType::bf16, 1, c.sq, c.sk, 6, 3, c.d);
    s.causal = c.window_right < 0;
    s.window_left = c.window_left;
    s.window_right = c.window_right;
    out.push_back(s);
  }
  // hdim 128 over >= kLongKeys unmasked keys: the 160-key long_keys variant (a last step of 36 or 128
  // keys, GQA, fp16 and bf16); hdim 96's plain kernel over 4099 keys (a query block of one row); and
  // varlen (O from registers; a sequence of 50 keys and one without queries in the same launch).
  out.push_back(shape_of(DType::bf16, 2, 300, 2116, 4, 4, 128));
  out.push_back(shape_of(DType::f16, 2, 129, 4099, 4, 1, 96));
  out.push_back(shape_of(DType::f16, 2, 200, 2048, 4, 4, 128));
  Shape lv = shape_of(DType::bf16, 4, 0, 0, 4, 2, 128);
  lv.varlen = true;
  lv.lens_q = {100, 70, 0, 300};
  lv.lens_k = {2100, 50, 9, 2049};
  out.push_back(lv);
  // The hdim-96 and hdim-192 buckets (products over 96 columns of a 128-column layout, the plain
  // kernel's 192-row tiles of 96-key steps; 112-key steps with O from registers): plain, causal (the
  // short_band variant's narrow diagonal step; at hdim 96 above 2048 rows the plain kernel's mask),
  // short unmasked hdim 96 (short_band), a window, dropout at 96 (the score-modifier variant), head
  // dims inside the buckets (80, 160), GQA, ragged last key steps, both dtypes.
  struct Bucket {
    DType t;
    int sq, sk, d, window_left, window_right;  // window_right 0, window_left -1: causal
    float dropout_p;
  };
  for (const Bucket& c : {Bucket{DType::bf16, 1031, 1031, 96, -1, 0, 0.0f}, Bucket{DType::f16, 700, 1100, 96, -1, -1, 0.0f},
                          Bucket{DType::bf16, 300, 633, 80, -1, -1, 0.0f}, Bucket{DType::f16, 257, 400, 96, -1, -1, 0.2f},
                          Bucket{DType::bf16, 1031, 1031, 192, -1, 0, 0.0f}, Bucket{DType::f16, 700, 1100, 192, -1, -1, 0.0f},
                          Bucket{DType::bf16, 300, 633, 160, -1, -1, 0.0f}, Bucket{DType::f16, 1031, 1100, 192, 90, 17, 0.0f},
                          Bucket{DType::bf16, 2100, 2100, 192, -1, 0, 0.0f}, Bucket{DType::bf16, 1300, 1500, 96, -1, -1, 0.0f},
                          Bucket{DType::f16, 2100, 2100, 96, -1, 0, 0.0f}}) {
    Shape s = shape_of(c.t, 1, c.sq, c.sk, 6, 2, c.d);
    s.window_left = c.window_left;
    s.window_right = c.window_right;
    s.dropout_p = c.dropout_p;
    out.push_back(s);
  }
  // The score-modifier kernels of hdim 192 and of hdim 256 (64-row blocks whose consumers split O's
  // columns): softcap and ALiBi under a causal mask, dropout over ragged key steps, a head dim inside
  // the bucket.
  for (int d : {192, 256}) {
    Shape mods = shape_of(DType::bf16, 1, 700, 900, 6, 2, d);
    mods.causal = true;
    mods.softcap = 15.0f;
    mods.alibi = true;
    out.push_back(mods);
    Shape drop = shape_of(DType::f16, 1, 300, 633, 4, 4, d == 192 ? 160 : 224);
    drop.dropout_p = 0.15f;
    out.push_back(drop);
  }
  Shape capped = shape_of(DType::f16, 2, 257, 400, 4, 1, 256);
  capped.softcap = 30.0f;
  out.push_back(capped);
  return out;
}

using PathCase = std::tuple<Shape, flashmonoid::CudaPath>;
class CudaForward : public ::testing::TestWithParam<PathCase> {};

TEST_P(CudaForward, MatchesFloat64Reference) {
  SKIP_WITHOUT_GPU();
  const auto& [s, path] = GetParam();
  if (path == flashmonoid::CudaPath::sm90 && !sm90_runs(s)) GTEST_SKIP() << "not an sm90 shape or device";
  Problem pb(s);
  check_against_reference(pb, gpu_forward(pb, 1, path));
}

std::string name_of(const ::testing::TestParamInfo<Shape>& info) { return "case" + std::to_string(info.index); }
std::string path_case_name(const ::testing::TestParamInfo<PathCase>& info) {
  const bool sm90 = std::get<1>(info.param) == flashmonoid::CudaPath::sm90;
  return std::string(sm90 ? "sm90_" : "sm80_") + "case" + std::to_string(info.index / 2);
}
INSTANTIATE_TEST_SUITE_P(Grid, CudaForward,
                         ::testing::Combine(::testing::ValuesIn(gpu_grid()),
                                            ::testing::Values(flashmonoid::CudaPath::sm80, flashmonoid::CudaPath::sm90)),
                         path_case_name);
INSTANTIATE_TEST_SUITE_P(Hopper, CudaForward,
                         ::testing::Combine(::testing::ValuesIn(sm90_grid()),
                                            ::testing::Values(flashmonoid::CudaPath::sm80, flashmonoid::CudaPath::sm90)),
                         path_case_name);

// The sm90 forward's grid: persistent (one block per SM, less ctx.sm_margin) or one block per work
// unit (ctx.persistent_kernels = false, as the ring runs it beside an exchange). Without the split
// tail (no workspace) a block computes its tiles the same way wherever they land, so every grid
// gives the same bits.
std::vector<Shape> grid_shapes() {
  std::vector<Shape> shapes;
  for (int n = 0; n < 3; ++n) {
    Shape s;
    s.b = 2;
    s.s_q = n == 2 ? 1500 : 700;
    s.s_k = n == 1 ? 1100 : s.s_q;
    s.h = 6;
    s.h_k = n == 0 ? 6 : 2;
    s.d = n == 0 ? 64 : n == 1 ? 128 : 256;
    s.dtype = DType::bf16;
    s.causal = n != 1;
    shapes.push_back(s);
  }
  return shapes;
}

TEST(CudaForwardGrid, PersistentPerTileAndMarginGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  for (const Shape& s : grid_shapes()) {
    if (!sm90_runs(s)) GTEST_SKIP() << "not an sm90 device";
    Problem pb(s);
    const GpuResult base = gpu_forward(pb, 1, flashmonoid::CudaPath::sm90, {}, false);
    check_against_reference(pb, base);
    Context per_tile, margin;
    per_tile.persistent_kernels = false;
    margin.sm_margin = 100;
    for (const Context& ctx : {per_tile, margin}) {
      const GpuResult g = gpu_forward(pb, 1, flashmonoid::CudaPath::sm90, ctx, false);
      EXPECT_TRUE(g.out.buf == base.out.buf) << "out differs, d " << s.d;
      EXPECT_TRUE(g.lse.buf == base.lse.buf) << "lse differs, d " << s.d;
    }
  }
}

// The split tail (block_range.cuh: WorkTiles): grids whose last round the units leave partial cut
// the tail units at key steps and merge the pieces across blocks. Grids of 5..31 blocks (margins)
// cut these shapes' 36-72 units (varied remainders, pairs cut inside either tile, blocks with one
// to three pieces): every output within the FlashAttention rule, the same bits on a second run (a
// new epoch), and on graph replays (the same epoch again: the flags must have been set back).
TEST(CudaForwardGrid, SplitTailMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // The split tail runs in the hdim-64 plain and score-modifier kernels (tile_fwd_sm90.hpp:
  // fwd_split_tail): the plain one causal past the short_band kernel's 2048 rows (2200: 12 tiles of
  // 192 rows, of 1-12 key steps) and non-causal (700 x 1100), the score-modifier one (softcap).
  std::vector<Shape> shapes = {grid_shapes()[0], grid_shapes()[1], grid_shapes()[1]};
  shapes[0].s_q = shapes[0].s_k = 2200;
  shapes[0].h = shapes[0].h_k = 3;
  shapes[1].d = shapes[2].d = 64;
  shapes[2].softcap = 30.0f;
  for (const Shape& s : shapes) {
    if (!sm90_runs(s)) GTEST_SKIP() << "not an sm90 device";
    Problem pb(s);
    {
      // gpu_forward passes forward_workspace_size's bytes: with none the tail would not be split.
      DeviceTensor q(pb.q), k(pb.k);
      ASSERT_GT(flashmonoid::forward_workspace_size(q.view, k.view, pb.opt), 0u) << "hdim 64 on sm90 splits the tail";
    }
    for (int grid : {5, 7, 13, 31}) {
      Context ctx;
      ctx.sm_margin = sms - grid;
      const GpuResult g = gpu_forward(pb, 1, flashmonoid::CudaPath::sm90, ctx);
      SCOPED_TRACE("d " + std::to_string(s.d) + " causal " + std::to_string(s.causal) + " grid " + std::to_string(grid));
      check_against_reference(pb, g);
      const GpuResult again = gpu_forward(pb, 1, flashmonoid::CudaPath::sm90, ctx);
      EXPECT_TRUE(again.out.buf == g.out.buf) << "out differs between runs";
      EXPECT_TRUE(again.lse.buf == g.lse.buf) << "lse differs between runs";
    }
  }
}

// A grid larger than the SMs it gets: a green context of 16 SMs runs the hdim-64 causal forward (the
// plain kernel, past the short_band kernel's 2048 rows), whose persistent grid (132 blocks on the
// H100, the device's count) then runs in waves while its split tail's heads wait for other blocks'
// pieces. Those waits point at lower block indices, which
// start first (block_range.cuh: tail_position); had they pointed up, the 16 resident blocks would
// wait for blocks that cannot start, and this test would hang.
TEST(CudaForwardGrid, SplitTailInAGreenContextOfFewSms) {
  SKIP_WITHOUT_GPU();
  Shape s;
  s.b = 1;
  s.s_q = s.s_k = 3072;  // 16 tiles of 192 rows per head: 144 units, a split tail of 144 on 132 blocks
  s.h = s.h_k = 9;
  s.d = 64;
  s.dtype = DType::bf16;
  s.causal = true;
  if (!sm90_runs(s)) GTEST_SKIP() << "not an sm90 device";
  auto entry = [](const char* name, int version) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion(name, &f, version, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return f;
  };
  auto get_resource = reinterpret_cast<decltype(&cuDeviceGetDevResource)>(entry("cuDeviceGetDevResource", 12040));
  auto split = reinterpret_cast<decltype(&cuDevSmResourceSplitByCount)>(entry("cuDevSmResourceSplitByCount", 12040));
  auto make_desc = reinterpret_cast<decltype(&cuDevResourceGenerateDesc)>(entry("cuDevResourceGenerateDesc", 12040));
  auto create = reinterpret_cast<decltype(&cuGreenCtxCreate)>(entry("cuGreenCtxCreate", 12040));
  auto create_stream = reinterpret_cast<decltype(&cuGreenCtxStreamCreate)>(entry("cuGreenCtxStreamCreate", 12050));
  auto destroy = reinterpret_cast<decltype(&cuGreenCtxDestroy)>(entry("cuGreenCtxDestroy", 12040));
  if (!get_resource || !split || !make_desc || !create || !create_stream || !destroy)
    GTEST_SKIP() << "the driver has no green contexts";
  int dev = 0;
  cuda_ok(cudaGetDevice(&dev));
  cuda_ok(cudaFree(nullptr));  // the primary context, which the green context shares memory with
  CUdevResource all{}, part{}, rest{};
  unsigned groups = 1;
  ASSERT_EQ(get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM), CUDA_SUCCESS);
  ASSERT_EQ(split(&part, &groups, &all, &rest, 0, 16), CUDA_SUCCESS);
  ASSERT_EQ(groups, 1u);
  int sms = 0;
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  ASSERT_LT(static_cast<int>(part.sm.smCount), sms / 2) << "the green context must hold far fewer SMs than the grid";
  CUdevResourceDesc desc{};
  ASSERT_EQ(make_desc(&desc, &part, 1), CUDA_SUCCESS);
  CUgreenCtx green{};
  ASSERT_EQ(create(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), CUDA_SUCCESS);
  CUstream stream{};
  ASSERT_EQ(create_stream(&stream, green, CU_STREAM_NON_BLOCKING, 0), CUDA_SUCCESS);

  Problem pb(s);
  DeviceTensor q(pb.q), k(pb.k), v(pb.v);
  GpuResult r{pb.new_out(), pb.new_lse()};
  DeviceTensor out(r.out), lse(r.lse);  // NaN-poisoned
  const std::size_t ws = flashmonoid::forward_workspace_size(q.view, k.view, pb.opt);
  ASSERT_GT(ws, 0u) << "hdim 64 on sm90 takes the split tail's workspace";
  DeviceBuffer work(ws);
  Context ctx;
  ctx.workspace = work.ptr;
  ctx.workspace_bytes = ws;
  ctx.cuda_path = flashmonoid::CudaPath::sm90;
  ctx.stream = stream;
  flashmonoid::forward(q.view, k.view, v.view, out.view, lse.view, pb.opt, ctx);
  cuda_ok(cudaStreamSynchronize(stream));
  out.copy_to(r.out);
  lse.copy_to(r.lse);
  check_against_reference(pb, r);
  cuda_ok(cudaStreamDestroy(stream));
  EXPECT_EQ(destroy(green), CUDA_SUCCESS);
}

// The split tail's assignment of pieces (block_range.cuh: tail_position, tail_piece, tail_slot), run
// on the host as the kernel's producer runs it, over random tails: grids of 2-140 blocks, units of
// one or two tiles (causal pairs) with random step counts, some tiles without keys. Every key step of
// every tile is computed exactly once; a cut tile has one head and one tail piece with the same slot,
// the head's block; the tail's block is the head's minus one, so a block waits only for a lower
// block index; and no block holds a head piece (which waits) before its tail piece (waited for).
TEST(SplitTail, PiecesCoverEveryStepOnceAndWaitOnlyDownward) {
  std::mt19937 rng(20261127);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int cut = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int grid = uniform(2, 140), units = uniform(grid + 1, 6 * grid), tpu = uniform(1, 2);
    if (units % grid == 0) continue;
    const int tail_units = flashmonoid::cuda::split_tail_units(units, grid), steps_max = uniform(1, 40);
    ASSERT_GT(tail_units, grid);
    ASSERT_LT(tail_units, 2 * grid);
    std::vector<std::vector<int>> counts(tail_units);  // key steps of each tail unit's tiles
    for (auto& c : counts) {
      c.push_back(uniform(0, steps_max));
      if (tpu == 2 && uniform(0, 9) > 0) c.push_back(uniform(0, steps_max));
    }
    struct Piece {
      int block, step_begin, step_end, slot;
      flashmonoid::cuda::TailRole role;
    };
    std::vector<std::vector<std::vector<Piece>>> pieces(tail_units, std::vector<std::vector<Piece>>(2));
    std::vector<std::vector<flashmonoid::cuda::TailRole>> order(grid);  // each block's roles, in its order
    for (int block = 0; block < grid; ++block)
      for (int k = 0; k < 3 * tpu; ++k) {
        flashmonoid::cuda::TailPosition at;
        if (!flashmonoid::cuda::tail_position(tail_units, grid, block, tpu, k, &at)) break;
        ASSERT_LT(at.i, tail_units);
        const std::vector<int>& c = counts[at.i];
        if (at.x >= static_cast<int>(c.size())) continue;
        const int na = c[0], nb = c.size() > 1 ? c[1] : 0;
        flashmonoid::cuda::TailPiece p;
        if (!flashmonoid::cuda::tail_piece(at.x == 0 ? 0 : na, at.x == 0 ? na : nb, na + nb, at.lo, at.hi, grid, &p))
          continue;
        pieces[at.i][at.x].push_back({block, p.step_begin, p.step_end, flashmonoid::cuda::tail_slot(block, p.role), p.role});
        order[block].push_back(p.role);
      }
    using flashmonoid::cuda::TailRole;
    for (int i = 0; i < tail_units; ++i)
      for (int x = 0; x < static_cast<int>(counts[i].size()); ++x) {
        const auto& ps = pieces[i][x];
        const int count = counts[i][x];
        SCOPED_TRACE("trial " + std::to_string(trial) + " unit " + std::to_string(i) + " tile " + std::to_string(x));
        if (count == 0) {
          ASSERT_EQ(ps.size(), 1u);
          EXPECT_EQ(ps[0].role, TailRole::whole);
          continue;
        }
        std::vector<int> seen(count, 0);
        for (const Piece& p : ps)
          for (int j = p.step_begin; j < p.step_end; ++j) ++seen[j];
        EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), count) << "every step once";
        if (ps.size() == 1) {
          EXPECT_EQ(ps[0].role, TailRole::whole);
          continue;
        }
        ASSERT_EQ(ps.size(), 2u);
        const Piece& head = ps[0].role == TailRole::head ? ps[0] : ps[1];
        const Piece& tail = ps[0].role == TailRole::head ? ps[1] : ps[0];
        ASSERT_EQ(head.role, TailRole::head);
        ASSERT_EQ(tail.role, TailRole::tail);
        EXPECT_EQ(head.step_begin, 0);
        EXPECT_EQ(tail.step_end, count);
        EXPECT_EQ(head.slot, head.block);
        EXPECT_EQ(tail.slot, head.slot);
        EXPECT_EQ(tail.block, head.block - 1);
        ++cut;
      }
    for (const auto& roles : order) {
      const auto head = std::find(roles.begin(), roles.end(), TailRole::head);
      const auto tail = std::find(roles.begin(), roles.end(), TailRole::tail);
      EXPECT_LE(std::count(roles.begin(), roles.end(), TailRole::head), 1);
      EXPECT_LE(std::count(roles.begin(), roles.end(), TailRole::tail), 1);
      if (head != roles.end() && tail != roles.end()) EXPECT_LT(tail - roles.begin(), head - roles.begin());
    }
  }
  EXPECT_GT(cut, 10000);  // the trials do cut tiles
}

TEST(CudaForwardGrid, SplitTailReplaysInAGraph) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Shape s = grid_shapes()[1];
  s.d = 64;
  if (!sm90_runs(s)) GTEST_SKIP() << "not an sm90 device";
  Problem pb(s);
  DeviceTensor q(pb.q), k(pb.k), v(pb.v);
  GpuResult r{pb.new_out(), pb.new_lse()};
  DeviceTensor out(r.out), lse(r.lse);
  const std::size_t ws = flashmonoid::forward_workspace_size(q.view, k.view, pb.opt);
  DeviceBuffer work(ws);
  Context ctx;
  ctx.workspace = work.ptr;
  ctx.workspace_bytes = ws;
  ctx.sm_margin = sms - 7;
  ctx.cuda_path = flashmonoid::CudaPath::sm90;
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ctx.stream = stream;
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  flashmonoid::forward(q.view, k.view, v.view, out.view, lse.view, pb.opt, ctx);
  cuda_ok(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    r.out.poison();
    r.lse.poison();
    out.copy_from(r.out);
    lse.copy_from(r.lse);
    cuda_ok(cudaGraphLaunch(exec, stream));
    cuda_ok(cudaStreamSynchronize(stream));
    out.copy_to(r.out);
    lse.copy_to(r.lse);
    SCOPED_TRACE("replay " + std::to_string(replay));
    check_against_reference(pb, r);
  }
  cuda_ok(cudaGraphExecDestroy(exec));
  cuda_ok(cudaGraphDestroy(graph));
  cuda_ok(cudaStreamDestroy(stream));
}

// The automatic choice: sm90 for prefill shapes on Hopper, reported by supports().
TEST(CudaForwardPath, SupportsNamesThePathThatRuns) {
  SKIP_WITHOUT_GPU();
  Shape s;
  s.b = 1;
  s.s_q = 300;
  s.s_k = 300;
  s.h = 2;
  s.h_k = 2;
  s.d = 128;
  s.dtype = DType::bf16;
  Problem pb(s);
  DeviceTensor q(pb.q), k(pb.k);
  const auto sup = flashmonoid::supports(q.view, k.view);
  ASSERT_TRUE(sup.ok) << sup.reason;
  EXPECT_EQ(sup.path, sm90_runs(s) ? "cuda-sm90" : "cuda-sm80");
}

// Decoding shapes: s_q of 1..4 over long s_k, GQA 32/8 (packed into one block's rows), with the
// heuristic's splits, forced splits and no split; causal and windows cut splits to nothing.
std::vector<Shape> decode_grid() {
  std::vector<Shape> out;
  const int sks[] = {1, 100, 4097, 20000};
  int n = 0;
  for (int sk : sks)
    for (int sq : {1, 3}) {
      Shape s;
      s.b = sk > 5000 ? 1 : 3;
      s.s_q = sq;
      s.s_k = sk;
      s.h = 32;
      s.h_k = 8;
      s.d = n % 3 == 2 ? 64 : 128;
      s.dtype = n % 2 ? DType::f16 : DType::bf16;
      if (n % 4 == 1) s.causal = true;
      if (n % 4 == 3) s.window_left = 700;
      if (n == 5) s.alibi = true;
      out.push_back(s);
      ++n;
    }
  Shape v;  // varlen decoding with one empty KV
  v.varlen = true;
  v.b = 4;
  v.lens_q = {1, 1, 2, 1};
  v.lens_k = {3000, 0, 9000, 1};
  v.h = 16;
  v.h_k = 4;
  v.d = 128;
  v.dtype = DType::bf16;
  out.push_back(v);
  // Used lengths: decoding rows in padded slots (seqused_q runs unsplit whatever num_splits asks; the
  // rows past the used ones keep their poison), long and empty key ranges.
  Shape u = v;
  u.lens_q = {4, 4, 4, 4};
  u.lens_k = {9000, 64, 3000, 10};
  u.used_q = {1, 0, 2, 1};
  u.used_k = {3000, 0, 2999, 1};
  out.push_back(u);
  return out;
}

class CudaSplitKV : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaSplitKV, HeuristicForcedAndUnsplitMatchReference) {
  SKIP_WITHOUT_GPU();
  Problem pb(GetParam());
  // 7: the combine's warp-per-row form (common/combine.cuh); 128 and 300 (past the heuristic's cap,
  // kMaxSplits): its block-per-row form over several batches per warp, many splits empty (lse -inf).
  for (int splits : {0, 1, 7, 128, 300}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    check_against_reference(pb, gpu_forward(pb, splits));
  }
}
INSTANTIATE_TEST_SUITE_P(Decode, CudaSplitKV, ::testing::ValuesIn(decode_grid()), name_of);

// With q = 0 every visible score is equal, so P = 1/s_k, and with V = I (s_k = d) the output is
// out[i][c] = keep(i, c) / ((1 - p) · s_k): the GPU's keep-mask can be read off and compared with
// detail::dropout_keep element by element.
TEST(CudaDropout, KeepMaskIsBitIdenticalToPhilox) {
  SKIP_WITHOUT_GPU();
  for (auto [d, path] : {std::pair{64, flashmonoid::CudaPath::sm80}, {256, flashmonoid::CudaPath::sm80},
                         {64, flashmonoid::CudaPath::sm90}, {256, flashmonoid::CudaPath::sm90}}) {
    Shape s;
    s.b = 2;
    s.s_q = 70;
    s.s_k = d;
    s.h = 3;
    s.h_k = 3;
    s.d = d;
    s.dtype = DType::bf16;
    s.dropout_p = 0.4f;
    s.padded_strides = false;
    if (path == flashmonoid::CudaPath::sm90 && !sm90_runs(s)) continue;
    Problem pb(s);
    for (std::int64_t i = 0; i < pb.q.numel(); ++i) pb.q.set(i, 0.0f);
    for (std::int64_t i = 0; i < pb.v.numel(); ++i) pb.v.set(i, (i / (d * s.h_k)) % s.s_k == i % d ? 1.0f : 0.0f);
    GpuResult g = gpu_forward(pb, 1, path);
    const std::uint32_t thr = flashmonoid::detail::dropout_threshold(s.dropout_p);
    int mismatches = 0;
    for (int b = 0; b < s.b; ++b)
      for (int i = 0; i < s.s_q; ++i)
        for (int h = 0; h < s.h; ++h)
          for (int c = 0; c < d; ++c) {
            const float o = g.out.get(((static_cast<std::int64_t>(b) * s.s_q + i) * s.h + h) * d + c);
            const auto row_id = static_cast<std::uint32_t>(h * (s.b * s.s_q) + b * s.s_q + i);
            const bool keep = flashmonoid::detail::dropout_keep(pb.opt.dropout_seed, pb.opt.dropout_offset, thr,
                                                                row_id, static_cast<std::uint32_t>(c));
            if ((o > 0.0f) != keep) ++mismatches;
          }
    EXPECT_EQ(mismatches, 0) << "d " << d << (path == flashmonoid::CudaPath::sm90 ? " sm90" : " sm80");
  }
}

// merge() of n parts on the GPU equals the CPU merge of the same parts; parts with lse = -inf
// (and garbage out) contribute nothing; 70 parts exercise the chunked fold.
TEST(CudaMerge, MatchesCpuMerge) {
  SKIP_WITHOUT_GPU();
  for (int n : {1, 3, 70}) {
    const int b = 2, sq = 33, h = 3, d = 72;
    std::vector<HostTensor> outs, lses;
    for (int i = 0; i < n; ++i) {
      outs.emplace_back(i % 2 ? DType::bf16 : DType::f32, std::vector<std::int64_t>{b, sq, h, d});
      outs.back().fill_normal();
      lses.emplace_back(DType::f32, std::vector<std::int64_t>{b, h, sq});
      lses.back().fill_normal(3.0);
      if (i == 1)
        for (std::int64_t e = 0; e < lses.back().numel(); e += 3) lses.back().set(e, -INFINITY);
    }
    HostTensor cpu_o(DType::f32, {b, sq, h, d}), cpu_l(DType::f32, {b, h, sq});
    std::vector<TensorView> ov, lv;
    for (int i = 0; i < n; ++i) {
      ov.push_back(outs[i].view);
      lv.push_back(lses[i].view);
    }
    flashmonoid::merge(ov, lv, cpu_o.view, cpu_l.view);

    std::vector<std::unique_ptr<DeviceTensor>> dev;
    std::vector<TensorView> dov, dlv;
    for (int i = 0; i < n; ++i) {
      dev.push_back(std::make_unique<DeviceTensor>(outs[i]));
      dov.push_back(dev.back()->view);
      dev.push_back(std::make_unique<DeviceTensor>(lses[i]));
      dlv.push_back(dev.back()->view);
    }
    HostTensor go(DType::f32, {b, sq, h, d}), gl(DType::f32, {b, h, sq});
    go.poison();
    gl.poison();
    DeviceTensor dgo(go), dgl(gl);
    flashmonoid::merge(dov, dlv, dgo.view, dgl.view);
    cuda_ok(cudaDeviceSynchronize());
    dgo.copy_to(go);
    dgl.copy_to(gl);
    EXPECT_LE(max_abs_diff(go.values(), cpu_o.values()), 1e-5 * std::max(1.0, max_abs(cpu_o.values()))) << n;
    EXPECT_LE(max_abs_diff(gl.values(), cpu_l.values()), 1e-5 * std::max(1.0, max_abs(cpu_l.values()))) << n;
  }
}

// Clear errors instead of launch failures.
TEST(CudaForwardErrors, HostPointerMisalignmentDtypeAndHeadDim) {
  SKIP_WITHOUT_GPU();
  Shape s;
  s.b = 1;
  s.s_q = 16;
  s.s_k = 16;
  s.h = 2;
  s.h_k = 2;
  s.d = 64;
  s.dtype = DType::bf16;
  s.padded_strides = false;
  Problem pb(s);
  DeviceTensor q(pb.q), k(pb.k), v(pb.v);
  HostTensor ho = pb.new_out(), hl = pb.new_lse();
  DeviceTensor out(ho), lse(hl);

  TensorView host_k = k.view;  // claims cuda, points at host memory
  host_k.data = pb.k.view.data;
  try {
    flashmonoid::forward(q.view, host_k, v.view, out.view, lse.view);
    ADD_FAILURE() << "host pointer accepted";
  } catch (const flashmonoid::Error& e) {
    EXPECT_EQ(e.argument(), "k") << e.what();
  }

  DeviceBuffer raw(q.bytes + 64);
  TensorView odd_q = q.view;  // 2 bytes off a 16-byte boundary
  odd_q.data = static_cast<char*>(raw.ptr) + 2;
  try {
    flashmonoid::forward(odd_q, k.view, v.view, out.view, lse.view);
    ADD_FAILURE() << "misaligned q accepted";
  } catch (const flashmonoid::Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
  }

  Shape s2 = s;
  s2.d = 60;  // not a multiple of 8
  Problem pb2(s2);
  DeviceTensor q2(pb2.q), k2(pb2.k), v2(pb2.v);
  HostTensor ho2 = pb2.new_out(), hl2 = pb2.new_lse();
  DeviceTensor out2(ho2), lse2(hl2);
  EXPECT_THROW(flashmonoid::forward(q2.view, k2.view, v2.view, out2.view, lse2.view), flashmonoid::NotSupported);
  const auto sup = flashmonoid::supports(q2.view, k2.view);
  EXPECT_FALSE(sup.ok);
  EXPECT_NE(sup.reason.find("multiple of 8"), std::string::npos) << sup.reason;
}

}  // namespace
}  // namespace fmtest
