// Whole-sequence host tensors <-> one rank's shard (its segments, rows in local order), for the
// ring tests on the CPU (test_ring_cpu.cpp) and on GPUs (tests/dist/test_ring_nccl.cu).
#pragma once

#include <vector>

#include "dist/ring_schedule.hpp"
#include "test_util.hpp"

namespace fmtest {

// Rows of a (b, s, h, d) tensor for rank r's segments, contiguous (b, n_r, h, d); and back.
inline HostTensor shard(const HostTensor& full, const std::vector<flashmonoid::dist::Segment>& segs, std::int64_t n) {
  const TensorView& f = full.view;
  HostTensor out(f.dtype, {f.shape[0], n, f.shape[2], f.shape[3]});
  const std::int64_t inner = f.shape[2] * f.shape[3];
  for (std::int64_t b = 0; b < f.shape[0]; ++b)
    for (const auto& s : segs)
      for (std::int64_t i = 0; i < s.length; ++i)
        for (std::int64_t e = 0; e < inner; ++e)
          out.set((b * n + s.local_begin + i) * inner + e, full.get((b * f.shape[1] + s.global_begin + i) * inner + e));
  return out;
}
inline void unshard(HostTensor& full, const HostTensor& part, const std::vector<flashmonoid::dist::Segment>& segs) {
  const TensorView& f = full.view;
  const std::int64_t n = part.view.shape[1], inner = f.shape[2] * f.shape[3];
  for (std::int64_t b = 0; b < f.shape[0]; ++b)
    for (const auto& s : segs)
      for (std::int64_t i = 0; i < s.length; ++i)
        for (std::int64_t e = 0; e < inner; ++e)
          full.set((b * f.shape[1] + s.global_begin + i) * inner + e, part.get((b * n + s.local_begin + i) * inner + e));
}
// lse (b, h, s) <-> (b, h, n_r).
inline HostTensor shard_lse(const HostTensor& full, const std::vector<flashmonoid::dist::Segment>& segs, std::int64_t n) {
  const TensorView& f = full.view;
  HostTensor out(DType::f32, {f.shape[0], f.shape[1], n});
  for (std::int64_t bh = 0; bh < f.shape[0] * f.shape[1]; ++bh)
    for (const auto& s : segs)
      for (std::int64_t i = 0; i < s.length; ++i) out.set(bh * n + s.local_begin + i, full.get(bh * f.shape[2] + s.global_begin + i));
  return out;
}
inline void unshard_lse(HostTensor& full, const HostTensor& part, const std::vector<flashmonoid::dist::Segment>& segs) {
  const TensorView& f = full.view;
  const std::int64_t n = part.view.shape[2];
  for (std::int64_t bh = 0; bh < f.shape[0] * f.shape[1]; ++bh)
    for (const auto& s : segs)
      for (std::int64_t i = 0; i < s.length; ++i) full.set(bh * f.shape[2] + s.global_begin + i, part.get(bh * n + s.local_begin + i));
}

}  // namespace fmtest
