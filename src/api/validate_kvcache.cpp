// Validation of forward_kvcache and of paged varlen calls into KvCacheCall / FwdParams. The
// attention part goes through make_fwd_params (q, out, lse and options keep their one set of rules)
// with an empty stand-in for K/V, whose real layout is checked and filled in here. On the CPU the
// values (lengths, batch indices, page numbers) are checked too; on CUDA reading them would need a
// synchronisation, so the kernels clamp them instead (kvcache.hpp).
#include <algorithm>
#include <limits>
#include <string>

#include "api/kvcache_params.hpp"
#include "api/validate.hpp"
#include "api/validate_util.hpp"
#include "flashmonoid/error.hpp"

namespace flashmonoid::detail {
namespace {

std::string str(std::int64_t x) { return std::to_string(x); }

// An int32 vector of length b on dev, contiguous.
void check_index_vector(const TensorView& t, const std::string& name, std::int64_t b, Device dev) {
  check_view(t, name, 1);
  if (t.dtype != DType::i32) fail(name, "dtype must be int32, got " + to_string(t.dtype));
  check_same_device(t, name, dev);
  check_shape(t, name, {b}, "one entry per sequence of q's batch");
  if (!t.is_contiguous()) fail(name, "must be contiguous");
}

// K and V pages or cache entries: 4-D, q's dtype, device and head dim, v shaped like k, GQA rule.
void check_kv(const TensorView& k, const TensorView& v, const std::string& kn, const std::string& vn,
              const TensorView& q, std::int64_t h, std::int64_t d) {
  check_view(k, kn, 4);
  check_view(v, vn, 4);
  check_same_device(k, kn, q.device);
  check_same_device(v, vn, q.device);
  check_dtype(k, kn, q.dtype, "q");
  check_dtype(v, vn, q.dtype, "q");
  if (k.shape[3] != d) fail(kn, "head dim " + str(k.shape[3]) + " differs from q's " + str(d));
  const std::int64_t h_k = k.shape[2];
  if (h_k < 1) fail(kn, "must have at least one head");
  if (h % h_k != 0)
    fail(kn, "number of query heads (" + str(h) + ") must be a multiple of the number of KV heads (" + str(h_k) + ")");
  check_shape(v, vn, {k.shape[0], k.shape[1], k.shape[2], k.shape[3]}, "the shape of " + kn);
  check_int_range(k.shape[0], kn);
  check_int_range(k.shape[1], kn);
}

// block_table (b, max_pages) int32 on dev, rows contiguous; returns the capacity in rows.
int check_block_table(const TensorView& bt, std::int64_t b, const TensorView& pages, const std::string& pages_name,
                      Device dev) {
  check_view(bt, "block_table", 2);
  if (bt.dtype != DType::i32) fail("block_table", "dtype must be int32, got " + to_string(bt.dtype));
  check_same_device(bt, "block_table", dev);
  if (bt.shape[0] != b)
    fail("block_table", "shape " + shape_str(bt) + " must be (b, max_pages_per_seq) with q's batch b = " + str(b));
  if (bt.shape[1] < 1) fail("block_table", "must have at least one page per sequence");
  if (pages.shape[1] < 1) fail(pages_name, "page size (dim 1) must be >= 1, got " + str(pages.shape[1]));
  if (pages.shape[0] < 1) fail(pages_name, "must hold at least one page");
  const std::int64_t capacity = bt.shape[1] * pages.shape[1];
  check_int_range(capacity, "block_table");
  return static_cast<int>(capacity);
}

// Host-readable values: the pages sequence b uses (rows [0, rows_used)) exist.
void check_pages_used(const KvCacheParams& kv, int b, int rows_used) {
  for (int i = 0; i * kv.page_size < rows_used; ++i) {
    const int page = kv.block_table[b * kv.block_table_stride + i];
    if (page < 0 || page >= kv.num_pages)
      fail("block_table", "entry (" + str(b) + ", " + str(i) + ") = " + str(page) + " is not a page index in [0, " +
                              str(kv.num_pages) + ")");
  }
}

void fill_kv(FwdParams& p, const TensorView& k, const TensorView& v) {
  p.k = k.data;
  p.v = v.data;
  fill_strides(p.k_stride, k, false);
  fill_strides(p.v_stride, v, false);
}

void fill_pages(KvCacheParams& kv, const TensorView& bt, const TensorView& pages) {
  kv.block_table = bt.ptr<const int>();
  kv.block_table_stride = bt.stride[0];
  kv.page_size = static_cast<int>(pages.shape[1]);
  kv.num_pages = static_cast<int>(pages.shape[0]);
}

void check_rotary(const Rotary& r, const TensorView& q, std::int64_t d, int capacity, RotaryParams& rp) {
  if (r.cos.defined() != r.sin.defined())
    fail(r.cos.defined() ? "rotary.sin" : "rotary.cos", "rotary needs both cos and sin");
  if (!r.cos.defined()) return;
  check_view(r.cos, "rotary.cos", 2);
  check_view(r.sin, "rotary.sin", 2);
  check_same_device(r.cos, "rotary.cos", q.device);
  check_same_device(r.sin, "rotary.sin", q.device);
  check_dtype(r.cos, "rotary.cos", q.dtype, "q");
  check_dtype(r.sin, "rotary.sin", q.dtype, "q");
  const std::int64_t rotary_dim = 2 * r.cos.shape[1];
  if (rotary_dim < 2 || rotary_dim > d)
    fail("rotary.cos", "shape " + shape_str(r.cos) + " must be (s_ro, rotary_dim / 2) with 2 <= rotary_dim <= head dim " +
                           str(d));
  check_shape(r.sin, "rotary.sin", {r.cos.shape[0], r.cos.shape[1]}, "the shape of rotary.cos");
  if (r.cos.shape[0] < capacity)
    fail("rotary.cos", "has " + str(r.cos.shape[0]) + " positions but the cache holds up to " + str(capacity) +
                           " rows; cos/sin need a position for every cache row");
  check_int_range(r.cos.shape[0], "rotary.cos");
  rp.cos = r.cos.data;
  rp.sin = r.sin.data;
  rp.cos_stride = r.cos.stride[0];
  rp.sin_stride = r.sin.stride[0];
  rp.dim = static_cast<int>(rotary_dim);
  rp.seqlen = static_cast<int>(r.cos.shape[0]);
  rp.interleaved = r.interleaved;
}

}  // namespace

KvCacheCall make_kvcache_params(const TensorView& q, const KVCache& cache, const TensorView& k_new,
                                const TensorView& v_new, const Rotary& rotary, const TensorView& out,
                                const TensorView& lse, const Options& options) {
  check_view(q, "q", 4);
  if (!is_float(q.dtype)) fail("q", "dtype must be fp32, fp16 or bf16, got " + to_string(q.dtype));
  const Device dev = q.device;
  const std::int64_t b = q.shape[0], h = q.shape[2], d = q.shape[3];
  check_kv(cache.k, cache.v, "k_cache", "v_cache", q, h, d);
  const std::int64_t h_k = cache.k.shape[2];

  KvCacheCall c;
  KvCacheParams& kv = c.attn.kv;
  kv.active = true;
  int capacity = 0;
  if (cache.block_table.defined()) {
    capacity = check_block_table(cache.block_table, b, cache.k, "k_cache", dev);
    if (cache.batch_idx.defined())
      fail("batch_idx", "a paged cache (block_table) takes no batch index; map sequences to pages in block_table");
    fill_pages(kv, cache.block_table, cache.k);
  } else {
    capacity = static_cast<int>(cache.k.shape[1]);
    kv.cache_batch = static_cast<int>(cache.k.shape[0]);
    if (cache.batch_idx.defined()) {
      check_index_vector(cache.batch_idx, "batch_idx", b, dev);
      kv.batch_idx = cache.batch_idx.ptr<const int>();
    } else if (kv.cache_batch < b) {
      fail("k_cache", "has " + str(kv.cache_batch) + " cache entries but q has batch " + str(b) +
                          "; pass batch_idx to map sequences to entries");
    }
  }
  kv.capacity = capacity;
  if (cache.seqlens.defined()) {
    check_index_vector(cache.seqlens, "seqlens", b, dev);
    kv.seqlens = cache.seqlens.ptr<const int>();
  } else {
    if (cache.seqlen < -1 || cache.seqlen > capacity)
      fail("seqlen", "must be in [0, capacity = " + str(capacity) + "] or -1 (full), got " + str(cache.seqlen));
    kv.seqlen_fixed = cache.seqlen < 0 ? capacity : cache.seqlen;
  }
  if (cache.leftpad.defined()) {
    check_index_vector(cache.leftpad, "leftpad", b, dev);
    kv.leftpad = cache.leftpad.ptr<const int>();
  }

  if (k_new.defined() != v_new.defined()) fail(k_new.defined() ? "v_new" : "k_new", "k_new and v_new go together");
  if (k_new.defined()) {
    check_view(k_new, "k_new", 4);
    check_view(v_new, "v_new", 4);
    check_same_device(k_new, "k_new", dev);
    check_same_device(v_new, "v_new", dev);
    check_dtype(k_new, "k_new", q.dtype, "q");
    check_dtype(v_new, "v_new", q.dtype, "q");
    const std::int64_t s_new = k_new.shape[1];
    check_shape(k_new, "k_new", {b, s_new, h_k, d}, "(b, s_new, h_k, d) with q's batch, the cache's heads and head dim");
    check_shape(v_new, "v_new", {b, s_new, h_k, d}, "the shape of k_new");
    if (s_new > capacity)
      fail("k_new", "appends " + str(s_new) + " rows to a cache that holds at most " + str(capacity) + " per sequence");
    kv.seqlen_new = static_cast<int>(s_new);
    c.k_new = k_new.data;
    c.v_new = v_new.data;
    fill_strides(c.k_new_stride, k_new, false);
    fill_strides(c.v_new_stride, v_new, false);
    if (!cache.seqlens.defined() && kv.seqlen_fixed + s_new > capacity)
      fail("seqlen", str(kv.seqlen_fixed) + " rows held + " + str(s_new) + " appended exceed the capacity " +
                         str(capacity));
  }
  check_rotary(rotary, q, d, capacity, c.rotary);
  if (options.dropout_p != 0.0f) fail("options.dropout_p", "dropout is not available in forward_kvcache (inference)");

  // flash-attn's normalisation: a window reaching past the whole cache is no window.
  Options o = options;
  if (o.window_left >= capacity) o.window_left = -1;
  if (o.window_right >= capacity) o.window_right = -1;
  // K/V stand-ins without rows: make_fwd_params checks q, out, lse and the options against them;
  // the cache's own layout was checked above.
  const TensorView k0(cache.k.data, q.dtype, dev, {b, 0, h_k, d}), v0(cache.v.data, q.dtype, dev, {b, 0, h_k, d});
  const KvCacheParams kv_checked = kv;
  c.attn = make_fwd_params(q, k0, v0, out, lse, o, nullptr);
  c.attn.kv = kv_checked;
  c.attn.seqlen_k = capacity;
  fill_kv(c.attn, cache.k, cache.v);
  c.rotary.per_row = c.attn.window_left >= 0 || c.attn.window_right >= 0;

  // Outputs are written: they must not overlap anything read, nor the cache (written when appending).
  const struct {
    const TensorView* t;
    const char* name;
  } reads[] = {{&cache.k, "k_cache"},   {&cache.v, "v_cache"},       {&k_new, "k_new"},
               {&v_new, "v_new"},       {&rotary.cos, "rotary.cos"}, {&rotary.sin, "rotary.sin"},
               {&cache.seqlens, "seqlens"}, {&cache.leftpad, "leftpad"}, {&cache.batch_idx, "batch_idx"},
               {&cache.block_table, "block_table"}};
  for (const auto& r : reads) {
    check_no_alias(out, "out", *r.t, r.name);
    check_no_alias(lse, "lse", *r.t, r.name);
  }
  if (k_new.defined()) {
    for (const auto& r : reads) {
      if (r.t == &cache.k || r.t == &cache.v) continue;
      check_no_alias(cache.k, "k_cache", *r.t, r.name);
      check_no_alias(cache.v, "v_cache", *r.t, r.name);
    }
    check_no_alias(cache.k, "k_cache", q, "q");
    check_no_alias(cache.v, "v_cache", q, "q");
    check_no_alias(cache.k, "k_cache", cache.v, "v_cache");
  }

  if (dev.kind == DeviceKind::cpu) {  // every value is readable here: check it instead of clamping
    for (int i = 0; i < b; ++i) {
      const int held = kv.seqlens ? kv.seqlens[i] : kv.seqlen_fixed;
      if (held < 0 || held + kv.seqlen_new > capacity)
        fail("seqlens", "sequence " + str(i) + " holds " + str(held) + " rows; with " + str(kv.seqlen_new) +
                            " appended it must stay within [0, " + str(capacity) + "], the cache's capacity");
      if (kv.leftpad && (kv.leftpad[i] < 0 || kv.leftpad[i] > held))
        fail("leftpad", "entry " + str(i) + " = " + str(kv.leftpad[i]) + " must be in [0, seqlens[" + str(i) +
                            "] = " + str(held) + "]");
      if (kv.batch_idx && (kv.batch_idx[i] < 0 || kv.batch_idx[i] >= kv.cache_batch))
        fail("batch_idx", "entry " + str(i) + " = " + str(kv.batch_idx[i]) + " is not a cache entry in [0, " +
                              str(kv.cache_batch) + ")");
      if (kv.block_table) check_pages_used(kv, i, held + kv.seqlen_new);
    }
  }
  return c;
}

FwdParams make_paged_varlen_params(const TensorView& q, const TensorView& k, const TensorView& v, const Varlen& varlen,
                                   const TensorView& out, const TensorView& lse, const Options& options) {
  check_view(q, "q", 3);
  if (varlen.seqused_q.defined())
    fail("seqused_q", "used query lengths are for packed k, v; with a block_table cu_seqlens_q gives each "
                      "sequence's query rows");
  // Key counts: cu_seqlens_k's lengths, or seqused_k's entries (flash-attn 3's paged form; cu_seqlens_k
  // may then be left out, and with both a count is the smaller).
  const bool used_k = varlen.seqused_k.defined();
  if (!used_k && !varlen.cu_seqlens_k.defined())
    fail("cu_seqlens_k", "is required for a paged varlen call unless seqused_k gives the key counts");
  if (!is_float(q.dtype)) fail("q", "dtype must be fp32, fp16 or bf16, got " + to_string(q.dtype));
  check_kv(k, v, "k", "v", q, q.shape[1], q.shape[2]);
  const std::int64_t h_k = k.shape[2], d = q.shape[2];
  // Stand-ins with one row of real memory and as many rows as cu_seqlens_k may count: the packed
  // row checks then accept any lengths, which are checked against the pages below.
  constexpr std::int64_t kAnyRows = std::numeric_limits<int>::max();
  const TensorView k0(k.data, q.dtype, q.device, {kAnyRows, h_k, d}, {0, 0, 1});
  const TensorView v0(v.data, q.dtype, q.device, {kAnyRows, h_k, d}, {0, 0, 1});
  Varlen vl = varlen;
  vl.block_table = {};
  const bool no_cu_k = used_k && !varlen.cu_seqlens_k.defined();
  if (no_cu_k) {  // cu_seqlens_q stands in for the shared shape checks (not read as key counts)
    vl.cu_seqlens_k = varlen.cu_seqlens_q;
    vl.max_seqlen_k = std::max(varlen.max_seqlen_k, varlen.max_seqlen_q);
    vl.seqused_k = {};  // checked below, against the pages instead of a slot
  }
  FwdParams p = make_fwd_params(q, k0, v0, out, lse, options, &vl);
  KvCacheParams& kv = p.kv;
  kv.capacity = check_block_table(varlen.block_table, p.batch, k, "k", q.device);
  if (no_cu_k) {
    check_index_vector(varlen.seqused_k, "seqused_k", p.batch, q.device);
    p.cu_seqlens_k = nullptr;
    p.seqused_k = varlen.seqused_k.ptr<const int>();
    p.seqlen_k = static_cast<int>(varlen.max_seqlen_k);
  }
  fill_pages(kv, varlen.block_table, k);
  fill_kv(p, k, v);
  for (const auto* in : {&k, &v, &varlen.block_table}) {
    const char* nm = in == &k ? "k" : in == &v ? "v" : "block_table";
    check_no_alias(out, "out", *in, nm);
    check_no_alias(lse, "lse", *in, nm);
  }
  if (q.device.kind == DeviceKind::cpu) {
    const char* name = used_k ? "seqused_k" : "cu_seqlens_k";
    for (int i = 0; i < p.batch; ++i) {
      // With cu_seqlens_k, make_fwd_params has checked the lengths (and seqused_k within the slots).
      const int len = p.cu_seqlens_k == nullptr ? p.seqused_k[i] : varlen_len(p.cu_seqlens_k, p.seqused_k, i);
      if (len < 0) fail(name, "entry " + str(i) + " (" + str(len) + ") is negative");
      if (len > kv.capacity)
        fail(name, "sequence " + str(i) + " has " + str(len) + " keys but its pages hold " + str(kv.capacity));
      if (len > varlen.max_seqlen_k)
        fail(name, "sequence " + str(i) + " has " + str(len) + " keys > max_seqlen_k = " + str(varlen.max_seqlen_k));
      check_pages_used(kv, i, len);
    }
  }
  return p;
}

}  // namespace flashmonoid::detail
