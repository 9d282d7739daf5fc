// Validation of public-API arguments into the normalised params of api/params.hpp. Every rule
// lives here, once; each violation throws Error naming the argument and the rule.
#pragma once

#include <span>
#include <vector>

#include "api/params.hpp"
#include "flashmonoid/options.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid::detail {

// What a validation covers: a call (every rule), or the shapes alone, for the size and support
// queries, which take views without data (no pointer is checked, compared or read).
enum class Check { call, shapes };

FwdParams make_fwd_params(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                          const TensorView& lse, const Options& options, const Varlen* varlen,
                          Check check = Check::call);

BwdParams make_bwd_params(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, const Options& options, const Varlen* varlen);

// parts receives the storage that the returned params point into.
MergeParams make_merge_params(std::span<const TensorView> outs, std::span<const TensorView> lses,
                              const TensorView& out, const TensorView& lse, std::vector<MergePart>& parts);

}  // namespace flashmonoid::detail
