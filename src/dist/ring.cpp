#include "dist/ring.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "flashmonoid/attention.hpp"
#include "flashmonoid/error.hpp"

namespace flashmonoid::dist {
namespace {

[[noreturn]] void fail(const std::string& arg, const std::string& rule) { throw Error(arg, rule); }

// Sizes of one rank's problem.
struct Dims {
  std::int64_t b = 0, n = 0, n_max = 0, h = 0, h_k = 0, d = 0;
  DType dtype = DType::f32;
  Device device{};
  std::size_t es() const { return dtype_size(dtype); }
  // Bytes of a packed (k, v) shard of n rows, or of its fp32 gradients.
  std::size_t kv_bytes(std::int64_t rows, DType t) const {
    return 2 * static_cast<std::size_t>(b * rows * h_k * d) * dtype_size(t);
  }
};

Dims dims_of(const TensorView& q, const TensorView& k, const RingSchedule& s) {
  return {q.shape[0], q.shape[1], s.max_local_len(), q.shape[2], k.shape[2], q.shape[3], q.dtype, q.device};
}

void check_inputs(const TensorView& q, const TensorView& k, const TensorView& v, const Options& o,
                  const RingSchedule& s, int rank, int world) {
  if (world != s.world_size())
    fail("transport", "has " + std::to_string(world) + " ranks but the schedule was made for " +
                          std::to_string(s.world_size()));
  if (o.alibi_slopes.defined())
    fail("options.alibi_slopes", "ring attention does not support ALiBi (its bias needs global positions per step)");
  if (o.dropout_p != 0.0f)
    fail("options.dropout_p", "ring attention does not support dropout (its mask needs global positions per step)");
  const std::int64_t n = s.local_len(rank);
  const std::string rule = " rows at dimension 1: rank " + std::to_string(rank) + "'s shard of " +
                           std::to_string(s.seqlen_total()) + " tokens in the " + to_string(s.layout()) +
                           " layout over " + std::to_string(world) + " ranks";
  for (const auto* t : {&q, &k, &v}) {
    const char* name = t == &q ? "q" : t == &k ? "k" : "v";
    if (t->ndim != 4) fail(name, "expected (b, s_local, heads, d), got " + std::to_string(t->ndim) + " dimensions");
    if (t->shape[1] != n) fail(name, "has " + std::to_string(t->shape[1]) + " rows but needs " + std::to_string(n) + rule);
  }
}

// Bump allocator over ctx.workspace; with a null base it only measures.
class Arena {
 public:
  explicit Arena(void* base) : base_(static_cast<char*>(base)) {}
  void* take(std::size_t bytes) {
    const std::size_t at = (used_ + kAlign - 1) / kAlign * kAlign;
    used_ = at + bytes;
    return base_ ? base_ + at : nullptr;
  }
  std::size_t used() const { return used_; }

