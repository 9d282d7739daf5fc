// KV-cache attention for serving: one call per decoding (or speculative / chunked-prefill) step,
// with flash-attn 2.8's flash_attn_with_kvcache semantics.
//
//   q (b, s_q, h, d); out like q; lse fp32 (b, h, s_q), contiguous.
//   cache, contiguous: k, v (b_cache, s_cache, h_k, d); sequence i uses entry batch_idx[i] (or i).
//   cache, paged:      k, v (num_pages, page_size, h_k, d), any page_size >= 1, and block_table
//                      int32 (b, max_pages): row r of sequence i lives in page
//                      block_table[i, r / page_size] at row r % page_size.
//   capacity = s_cache (contiguous) or max_pages · page_size (paged): rows a sequence can hold.
//
// One call, in order:
//   1. k_new, v_new (b, s_new, h_k, d), when given, are written into the cache in place at rows
//      [seqlens[i], seqlens[i] + s_new) of sequence i (into the right pages), k_new rotated.
//   2. Attention of q (rotated) over rows [leftpad[i], seqlens[i] + s_new) of sequence i: its
//      s_k = seqlens[i] + s_new - leftpad[i] keys, masks bottom-right aligned to that s_k (causal,
//      window, ALiBi as in options.hpp), softcap, scale, GQA/MQA (h % h_k == 0).
//
// Rotary (RoPE, detail/rotary.hpp): cos, sin (s_ro, rotary_dim / 2) of q's dtype, rotary_dim even
// and <= d, s_ro >= capacity; the first rotary_dim features of q and k_new rotate, the rest pass.
// Positions are absolute cache rows: new key t at seqlens[i] + t; query row j at seqlens[i] + j
// when the call is causal or windowed, otherwise every query at seqlens[i] (flash-attn's rule).
// Rotated values are rounded to the input dtype (they are stored in the cache, as flash-attn). A
// query position past the last cos/sin row (more queries than appended keys in a full cache) takes
// that last row.
//
// Windows of at least the capacity are unbounded (flash-attn's normalisation, which also decides
// the rotary rule above). Dropout is not available here.
//
// The call never allocates, never synchronises and never reads a device tensor on the host. Its
// work is stream-ordered as usual: on CUDA devices of compute capability 9.0 and later its first
// kernel launches under the kernel before it in the stream (programmatic dependent launch) and waits
// for that kernel to complete before it reads or writes anything, so that kernel may write any of
// the call's inputs; only the launch overlaps its tail. Outside a stream capture, a call whose K/V
// capacity is at most 32 MB sends its kernels as one cached CUDA graph instead, which then starts
// when the work before it ends (Context::call_launch: 5-8 us less host time per call).
// On the CPU every value is checked (errors name the argument). On CUDA the values only the device
// sees are made safe, never trusted for addressing: seqlens[i] is clamped to [0, capacity - s_new],
// leftpad[i] to [0, seqlens[i]], batch_idx[i] to [0, b_cache), and a block_table entry outside
// [0, num_pages) to that range; the result of such a call is unspecified but memory-safe.
#pragma once

#include <cstddef>

#include "flashmonoid/error.hpp"
#include "flashmonoid/options.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid {

struct KVCache {
  TensorView k, v;         // (b_cache, s_cache, h_k, d), or pages (num_pages, page_size, h_k, d)
  TensorView block_table;  // int32 (b, max_pages): defined = paged
  TensorView batch_idx;    // int32 (b): contiguous caches only; undefined = identity
  TensorView seqlens;      // int32 (b): rows each sequence holds before this call's append
  // When seqlens is undefined: every sequence holds this many rows; -1 = the full capacity.
  int seqlen = -1;
  TensorView leftpad;      // int32 (b): first row of each sequence; undefined = 0
};

struct Rotary {
  TensorView cos, sin;      // (s_ro, rotary_dim / 2), q's dtype; undefined = no rotary
  bool interleaved = true;  // GPT-J pairs (2i, 2i + 1); false: GPT-NeoX pairs (i, i + rotary_dim / 2)
};

// out, lse <- attention of q over the cache after appending k_new, v_new (undefined views: no
// append). ctx.num_splits: 0 = heuristic, n = force n KV splits (merged with the library's merge).
void forward_kvcache(const TensorView& q, const KVCache& cache, const TensorView& k_new, const TensorView& v_new,
                     const Rotary& rotary, const TensorView& out, const TensorView& lse, const Options& options = {},
                     const Context& ctx = {});

// Bytes of ctx.workspace a CUDA forward_kvcache needs: the rotated q when rotary is on (required)
// plus the split-KV partials (optional: with less the call runs unsplit). 0 on the CPU.
std::size_t forward_kvcache_workspace_size(const TensorView& q, const KVCache& cache, const TensorView& k_new,
                                           const Rotary& rotary, const Options& options = {});

}  // namespace flashmonoid
