// Ring attention on the CPU: P simulated ranks (threads of this process, LocalTransport) run the
// same driver, schedule, step order and merges as the NCCL path. The whole sequence is sharded,
// the ring's gathered (out, lse) and (dq, dk, dv) are held to the FlashAttention rule against the
// float64 reference of single-device attention on the whole sequence. The schedule itself is
// checked pair by pair: its tasks compute every visible (query, key) pair exactly once and no other.
#include <omp.h>

#include <exception>
#include <thread>

#include "attention_case.hpp"
#include "dist/local_transport.hpp"
#include "dist/ring.hpp"
#include "ring_shards.hpp"

namespace fmtest {
namespace {

namespace dist = flashmonoid::dist;
using flashmonoid::Context;
using flashmonoid::cpu::Precision;
using dist::Layout;

struct RingCase {
  Shape shape;  // s_q = s_k = the whole sequence
  int world = 2;
  Layout layout = Layout::contiguous;
  std::optional<float> softmax_scale;
  std::string str() const {
    std::string s = "P" + std::to_string(world) + " " + dist::to_string(layout) + " " + shape.str();
    if (softmax_scale) s += " scale" + std::to_string(*softmax_scale);
    return s;
  }
};

void PrintTo(const RingCase& c, std::ostream* os) { *os << c.str(); }

dist::RingSchedule schedule_of(const RingCase& c, const flashmonoid::Options& o) {
  return dist::make_schedule(c.world, c.shape.s_q, c.layout, o);
}

// Runs fn(rank, transport) on P threads sharing one LocalRing; rethrows the first failure.
template <class Fn>
void run_ranks(int world, Fn fn) {
  dist::LocalRing ring(world);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      omp_set_num_threads(1);  // P ranks share the machine's cores
      dist::LocalTransport tr(ring, r);
      try {
        fn(r, tr);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

Context cpu_ctx(std::vector<std::uint8_t>& ws, std::size_t bytes) {
  ws.assign(bytes, 0xff);  // poisoned scratch
  Context c;
  c.workspace = ws.data();
  c.workspace_bytes = bytes;
  c.num_threads = 1;
  return c;
}

class RingAttention : public ::testing::TestWithParam<RingCase> {};

TEST_P(RingAttention, ForwardAndBackwardMatchFloat64ReferenceOnWholeSequence) {
  const RingCase& c = GetParam();
  Problem pb(c.shape);
  pb.opt.softmax_scale = c.softmax_scale;
  const dist::RingSchedule sched = schedule_of(c, pb.opt);

  HostTensor out = pb.new_out(), lse = pb.new_lse();
  auto [ref_o, ref_l] = pb.reference(Precision::f64);
  HostTensor dq = pb.new_out(), dk = pb.new_like_kv(), dv = pb.new_like_kv();
  run_ranks(c.world, [&](int r, dist::Transport& tr) {
    const auto segs = sched.segments(r);
    const std::int64_t n = sched.local_len(r);
    HostTensor q = shard(pb.q, segs, n), k = shard(pb.k, segs, n), v = shard(pb.v, segs, n);
    HostTensor o(c.shape.dtype, {c.shape.b, n, c.shape.h, c.shape.d}), l(DType::f32, {c.shape.b, c.shape.h, n});
    o.poison();
    l.poison();
    dist::CpuOps ops;
    std::vector<std::uint8_t> ws;
    dist::ring_forward(q.view, k.view, v.view, o.view, l.view, pb.opt, sched, tr, ops,
                       cpu_ctx(ws, dist::ring_forward_workspace_size(q.view, k.view, pb.opt, sched, r)));
    // The backward gets the reference (out, lse), as the single-device backward tests do.
    HostTensor dout = shard(pb.dout, segs, n), ro = shard(ref_o, segs, n), rl = shard_lse(ref_l, segs, n);
    HostTensor gq(c.shape.dtype, {c.shape.b, n, c.shape.h, c.shape.d});
    HostTensor gk(c.shape.dtype, {c.shape.b, n, c.shape.h_k, c.shape.d}), gv = gk;
    gv.view.data = gv.buf.data();
    for (auto* g : {&gq, &gk, &gv}) g->poison();
    dist::ring_backward(dout.view, q.view, k.view, v.view, ro.view, rl.view, gq.view, gk.view, gv.view, pb.opt, sched,
                        tr, ops, cpu_ctx(ws, dist::ring_backward_workspace_size(q.view, k.view, pb.opt, sched, r)));
    unshard(out, o, segs);  // disjoint rows per rank
    unshard_lse(lse, l, segs);
    unshard(dq, gq, segs);
    unshard(dk, gk, segs);
    unshard(dv, gv, segs);
  });

  auto [lp_o, lp_l] = pb.reference(Precision::input);
  expect_close("out", c.shape.dtype, out.values(), ref_o.values(), lp_o.values());
  EXPECT_LE(max_abs_diff(lse.values(), ref_l.values()), 1e-5 * std::max(1.0, max_abs(ref_l.values()))) << "lse";
  auto ref = pb.reference_backward(ref_o, ref_l, Precision::f64);
  auto lp = pb.reference_backward(ref_o, ref_l, Precision::input);
  expect_close("dq", c.shape.dtype, dq.values(), ref.dq.values(), lp.dq.values());
  expect_close("dk", c.shape.dtype, dk.values(), ref.dk.values(), lp.dk.values());
  expect_close("dv", c.shape.dtype, dv.values(), ref.dv.values(), lp.dv.values());
}

// Every P of the issue (and P = 1), both layouts with and without causal, GQA and MQA, odd lengths that no
// chunk count divides, windows, softcap, an explicit scale and each dtype.
std::vector<RingCase> ring_grid() {
  std::vector<RingCase> out;
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  const int seqlens[] = {67, 45, 101, 29};
  int n = 0;
  for (int world : {2, 3, 4, 8}) {
    for (int variant = 0; variant < 6; ++variant) {
      RingCase c;
      c.world = world;
      Shape& s = c.shape;
      s.s_q = s.s_k = seqlens[n % 4] + (world == 8 ? 20 : 0);
      s.b = n % 3 == 0 ? 2 : 1;
      s.h = n % 2 ? 4 : 3;
      s.h_k = n % 2 ? 2 : 1;
      s.d = n % 2 ? 32 : 40;
      s.dtype = dtypes[n % 3];
      switch (variant) {
        case 0: s.causal = true; c.layout = Layout::zigzag; break;
        case 1: c.layout = Layout::contiguous; break;
        case 2: s.causal = true; s.window_left = 9; c.layout = Layout::zigzag; s.softcap = 3.0f; break;
        case 3: s.window_left = 7; s.window_right = 4; c.layout = Layout::contiguous; c.softmax_scale = 0.3f; break;
        case 4: s.causal = true; c.layout = Layout::contiguous; break;  // skipped steps without zigzag
        case 5: s.causal = true; s.window_left = 5; c.layout = Layout::contiguous; break;  // the ring stops early
      }
      out.push_back(c);
      ++n;
    }
  }
  RingCase one;  // a ring of one: no exchange at all
  one.world = 1;
  one.layout = Layout::zigzag;
  one.shape.s_q = one.shape.s_k = 33;
  one.shape.h = 2;
  one.shape.d = 32;
  one.shape.causal = true;
  out.push_back(one);
  return out;
}

std::string name_of(const ::testing::TestParamInfo<RingCase>& info) {
  std::string s = std::to_string(info.index) + "_" + info.param.str();
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Grid, RingAttention, ::testing::ValuesIn(ring_grid()), name_of);

// The schedule, pair by pair: under each task's own (bottom-right) mask, the tasks of all ranks and
// steps cover every (query, key) pair the global mask shows exactly once and nothing else.
TEST(RingSchedule, TasksComputeEveryVisiblePairExactlyOnce) {
  struct Mask {
    int left, right;
  };
  const Mask masks[] = {{-1, -1}, {-1, 0}, {5, 0}, {3, 2}, {0, 0}, {40, -1}, {-1, 7}};
  for (int world : {1, 2, 3, 4, 5, 8})
    for (Layout layout : {Layout::contiguous, Layout::zigzag})
      for (std::int64_t S : {2 * world, 2 * world + 1, 37, 64, 77})
        for (const Mask& m : masks) {
          if (S < 2 * world) continue;
          dist::RingSchedule sched(world, S, layout, m.left, m.right);
          std::vector<int> seen(S * S, 0);
          for (int r = 0; r < world; ++r) {
            const auto qsegs = sched.segments(r);
            auto global = [](const std::vector<dist::Segment>& segs, std::int64_t local) {
              for (const auto& s : segs)
                if (local >= s.local_begin && local < s.local_begin + s.length) return s.global_begin + local - s.local_begin;
              return std::int64_t{-1};
            };
            for (const dist::Step& step : sched.steps(r)) {
              const auto ksegs = sched.segments(step.src);
              for (const auto& layer : step.layers)
                for (const dist::Task& t : layer) {
                  const std::int64_t nq = t.q_end - t.q_begin, nk = t.k_end - t.k_begin;
                  for (std::int64_t i = 0; i < nq; ++i)
                    for (std::int64_t j = 0; j < nk; ++j) {
                      const std::int64_t diag = j - i - (nk - nq);  // the library's bottom-right mask
                      if ((t.window_right >= 0 && diag > t.window_right) || (t.window_left >= 0 && -diag > t.window_left))
                        continue;
                      const std::int64_t gi = global(qsegs, t.q_begin + i), gj = global(ksegs, t.k_begin + j);
                      ASSERT_GE(gi, 0);
                      ASSERT_GE(gj, 0);
                      ++seen[gi * S + gj];
                    }
                }
            }
          }
          for (std::int64_t i = 0; i < S; ++i)
            for (std::int64_t j = 0; j < S; ++j) {
              const bool visible = (m.right < 0 || j - i <= m.right) && (m.left < 0 || i - j <= m.left);
              ASSERT_EQ(seen[i * S + j], visible ? 1 : 0)
                  << "P" << world << " " << dist::to_string(layout) << " S" << S << " window(" << m.left << ","
                  << m.right << ") query " << i << " key " << j;
            }
        }
}

// Zigzag gives every rank the same causal work at every step, and one call per step.
TEST(RingSchedule, ZigzagCausalIsBalancedWithOneCallPerStep) {
  for (int world : {2, 3, 4, 8}) {
    const std::int64_t c = 16, S = 2 * world * c;
    dist::RingSchedule sched(world, S, Layout::zigzag, -1, 0);
    for (int r = 0; r < world; ++r) {
      const auto steps = sched.steps(r);
      for (int t = 0; t < world; ++t) {
        ASSERT_EQ(steps[t].layers.size(), 1u);
        ASSERT_EQ(steps[t].layers[0].size(), 1u) << "P" << world << " rank " << r << " step " << t;
        const dist::Task& task = steps[t].layers[0][0];
        const std::int64_t area = (task.q_end - task.q_begin) * (task.k_end - task.k_begin);
        EXPECT_EQ(area, t == 0 ? 4 * c * c : 2 * c * c) << "P" << world << " rank " << r << " step " << t;
      }
    }
  }
}

TEST(RingSchedule, WindowSkipsStepsItEmpties) {
  dist::RingSchedule both(8, 800, Layout::contiguous, 30, 30);
  const auto steps = both.steps(4);
  int busy = 0;
  for (const auto& s : steps) busy += !s.empty();
  EXPECT_EQ(busy, 3);  // its own shard and both neighbours' (the right one arrives at step P-1)
  EXPECT_EQ(both.num_steps(), 8);
  // Causal with a window of 150 over shards of 100: three steps, then dK/dV go 6 ranks on (2 back).
  dist::RingSchedule left(8, 800, Layout::contiguous, 150, 0);
  EXPECT_EQ(left.num_steps(), 3);
  EXPECT_EQ(left.home_shift(), 6);
  EXPECT_EQ(left.steps(0).size(), 3u);
  EXPECT_EQ(dist::RingSchedule(4, 40, Layout::contiguous, 0, 0).home_shift(), 0);  // one step: already home
}

TEST(RingErrors, NameTheArgumentAndTheRule) {
  dist::LocalRing ring(2);
  dist::LocalTransport tr(ring, 0);
  dist::CpuOps ops;
  flashmonoid::Options o;
  auto expect_error = [&](const std::string& arg, const std::string& words, auto fn) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << arg;
    } catch (const flashmonoid::Error& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_error("seqlen_total", "at least", [&] { dist::RingSchedule(4, 7, Layout::zigzag, -1, 0); });
  expect_error("world_size", ">= 1", [&] { dist::RingSchedule(0, 7, Layout::zigzag, -1, 0); });
  const dist::RingSchedule sched = dist::make_schedule(2, 11, Layout::contiguous, o);
  HostTensor q(DType::f32, {1, 6, 2, 8}), k(DType::f32, {1, 6, 2, 8}), out = q, lse(DType::f32, {1, 2, 6});
  out.view.data = out.buf.data();
  std::vector<std::uint8_t> ws;
  Context ctx = cpu_ctx(ws, 1 << 20);
  // Rank 0 of 11 tokens over 2 ranks holds rows [0, 5).
  expect_error("q", "needs 5 rows", [&] { dist::ring_forward(q.view, k.view, k.view, out.view, lse.view, o, sched, tr, ops, ctx); });
  HostTensor q5(DType::f32, {1, 5, 2, 8}), o5 = q5, l5(DType::f32, {1, 2, 5});
  o5.view.data = o5.buf.data();
  o.dropout_p = 0.1f;
  expect_error("options.dropout_p", "dropout", [&] { dist::ring_forward(q5.view, q5.view, q5.view, o5.view, l5.view, o, sched, tr, ops, ctx); });
  o.dropout_p = 0.0f;
  Context small = ctx;
  small.workspace_bytes = 16;
  expect_error("ctx.workspace", "needs", [&] { dist::ring_forward(q5.view, q5.view, q5.view, o5.view, l5.view, o, sched, tr, ops, small); });
}

}  // namespace
}  // namespace fmtest
