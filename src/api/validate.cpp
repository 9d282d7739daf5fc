#include "api/validate.hpp"
#include "api/validate_util.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "flashmonoid/detail/philox.hpp"
#include "flashmonoid/error.hpp"

namespace flashmonoid::detail {

// The rule helpers (declared in validate_util.hpp, shared with validate_kvcache.cpp).
using detail::kMaxHeadDim;

std::string shape_str(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + ")";
}

std::string dims_str(std::initializer_list<std::int64_t> dims) {
  std::string s = "(";
  int i = 0;
  for (auto d : dims) s += (i++ ? ", " : "") + std::to_string(d);
  return s + ")";
}

[[noreturn]] void fail(const std::string& arg, const std::string& rule) { throw Error(arg, rule); }

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

// Structure every tensor argument must have: ndim, non-negative strides, contiguous last dim,
// a data pointer whenever it has elements.
void check_view(const TensorView& t, const std::string& name, int ndim, bool need_data) {
  if (t.ndim < 0) fail(name, "strides must have one entry per dimension");
  if (t.ndim != ndim)
    fail(name, "expected " + std::to_string(ndim) + " dimensions, got " + std::to_string(t.ndim) + " " + shape_str(t));
  for (int i = 0; i < ndim; ++i) {
    if (t.shape[i] < 0) fail(name, "negative size in shape " + shape_str(t));
    if (t.stride[i] < 0) fail(name, "negative strides are not supported");
  }
  if (t.shape[ndim - 1] > 1 && t.stride[ndim - 1] != 1 && t.numel() > 0)  // no element: no layout to check
    fail(name, "last dimension must be contiguous (stride 1), got stride " + std::to_string(t.stride[ndim - 1]));
  if (need_data && t.data == nullptr && t.numel() > 0) fail(name, "data pointer is null");
}

void check_shape(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> dims,
                 const std::string& why) {
  int i = 0;
  for (auto d : dims) {
    if (t.shape[i] != d) fail(name, "shape " + shape_str(t) + " must be " + dims_str(dims) + " (" + why + ")");
    ++i;
  }
}

void check_same_device(const TensorView& t, const std::string& name, Device dev) {
  if (!(t.device == dev))
    fail(name, "is on " + to_string(t.device) + " but q is on " + to_string(dev) + "; all tensors must share a device");
}

void check_dtype(const TensorView& t, const std::string& name, DType want, const std::string& other) {
  if (t.dtype != want)
    fail(name, "dtype " + to_string(t.dtype) + " differs from " + other + "'s " + to_string(want));
}

// [begin, end) bytes a view can touch; empty for a view without elements.
struct ByteRange {
  std::uintptr_t begin = 0, end = 0;
};
ByteRange byte_range(const TensorView& t) {
  if (t.numel() == 0 || t.data == nullptr) return {};
  std::int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * t.stride[i];
  auto b = reinterpret_cast<std::uintptr_t>(t.data);
  return {b, b + static_cast<std::uintptr_t>((last + 1) * static_cast<std::int64_t>(dtype_size(t.dtype)))};
}

void check_no_alias(const TensorView& written, const std::string& wname, const TensorView& other,
                    const std::string& oname) {
  ByteRange a = byte_range(written), b = byte_range(other);
  if (a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end)
    fail(wname, "overlaps the memory of " + oname + "; outputs must not alias inputs or other outputs");
}

void check_options(const Options& o, const TensorView& q, int batch, int h, Device dev, bool varlen, bool need_data) {
  if (o.softmax_scale && !std::isfinite(*o.softmax_scale))
    fail("options.softmax_scale", "must be finite, got " + std::to_string(*o.softmax_scale));
  if (o.window_left < -1) fail("options.window_left", "must be >= -1 (-1 = unbounded), got " + std::to_string(o.window_left));
  if (o.window_right < -1)
    fail("options.window_right", "must be >= -1 (-1 = unbounded), got " + std::to_string(o.window_right));
  if (!(o.softcap >= 0.0f) || !std::isfinite(o.softcap))
    fail("options.softcap", "must be finite and >= 0 (0 = off), got " + std::to_string(o.softcap));
  if (!(o.dropout_p >= 0.0f && o.dropout_p < 1.0f))
    fail("options.dropout_p", "must be in [0, 1), got " + std::to_string(o.dropout_p));
  const TensorView& a = o.alibi_slopes;
  if (a.defined()) {
    if (a.dtype != DType::f32) fail("options.alibi_slopes", "dtype must be fp32, got " + to_string(a.dtype));
    check_same_device(a, "options.alibi_slopes", dev);
    if (need_data && a.data == nullptr) fail("options.alibi_slopes", "data pointer is null");
    bool per_head = a.ndim == 1 && a.shape[0] == h;
    bool per_batch = a.ndim == 2 && a.shape[0] == batch && a.shape[1] == h;
    if (!per_head && !per_batch)
      fail("options.alibi_slopes", "shape " + shape_str(a) + " must be (h) = (" + std::to_string(h) + ") or (b, h) = (" +
                                       std::to_string(batch) + ", " + std::to_string(h) + ")");
    if (!a.is_contiguous()) fail("options.alibi_slopes", "must be contiguous");
  }
  (void)q;
  (void)varlen;
}

void check_int_range(std::int64_t v, const std::string& name) {
  if (v > std::numeric_limits<int>::max()) fail(name, "size " + std::to_string(v) + " exceeds 2^31 - 1");
}

// cu_seqlens: int32, (b + 1), contiguous, on q's device; when host-readable, starts at >= 0, is
// non-decreasing, stays within the packed tensor and within max_seqlen. Device-resident offsets
// cannot be read without a synchronisation, which launchers never do: on CUDA they are trusted,
// as in FlashAttention-2 (options.hpp says so).
int check_cu_seqlens(const TensorView& cu, const std::string& name, std::int64_t total, std::int64_t max_seqlen,
                     Device dev, const std::string& max_name, bool need_data, bool used_lengths) {
  if (!cu.defined()) fail(name, "is required for varlen attention");
  check_view(cu, name, 1, need_data);
  if (cu.dtype != DType::i32) fail(name, "dtype must be int32, got " + to_string(cu.dtype));
  check_same_device(cu, name, dev);
  if (cu.shape[0] < 1) fail(name, "must have length b + 1 >= 1");
  if (need_data && cu.data == nullptr) fail(name, "data pointer is null");
  if (max_seqlen < 0) fail(max_name, "must be >= 0, got " + std::to_string(max_seqlen));
  check_int_range(max_seqlen, max_name);
  int batch = static_cast<int>(cu.shape[0] - 1);
  if (need_data && dev.kind == DeviceKind::cpu) {
    const int* c = cu.ptr<const int>();
    if (c[0] < 0) fail(name, "entries must be >= 0, got " + std::to_string(c[0]) + " at index 0");
    for (int b = 0; b < batch; ++b) {
      if (c[b + 1] < c[b])
        fail(name, "must be non-decreasing, but entry " + std::to_string(b + 1) + " (" + std::to_string(c[b + 1]) +
                       ") < entry " + std::to_string(b) + " (" + std::to_string(c[b]) + ")");
      if (c[b + 1] - c[b] > max_seqlen && !used_lengths)  // with seqused max_seqlen bounds the used rows
        fail(name, "sequence " + std::to_string(b) + " has length " + std::to_string(c[b + 1] - c[b]) + " > " +
                       max_name + " = " + std::to_string(max_seqlen));
    }
    if (c[batch] > total)
      fail(name, "last entry " + std::to_string(c[batch]) + " is past the packed tensor's " + std::to_string(total) +
                     " rows");
  }
  return batch;
}

// seqused (Varlen's used lengths): int32, (b), contiguous, on q's device; when host-readable each in
// [0, its slot's length] and within max_seqlen. Returns the pointer (nullptr when not given).
const int* check_seqused(const TensorView& used, const std::string& name, const TensorView& cu, int batch,
                         std::int64_t max_seqlen, const std::string& max_name, Device dev, bool need_data) {
  if (!used.defined()) return nullptr;
  check_view(used, name, 1, need_data);
  if (used.dtype != DType::i32) fail(name, "dtype must be int32, got " + to_string(used.dtype));
  check_same_device(used, name, dev);
  if (used.shape[0] != batch)
    fail(name, "shape " + shape_str(used) + " must be (b) = (" + std::to_string(batch) + "), one entry per sequence");
  if (need_data && dev.kind == DeviceKind::cpu) {
    const int* u = used.ptr<const int>();
    const int* c = cu.ptr<const int>();
    for (int b = 0; b < batch; ++b) {
      const std::string at = "entry " + std::to_string(b) + " (" + std::to_string(u[b]) + ")";
      if (u[b] < 0 || u[b] > c[b + 1] - c[b])
        fail(name, at + " must lie in [0, " + std::to_string(c[b + 1] - c[b]) + "], the rows of its slot in " +
                       (name == "seqused_q" ? "cu_seqlens_q" : "cu_seqlens_k"));
      if (u[b] > max_seqlen) fail(name, at + " > " + max_name + " = " + std::to_string(max_seqlen));
    }
  }
  return used.ptr<const int>();
}

void fill_strides(Strides& s, const TensorView& t, bool varlen) {
  if (varlen) {
    s = Strides{0, t.stride[0], t.stride[1]};
  } else {
    s = Strides{t.stride[0], t.stride[1], t.stride[2]};
  }
}

FwdParams make_fwd_params(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                          const TensorView& lse, const Options& o, const Varlen* varlen, Check check) {
  const bool vl = varlen != nullptr;
  const int nd = vl ? 3 : 4;
  const bool call = check == Check::call;
  check_view(q, "q", nd, call);
  check_view(k, "k", nd, call);
  check_view(v, "v", nd, call);
  check_view(out, "out", nd, call);
  const Device dev = q.device;
  check_same_device(k, "k", dev);
  check_same_device(v, "v", dev);
  check_same_device(out, "out", dev);
  check_same_device(lse, "lse", dev);
  if (!is_float(q.dtype)) fail("q", "dtype must be fp32, fp16 or bf16, got " + to_string(q.dtype));
  check_dtype(k, "k", q.dtype, "q");
  check_dtype(v, "v", q.dtype, "q");
  check_dtype(out, "out", q.dtype, "q");
  if (lse.dtype != DType::f32) fail("lse", "dtype must be fp32, got " + to_string(lse.dtype));

  FwdParams p;
  p.dtype = q.dtype;
  p.device = dev;
  const int hq_dim = vl ? 1 : 2;
  const std::int64_t h = q.shape[hq_dim], d = q.shape[hq_dim + 1], h_k = k.shape[hq_dim];
  if (d < 1 || d > kMaxHeadDim)
    fail("q", "head dim " + std::to_string(d) + " is outside the supported range [1, " + std::to_string(kMaxHeadDim) + "]");
  if (h < 1) fail("q", "must have at least one head");
  if (h_k < 1) fail("k", "must have at least one head");
  if (h % h_k != 0)
    fail("k", "number of query heads (" + std::to_string(h) + ") must be a multiple of the number of KV heads (" +
                  std::to_string(h_k) + ")");

  if (vl) {
    const std::int64_t total_q = q.shape[0], total_k = k.shape[0];
    check_shape(k, "k", {total_k, h_k, d}, "(total_k, h_k, d) with q's head dim");
    check_shape(v, "v", {total_k, h_k, d}, "the shape of k");
    check_shape(out, "out", {total_q, h, d}, "the shape of q");
    check_view(lse, "lse", 2, call);
    check_shape(lse, "lse", {h, total_q}, "(h, total_q) for varlen");
    const bool used_q = varlen->seqused_q.defined(), used_k = varlen->seqused_k.defined();
    int b = check_cu_seqlens(varlen->cu_seqlens_q, "cu_seqlens_q", total_q, varlen->max_seqlen_q, dev, "max_seqlen_q",
                             call, used_q);
    int bk = check_cu_seqlens(varlen->cu_seqlens_k, "cu_seqlens_k", total_k, varlen->max_seqlen_k, dev, "max_seqlen_k",
                              call, used_k);
    if (b != bk)
      fail("cu_seqlens_k", "length " + std::to_string(bk + 1) + " differs from cu_seqlens_q's " + std::to_string(b + 1));
    p.seqused_q = check_seqused(varlen->seqused_q, "seqused_q", varlen->cu_seqlens_q, b, varlen->max_seqlen_q,
                                "max_seqlen_q", dev, call);
    p.seqused_k = check_seqused(varlen->seqused_k, "seqused_k", varlen->cu_seqlens_k, b, varlen->max_seqlen_k,
                                "max_seqlen_k", dev, call);
    check_int_range(total_q, "q");
    check_int_range(total_k, "k");
    p.batch = b;
    p.seqlen_q = static_cast<int>(varlen->max_seqlen_q);
    p.seqlen_k = static_cast<int>(varlen->max_seqlen_k);
    p.cu_seqlens_q = varlen->cu_seqlens_q.ptr<const int>();
    p.cu_seqlens_k = varlen->cu_seqlens_k.ptr<const int>();
    p.total_q = total_q;
    p.total_k = total_k;
  } else {
    const std::int64_t b = q.shape[0], s_q = q.shape[1], s_k = k.shape[1];
    check_shape(k, "k", {b, s_k, h_k, d}, "(b, s_k, h_k, d) with q's batch and head dim");
    check_shape(v, "v", {b, s_k, h_k, d}, "the shape of k");
    check_shape(out, "out", {b, s_q, h, d}, "the shape of q");
    check_view(lse, "lse", 3, call);
    check_shape(lse, "lse", {b, h, s_q}, "(b, h, s_q)");
    check_int_range(s_q, "q");
    check_int_range(s_k, "k");
    check_int_range(b, "q");
    p.batch = static_cast<int>(b);
    p.seqlen_q = static_cast<int>(s_q);
    p.seqlen_k = static_cast<int>(s_k);
    p.total_q = b * s_q;
    p.total_k = b * s_k;
  }
  if (!lse.is_contiguous()) fail("lse", "must be contiguous");
  if (call && lse.data == nullptr && lse.numel() > 0) fail("lse", "data pointer is null");
  check_options(o, q, p.batch, static_cast<int>(h), dev, vl, call);

  for (const auto* in : {&q, &k, &v}) {
    const char* nm = in == &q ? "q" : in == &k ? "k" : "v";
    check_no_alias(out, "out", *in, nm);
    check_no_alias(lse, "lse", *in, nm);
  }
  check_no_alias(lse, "lse", out, "out");
  if (o.alibi_slopes.defined()) {
    check_no_alias(out, "out", o.alibi_slopes, "options.alibi_slopes");
    check_no_alias(lse, "lse", o.alibi_slopes, "options.alibi_slopes");
  }

  p.h = static_cast<int>(h);
  p.h_k = static_cast<int>(h_k);
  p.d = static_cast<int>(d);
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.out = out.data;
  p.lse = lse.ptr<float>();
  fill_strides(p.q_stride, q, vl);
  fill_strides(p.k_stride, k, vl);
  fill_strides(p.v_stride, v, vl);
  fill_strides(p.o_stride, out, vl);

  p.scale = o.softmax_scale ? *o.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.scale_log2 = p.scale * static_cast<float>(M_LOG2E);
  p.softcap = o.softcap;
  p.window_left = o.window_left;
  p.window_right = o.causal ? 0 : o.window_right;
  p.causal = p.window_right == 0 && p.window_left < 0;
  if (o.alibi_slopes.defined()) {
    p.alibi = o.alibi_slopes.ptr<const float>();
    p.alibi_batch_stride = o.alibi_slopes.ndim == 2 ? h : 0;
  }
  p.dropout_p = o.dropout_p;
  p.dropout_threshold = dropout_threshold(o.dropout_p);
  p.dropout_rescale = 1.0f / (1.0f - o.dropout_p);
  p.seed = o.dropout_seed;
  p.offset = o.dropout_offset;
  p.deterministic = o.deterministic;
  return p;
}

BwdParams make_bwd_params(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, const Options& o, const Varlen* varlen) {
  if (varlen != nullptr && varlen->block_table.defined())
    fail("block_table", "paged K/V is forward-only; the backward takes packed k, v (total_k, h_k, d)");
  BwdParams p;
  static_cast<FwdParams&>(p) = make_fwd_params(q, k, v, out, lse, o, varlen);
  const bool vl = varlen != nullptr;
  const int nd = vl ? 3 : 4;
  const Device dev = q.device;
  struct Named {
    const TensorView* t;
    const char* name;
    const TensorView* like;
    const char* like_name;
  };
  const Named grads[] = {{&dout, "dout", &q, "q"}, {&dq, "dq", &q, "q"}, {&dk, "dk", &k, "k"}, {&dv, "dv", &v, "v"}};
  for (const auto& g : grads) {
    check_view(*g.t, g.name, nd);
    check_same_device(*g.t, g.name, dev);
    check_dtype(*g.t, g.name, q.dtype, "q");
    for (int i = 0; i < nd; ++i)
      if (g.t->shape[i] != g.like->shape[i])
        fail(g.name, "shape " + shape_str(*g.t) + " must equal " + g.like_name + "'s " + shape_str(*g.like));
  }
  // Gradients are written: they must not overlap anything read or each other.
  const Named reads[] = {{&dout, "dout", nullptr, nullptr}, {&q, "q", nullptr, nullptr}, {&k, "k", nullptr, nullptr},
                         {&v, "v", nullptr, nullptr},       {&out, "out", nullptr, nullptr}, {&lse, "lse", nullptr, nullptr}};
  const Named writes[] = {{&dq, "dq", nullptr, nullptr}, {&dk, "dk", nullptr, nullptr}, {&dv, "dv", nullptr, nullptr}};
  for (const auto& w : writes) {
    for (const auto& r : reads) check_no_alias(*w.t, w.name, *r.t, r.name);
    for (const auto& w2 : writes)
      if (w.t != w2.t && w.t < w2.t) check_no_alias(*w.t, w.name, *w2.t, w2.name);
  }
  p.dout = dout.data;
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  fill_strides(p.do_stride, dout, vl);
  fill_strides(p.dq_stride, dq, vl);
  fill_strides(p.dk_stride, dk, vl);
  fill_strides(p.dv_stride, dv, vl);
  p.deterministic = o.deterministic;
  return p;
}

MergeParams make_merge_params(std::span<const TensorView> outs, std::span<const TensorView> lses,
                              const TensorView& out, const TensorView& lse, std::vector<MergePart>& parts) {
  if (outs.size() != lses.size())
    fail("lses", "has " + std::to_string(lses.size()) + " entries but outs has " + std::to_string(outs.size()));
  if (outs.empty()) fail("outs", "must hold at least one partial result");
  const bool packed = out.ndim == 3;
  if (out.ndim != 3 && out.ndim != 4)
    fail("out", "expected (b, s, h, d) or packed (total, h, d), got " + std::to_string(out.ndim) + " dimensions");
  const int nd = out.ndim;
  check_view(out, "out", nd);
  check_view(lse, "lse", nd - 1);
  if (!is_float(out.dtype)) fail("out", "dtype must be fp32, fp16 or bf16, got " + to_string(out.dtype));
  if (lse.dtype != DType::f32) fail("lse", "dtype must be fp32, got " + to_string(lse.dtype));
  const Device dev = out.device;
  check_same_device(lse, "lse", dev);
  MergeParams p;
  p.batch = packed ? 1 : static_cast<int>(out.shape[0]);
  p.seqlen = static_cast<int>(out.shape[nd - 3]);
  p.h = static_cast<int>(out.shape[nd - 2]);
  p.d = static_cast<int>(out.shape[nd - 1]);
  if (packed)
    check_shape(lse, "lse", {p.h, p.seqlen}, "(h, total) for packed out");
  else
    check_shape(lse, "lse", {p.batch, p.h, p.seqlen}, "(b, h, s) for out (b, s, h, d)");
  if (!lse.is_contiguous()) fail("lse", "must be contiguous");
  check_no_alias(lse, "lse", out, "out");
  parts.assign(outs.size(), MergePart{});
  for (std::size_t i = 0; i < outs.size(); ++i) {
    const std::string on = "outs[" + std::to_string(i) + "]", ln = "lses[" + std::to_string(i) + "]";
    check_view(outs[i], on, nd);
    check_view(lses[i], ln, nd - 1);
    check_same_device(outs[i], on, dev);
    check_same_device(lses[i], ln, dev);
    if (!is_float(outs[i].dtype)) fail(on, "dtype must be fp32, fp16 or bf16, got " + to_string(outs[i].dtype));
    if (lses[i].dtype != DType::f32) fail(ln, "dtype must be fp32, got " + to_string(lses[i].dtype));
    for (int j = 0; j < nd; ++j)
      if (outs[i].shape[j] != out.shape[j]) fail(on, "shape " + shape_str(outs[i]) + " must equal out's " + shape_str(out));
    for (int j = 0; j < nd - 1; ++j)
      if (lses[i].shape[j] != lse.shape[j]) fail(ln, "shape " + shape_str(lses[i]) + " must equal lse's " + shape_str(lse));
    if (!lses[i].is_contiguous()) fail(ln, "must be contiguous");
    check_no_alias(out, "out", outs[i], on);
    check_no_alias(lse, "lse", lses[i], ln);
    check_no_alias(out, "out", lses[i], ln);
    check_no_alias(lse, "lse", outs[i], on);
    MergePart& m = parts[i];
    m.out = outs[i].data;
    m.dtype = outs[i].dtype;
    fill_strides(m.stride, outs[i], packed);
    m.lse = lses[i].ptr<const float>();
  }
  p.n = static_cast<int>(parts.size());
  p.parts = parts.data();
  p.out = out.data;
  p.dtype = out.dtype;
  fill_strides(p.o_stride, out, packed);
  p.lse = lse.ptr<float>();
  p.device = dev;
  return p;
}

}  // namespace flashmonoid::detail
