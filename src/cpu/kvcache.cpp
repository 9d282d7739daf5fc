// CPU forward_kvcache: the append (k_new rotated) into the cache, q rotated into a host copy, then
// the same fold as every other CPU call (flash_forward or the reference), its K/V rows read
// through the cache's batch index or block table (detail::kv_offset).
#include <cstdint>
#include <vector>

#include "api/kvcache_params.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/numeric.hpp"
#include "flashmonoid/detail/rotary.hpp"

namespace flashmonoid::cpu {
namespace {

using detail::KvCacheCall;
using detail::RotaryParams;

// The row of d features at src[so] rotated at position pos (detail/rotary.hpp) into dst[dof];
// features past the rotary dim are copied.
void rotate_row(const RotaryParams& r, DType t, const void* src, std::int64_t so, void* dst, std::int64_t dof, int d,
                std::int64_t pos) {
  float x[detail::kMaxHeadDim];
  for (int c = 0; c < d; ++c) x[c] = load(src, t, so + c);
  for (int i = 0; i < r.dim / 2; ++i) {
    const detail::RotaryPair pr = detail::rotary_pair(i, r.dim, r.interleaved);
    const float co = load(r.cos, t, pos * r.cos_stride + i), si = load(r.sin, t, pos * r.sin_stride + i);
    detail::rotate(x[pr.a], x[pr.b], co, si, &x[pr.a], &x[pr.b]);
  }
  for (int c = 0; c < d; ++c) store(dst, t, dof + c, x[c]);
}

void copy_row(DType t, const void* src, std::int64_t so, void* dst, std::int64_t dof, int d) {
  for (int c = 0; c < d; ++c) store(dst, t, dof + c, load(src, t, so + c));
}

// k_new, v_new into rows [held, held + s_new) of each sequence's cache; k_new rotated at its row.
void append(const KvCacheCall& c) {
  const detail::FwdParams& p = c.attn;
  void* k_cache = const_cast<void*>(p.k);  // the caller's cache, written in place by contract
  void* v_cache = const_cast<void*>(p.v);
  for (int b = 0; b < p.batch; ++b) {
    const int held = detail::cache_rows_before(p, detail::seq_info(p, b));
    for (int t = 0; t < p.kv.seqlen_new; ++t)
      for (int hk = 0; hk < p.h_k; ++hk) {
        const std::int64_t row = held + t;
        const std::int64_t kn = detail::offset_of(c.k_new_stride, b, t, hk), vn = detail::offset_of(c.v_new_stride, b, t, hk);
        const std::int64_t kc = detail::kv_offset(p, p.k_stride, b, row, hk), vc = detail::kv_offset(p, p.v_stride, b, row, hk);
        if (c.rotary.dim > 0)
          rotate_row(c.rotary, p.dtype, c.k_new, kn, k_cache, kc, p.d, row);
        else
          copy_row(p.dtype, c.k_new, kn, k_cache, kc, p.d);
        copy_row(p.dtype, c.v_new, vn, v_cache, vc, p.d);
      }
  }
}

}  // namespace

void forward_kvcache(const KvCacheCall& c, bool reference, int num_threads, const Kernels& kn) {
  append(c);
  detail::FwdParams p = c.attn;
  std::vector<std::uint8_t> q_rotated;
  if (c.rotary.dim > 0) {  // q rotated into a contiguous (b, s_q, h, d) copy
    q_rotated.resize(static_cast<std::size_t>(p.total_q) * p.h * p.d * dtype_size(p.dtype));
    const detail::Strides dense{static_cast<std::int64_t>(p.seqlen_q) * p.h * p.d, static_cast<std::int64_t>(p.h) * p.d,
                                p.d};
    for (int b = 0; b < p.batch; ++b) {
      const int held = detail::cache_rows_before(p, detail::seq_info(p, b));
      for (int i = 0; i < p.seqlen_q; ++i)
        for (int hq = 0; hq < p.h; ++hq)
          rotate_row(c.rotary, p.dtype, p.q, detail::offset_of(p.q_stride, b, i, hq), q_rotated.data(),
                     detail::offset_of(dense, b, i, hq), p.d, detail::rotary_query_position(held, i, c.rotary.per_row, c.rotary.seqlen));
    }
    p.q = q_rotated.data();
    p.q_stride = dense;
  }
  if (reference)
    reference_forward(p);
  else
    flash_forward(p, num_threads, kn);
}

}  // namespace flashmonoid::cpu