 private:
  static constexpr std::size_t kAlign = 256;
  char* base_;
  std::size_t used_ = 0;
};

TensorView make(void* p, DType t, Device dev, std::initializer_list<std::int64_t> dims) { return TensorView(p, t, dev, dims); }

// Rows [a, e) of dimension `dim` of a view.
TensorView slice(const TensorView& t, int dim, std::int64_t a, std::int64_t e) {
  TensorView s = t;
  s.data = static_cast<char*>(t.data) + a * t.stride[dim] * static_cast<std::int64_t>(dtype_size(t.dtype));
  s.shape[dim] = e - a;
  return s;
}
TensorView rows(const TensorView& t, std::int64_t a, std::int64_t e) { return slice(t, 1, a, e); }
TensorView lse_rows(const TensorView& t, std::int64_t a, std::int64_t e) { return slice(t, 2, a, e); }

// A packed shard buffer: k (b, n, h_k, d) then v (b, n, h_k, d), contiguous.
struct KvShard {
  TensorView k, v;
};
KvShard kv_shard(void* base, DType t, const Dims& d, std::int64_t n) {
  const std::size_t half = static_cast<std::size_t>(d.b * n * d.h_k * d.d) * dtype_size(t);
  return {make(base, t, d.device, {d.b, n, d.h_k, d.d}), make(static_cast<char*>(base) + half, t, d.device, {d.b, n, d.h_k, d.d})};
}

Options task_options(const Options& o, const Task& t) {
  Options r = o;
  r.causal = false;
  r.window_left = t.window_left;
  r.window_right = t.window_right;
  return r;
}

bool covers_all_rows(const std::vector<Task>& layer, std::int64_t n) {
  return layer.size() == 1 && layer[0].q_begin == 0 && layer[0].q_end == n;
}

struct FwdBuffers {
  std::array<void*, 2> kv{};
  std::array<TensorView, 2> acc_out, acc_lse;  // running state, fp32
  TensorView step_out, step_lse, task_lse;
};

FwdBuffers carve_forward(Arena& a, const Dims& d) {
  FwdBuffers f;
  for (auto& p : f.kv) p = a.take(d.kv_bytes(d.n_max, d.dtype));
  for (int i = 0; i < 2; ++i) {
    f.acc_out[i] = make(a.take(d.b * d.n * d.h * d.d * 4), DType::f32, d.device, {d.b, d.n, d.h, d.d});
    f.acc_lse[i] = make(a.take(d.b * d.h * d.n * 4), DType::f32, d.device, {d.b, d.h, d.n});
  }
  f.step_out = make(a.take(d.b * d.n * d.h * d.d * d.es()), d.dtype, d.device, {d.b, d.n, d.h, d.d});
  f.step_lse = make(a.take(d.b * d.h * d.n * 4), DType::f32, d.device, {d.b, d.h, d.n});
  f.task_lse = make(a.take(d.b * d.h * d.n * 4), DType::f32, d.device, {d.b, d.h, d.n});
  return f;
}

struct BwdBuffers {
  std::array<void*, 2> kv{}, dkv{};  // dkv: fp32 (dk, dv) of the shard in kv
  TensorView dq_acc, dq_task, task_lse;
  void* dk_task = nullptr;  // packed (dk, dv) of one task, q's dtype
  void* library = nullptr;  // the library backward's own workspace
  std::size_t library_bytes = 0;
};

std::size_t library_backward_bytes(const Dims& d, const Options& o, const std::vector<Step>& steps) {
  std::size_t most = 0;
  for (const Step& s : steps)
    for (const auto& layer : s.layers)
      for (const Task& t : layer) {
        const TensorView q = make(nullptr, d.dtype, d.device, {d.b, t.q_end - t.q_begin, d.h, d.d});
        const TensorView k = make(nullptr, d.dtype, d.device, {d.b, t.k_end - t.k_begin, d.h_k, d.d});
        most = std::max(most, backward_workspace_size(q, k, task_options(o, t)));
      }
  return most;
}

BwdBuffers carve_backward(Arena& a, const Dims& d, std::size_t library_bytes) {
  BwdBuffers f;
  for (auto& p : f.kv) p = a.take(d.kv_bytes(d.n_max, d.dtype));
  for (auto& p : f.dkv) p = a.take(d.kv_bytes(d.n_max, DType::f32));
  f.dq_acc = make(a.take(d.b * d.n * d.h * d.d * 4), DType::f32, d.device, {d.b, d.n, d.h, d.d});
  f.dq_task = make(a.take(d.b * d.n * d.h * d.d * d.es()), d.dtype, d.device, {d.b, d.n, d.h, d.d});
  f.task_lse = make(a.take(d.b * d.h * d.n * 4), DType::f32, d.device, {d.b, d.h, d.n});
  f.dk_task = a.take(d.kv_bytes(d.n_max, d.dtype));
  f.library_bytes = library_bytes;
  f.library = library_bytes ? a.take(library_bytes) : nullptr;
  return f;
}

void check_workspace(const Context& ctx, std::size_t need) {
  if (need > 0 && (ctx.workspace == nullptr || ctx.workspace_bytes < need))
    fail("ctx.workspace", "ring attention needs " + std::to_string(need) + " bytes (ring_*_workspace_size), got " +
                              std::to_string(ctx.workspace == nullptr ? 0 : ctx.workspace_bytes));
}

}  // namespace

RingSchedule make_schedule(int world_size, std::int64_t seqlen_total, Layout layout, const Options& o) {
  return RingSchedule(world_size, seqlen_total, layout, o.window_left, o.causal ? 0 : o.window_right);
}

std::size_t ring_forward_workspace_size(const TensorView& q, const TensorView& k, const Options&,
                                        const RingSchedule& schedule, int) {
  Arena a(nullptr);
  carve_forward(a, dims_of(q, k, schedule));
  return a.used();
}

std::size_t ring_backward_workspace_size(const TensorView& q, const TensorView& k, const Options& options,
                                         const RingSchedule& schedule, int rank) {
  const Dims d = dims_of(q, k, schedule);
  Arena a(nullptr);
  carve_backward(a, d, library_backward_bytes(d, options, schedule.steps(rank)));
  return a.used();
}

void ring_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                  const TensorView& lse, const Options& options, const RingSchedule& schedule, Transport& transport,
                  DeviceOps& ops, const Context& ctx) {
  const int rank = transport.rank(), world = transport.world_size();
  check_inputs(q, k, v, options, schedule, rank, world);
  const Dims d = dims_of(q, k, schedule);
  check_workspace(ctx, ring_forward_workspace_size(q, k, options, schedule, rank));
  Arena arena(ctx.workspace);
  const FwdBuffers f = carve_forward(arena, d);
  Context lib = ctx;  // the library's forwards run unsplit: the ring already supplies parallel work
  lib.workspace = nullptr;
  lib.workspace_bytes = 0;

  const std::vector<Step> steps = schedule.steps(rank);
  int layers_left = 0;
  for (const Step& s : steps) layers_left += static_cast<int>(s.layers.size());
  if (layers_left == 0) {  // no key visible to any local row: the identity
    ops.fill(out, 0.0f);
    ops.fill(lse, -INFINITY);
  }
  const KvShard own = kv_shard(f.kv[0], d.dtype, d, d.n);
  ops.copy(own.k, k, false);
  ops.copy(own.v, v, false);

  int cur = -1;  // which acc holds the running state; -1 before the first layer
  const int n_steps = static_cast<int>(steps.size());
  for (int t = 0; t < n_steps; ++t) {
    const int src = steps[t].src, next_src = RingSchedule::source(rank, t + 1, world);
    int ticket = -1;
    if (t + 1 < n_steps)
      ticket = transport.start({f.kv[t % 2], d.kv_bytes(schedule.local_len(src), d.dtype)},
                               {f.kv[(t + 1) % 2], d.kv_bytes(schedule.local_len(next_src), d.dtype)}, 1);
    // While an exchange is in flight the forwards are not persistent, so the communication
    // stream's kernels get SMs as blocks retire (Context::persistent_kernels).
    lib.persistent_kernels = ctx.persistent_kernels && ticket < 0;
    const KvShard shard = kv_shard(f.kv[t % 2], d.dtype, d, schedule.local_len(src));
    for (const auto& layer : steps[t].layers) {
      const bool whole = covers_all_rows(layer, d.n);
      if (!whole) ops.fill(f.step_lse, -INFINITY);
      for (const Task& task : layer) {
        const TensorView task_lse = whole ? f.step_lse
                                          : make(f.task_lse.data, DType::f32, d.device, {d.b, d.h, task.q_end - task.q_begin});
        flashmonoid::forward(rows(q, task.q_begin, task.q_end), rows(shard.k, task.k_begin, task.k_end),
                             rows(shard.v, task.k_begin, task.k_end), rows(f.step_out, task.q_begin, task.q_end),
                             task_lse, task_options(options, task), lib);
        if (!whole) ops.copy(lse_rows(f.step_lse, task.q_begin, task.q_end), task_lse, false);
      }
      // Fold the layer into the running state; the last fold writes the caller's out and lse.
      const int dst = cur < 0 ? 0 : 1 - cur;
      const bool last = --layers_left == 0;
      std::vector<TensorView> outs{f.step_out}, lses{f.step_lse};
      if (cur >= 0) {
        outs.insert(outs.begin(), f.acc_out[cur]);
        lses.insert(lses.begin(), f.acc_lse[cur]);
      }
      flashmonoid::merge(outs, lses, last ? out : f.acc_out[dst], last ? lse : f.acc_lse[dst], ctx);
      cur = dst;
    }
    if (ticket >= 0) transport.wait(ticket);
  }
}

