// The attention entry points. Layouts follow FlashAttention-2:
//   q (b, s_q, h, d);  k, v (b, s_k, h_k, d);  out like q;  lse fp32 (b, h, s_q), contiguous.
//   varlen: q (total_q, h, d); k, v (total_k, h_k, d); lse fp32 (h, total_q), contiguous.
// Any strides are accepted as long as the last dimension is contiguous. GQA/MQA: h % h_k == 0 and
// query head i reads KV head i / (h / h_k).
//
// lse holds the natural-log-sum-exp of each row's (masked, capped, biased, scaled) scores. A row
// with no visible key has out = 0 and lse = -infinity: the identity of merge(), so that partial
// results over disjoint key sets combine exactly even where one part saw no key.
//
// Any side may be empty (b = 0, s_q = 0, s_k = 0, varlen sequences of either length 0) on every
// backend: rows without keys get out = 0 and lse = -inf, the backward writes dK = dV = 0 for keys
// no query sees and dQ = 0 for queries that see no key, and forward_kvcache still appends its new
// rows when it has no query row.
#pragma once

#include <cstddef>
#include <span>

#include "flashmonoid/error.hpp"
#include "flashmonoid/options.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid {

// out, lse <- attention(q, k, v). Throws Error / NotSupported for invalid or unsupported input.
void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
             const TensorView& lse, const Options& options = {}, const Context& ctx = {});

void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const Varlen& varlen,
                    const TensorView& out, const TensorView& lse, const Options& options = {},
                    const Context& ctx = {});

// dq, dk, dv <- gradients of sum(dout · out). dk and dv are (b, s_k, h_k, d): summed over the query
// heads of each group under GQA. out and lse are those of the forward with the same options.
void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
              const TensorView& dv, const Options& options = {}, const Context& ctx = {});

void backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                     const Varlen& varlen, const TensorView& out, const TensorView& lse,
                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                     const Options& options = {}, const Context& ctx = {});

// Merge of partial results. outs[i] (any float dtype, the shape of out) and lses[i] (fp32, the
// shape of lse) are attention over disjoint key sets for the same queries; writes the (out, lse) of
// their union. Stable for any lse magnitude; a part with lse = -inf contributes nothing.
// Layouts: out (b, s, h, d) with lse (b, h, s), or packed out (total, h, d) with lse (h, total).
void merge(std::span<const TensorView> outs, std::span<const TensorView> lses, const TensorView& out,
           const TensorView& lse, const Context& ctx = {});

// Bytes of ctx.workspace the CUDA backward needs (0 on the CPU).
std::size_t backward_workspace_size(const TensorView& q, const TensorView& k, const Options& options = {},
                                    const Varlen* varlen = nullptr);
// Bytes of ctx.workspace a CUDA forward may use: split-KV partials (decoding shapes), or the Hopper
// kernels' exchange for a persistent grid's split last round (hdim <= 64). With less it runs
// unsplit, and the same result to rounding. The workspace may hold anything on entry.
std::size_t forward_workspace_size(const TensorView& q, const TensorView& k, const Options& options = {},
                                   const Varlen* varlen = nullptr);

// Feature queries answered by the same table the dispatcher uses.
struct Support {
  bool ok = false;
  std::string reason;  // why not, when !ok
  std::string path;    // which kernels run the forward: "cpu", "cuda-sm80" or "cuda-sm90"
};
Support supports(const TensorView& q, const TensorView& k, const Options& options = {});

// True when this build has the CUDA backend and a device of compute capability >= 8.0 is visible.
bool cuda_available();

}  // namespace flashmonoid
