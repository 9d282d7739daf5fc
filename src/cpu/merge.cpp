// CPU merge of partial (out, lse) results: a fold of detail::merge_lse over the parts.
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/numeric.hpp"
#include "flashmonoid/detail/monoid.hpp"

namespace flashmonoid::cpu {

void merge(const detail::MergeParams& p) {
  const int rows = p.batch * p.h * p.seqlen;
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const int b = r / (p.h * p.seqlen), hd = (r / p.seqlen) % p.h, i = r % p.seqlen;
    const std::int64_t li = (static_cast<std::int64_t>(b) * p.h + hd) * p.seqlen + i;
    std::vector<float> acc(p.d, 0.0f);
    float lse = -INFINITY;
    for (int n = 0; n < p.n; ++n) {
      const detail::MergePart& part = p.parts[n];
      float w_acc, w_part;
      lse = detail::merge_lse(lse, part.lse[li], &w_acc, &w_part);
      const std::int64_t o = detail::offset_of(part.stride, b, i, hd);
      for (int c = 0; c < p.d; ++c)
        acc[c] = acc[c] * w_acc + (w_part != 0.0f ? w_part * load(part.out, part.dtype, o + c) : 0.0f);
    }
    const std::int64_t o = detail::offset_of(p.o_stride, b, i, hd);
    for (int c = 0; c < p.d; ++c) store(p.out, p.dtype, o + c, acc[c]);
    p.lse[li] = lse;
  }
}

}  // namespace flashmonoid::cpu