void ring_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                   const TensorView& dv, const Options& options, const RingSchedule& schedule, Transport& transport,
                   DeviceOps& ops, const Context& ctx) {
  const int rank = transport.rank(), world = transport.world_size();
  check_inputs(q, k, v, options, schedule, rank, world);
  const Dims d = dims_of(q, k, schedule);
  const std::vector<Step> steps = schedule.steps(rank);
  check_workspace(ctx, ring_backward_workspace_size(q, k, options, schedule, rank));
  Arena arena(ctx.workspace);
  const BwdBuffers f = carve_backward(arena, d, library_backward_bytes(d, options, steps));
  Context lib = ctx;
  lib.workspace = f.library;
  lib.workspace_bytes = f.library_bytes;

  const KvShard own = kv_shard(f.kv[0], d.dtype, d, d.n);
  ops.copy(own.k, k, false);
  ops.copy(own.v, v, false);
  ops.fill(f.dq_acc, 0.0f);
  ops.fill(make(f.dkv[0], DType::f32, d.device, {static_cast<std::int64_t>(d.kv_bytes(d.n, DType::f32) / 4)}), 0.0f);

  int dkv_ticket = -1;  // the exchange bringing the visiting shard's gradient sums into dkv[t % 2]
  // Earlier ranks' gradient sums are needed only from the first accumulation on.
  auto arrived = [&] {
    if (dkv_ticket >= 0) transport.wait(dkv_ticket);
    dkv_ticket = -1;
  };
  const int n_steps = static_cast<int>(steps.size());
  for (int t = 0; t < n_steps; ++t) {
    const bool last = t + 1 == n_steps;
    const int src = steps[t].src, next_src = RingSchedule::source(rank, t + 1, world);
    const std::int64_t n_src = schedule.local_len(src), n_next = schedule.local_len(next_src);
    int kv_ticket = -1;
    if (!last)
      kv_ticket = transport.start({f.kv[t % 2], d.kv_bytes(n_src, d.dtype)},
                                  {f.kv[(t + 1) % 2], d.kv_bytes(n_next, d.dtype)}, 1);
    const KvShard shard = kv_shard(f.kv[t % 2], d.dtype, d, n_src);
    const KvShard grads = kv_shard(f.dkv[t % 2], DType::f32, d, n_src);
    for (const auto& layer : steps[t].layers)
      for (const Task& task : layer) {
        const std::int64_t nq = task.q_end - task.q_begin, nk = task.k_end - task.k_begin;
        TensorView task_lse = lse;
        if (nq != d.n) {  // lse must be contiguous: gather the task's rows
          task_lse = make(f.task_lse.data, DType::f32, d.device, {d.b, d.h, nq});
          ops.copy(task_lse, lse_rows(lse, task.q_begin, task.q_end), false);
        }
        const TensorView dq_task = make(f.dq_task.data, d.dtype, d.device, {d.b, nq, d.h, d.d});
        const KvShard dkv_task = kv_shard(f.dk_task, d.dtype, d, nk);
        // As in the forward: not persistent while an exchange (K/V or gradient sums) is in flight.
        lib.persistent_kernels = ctx.persistent_kernels && kv_ticket < 0 && dkv_ticket < 0;
        flashmonoid::backward(rows(dout, task.q_begin, task.q_end), rows(q, task.q_begin, task.q_end),
                              rows(shard.k, task.k_begin, task.k_end), rows(shard.v, task.k_begin, task.k_end),
                              rows(out, task.q_begin, task.q_end), task_lse, dq_task, dkv_task.k, dkv_task.v,
                              task_options(options, task), lib);
        ops.copy(rows(f.dq_acc, task.q_begin, task.q_end), dq_task, true);
        arrived();
        ops.copy(rows(grads.k, task.k_begin, task.k_end), dkv_task.k, true);
        ops.copy(rows(grads.v, task.k_begin, task.k_end), dkv_task.v, true);
      }
    arrived();
    // On to the next rank, or after the last step home (shift 1 after a full ring of P steps).
    const int shift = last ? schedule.home_shift() : 1;
    if (shift != 0)
      dkv_ticket = transport.start({f.dkv[t % 2], d.kv_bytes(n_src, DType::f32)},
                                   {f.dkv[(t + 1) % 2], d.kv_bytes(last ? d.n : n_next, DType::f32)}, shift);
    if (kv_ticket >= 0) transport.wait(kv_ticket);
  }
  arrived();
  const KvShard home = kv_shard(f.dkv[schedule.home_shift() != 0 ? n_steps % 2 : (n_steps - 1) % 2], DType::f32, d, d.n);
  ops.copy(dk, home.k, false);
  ops.copy(dv, home.v, false);
  ops.copy(dq, f.dq_acc, false);
}

}  // namespace flashmonoid::dist
