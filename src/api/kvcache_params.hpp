// The normalised description of a forward_kvcache call (include/flashmonoid/kvcache.hpp) that the
// backends consume: the attention itself as FwdParams (its K/V read through FwdParams::kv), and
// the append and rotary that precede it. Filled by validate_kvcache.cpp after every rule is checked.
#pragma once

#include <cstdint>

#include "api/params.hpp"
#include "flashmonoid/kvcache.hpp"
#include "flashmonoid/options.hpp"

namespace flashmonoid::detail {

struct RotaryParams {
  const void* cos = nullptr;  // (seqlen, dim / 2), the dtype of q
  const void* sin = nullptr;
  std::int64_t cos_stride = 0, sin_stride = 0;  // between positions, in elements
  int dim = 0;                                  // rotary_dim; 0 = off
  int seqlen = 0;                               // positions available (s_ro)
  bool interleaved = true;
  bool per_row = false;  // query row i at cache_rows + i (causal or windowed), else at cache_rows
};

struct KvCacheCall {
  FwdParams attn;  // attn.q is the caller's q: a backend with rotary on attends with a rotated copy
  const void* k_new = nullptr;  // (b, s_new, h_k, d); s_new = attn.kv.seqlen_new
  const void* v_new = nullptr;
  Strides k_new_stride, v_new_stride;
  RotaryParams rotary;
};

KvCacheCall make_kvcache_params(const TensorView& q, const KVCache& cache, const TensorView& k_new,
                                const TensorView& v_new, const Rotary& rotary, const TensorView& out,
                                const TensorView& lse, const Options& options);

// forward_varlen with varlen.block_table defined: k, v are pages (num_pages, page_size, h_k, d).
FwdParams make_paged_varlen_params(const TensorView& q, const TensorView& k, const TensorView& v, const Varlen& varlen,
                                   const TensorView& out, const TensorView& lse, const Options& options);

}  // namespace flashmonoid::detail
