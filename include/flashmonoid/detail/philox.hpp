// The dropout keep-mask, defined once for every backend (CPU reference, CPU flash, CUDA).
//
// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) with
//   key     = (low 32 bits of seed, high 32 bits of seed)
//   counter = (column / 4, row_id, low 32 bits of offset, high 32 bits of offset)
// gives four 32-bit words; word (column % 4) is r. The element is kept iff r >= threshold,
// threshold = min(floor(p · 2^32), 2^32 - 1), so P(keep) = 1 - p. Kept probabilities are scaled by
// 1 / (1 - p). row_id = head · total_q + global query row, where total_q = b · s_q and the global
// row of (batch, i) is batch · s_q + i (varlen: cu_seqlens_q[batch] + i); column is the key index
// within its sequence.
#pragma once

#include <cstdint>

#include "flashmonoid/detail/host_device.hpp"

namespace flashmonoid::detail {

struct Philox4 {
  std::uint32_t x[4];
};

FM_HD std::uint32_t mulhi32(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(a) * b) >> 32);
#endif
}

FM_HD Philox4 philox4x32_10(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2, std::uint32_t c3,
                            std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0 = mulhi32(kM0, c0), lo0 = kM0 * c0;
    std::uint32_t hi1 = mulhi32(kM1, c2), lo1 = kM1 * c2;
    std::uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

FM_HD std::uint32_t dropout_threshold(float p) {
  double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<std::uint32_t>(t);
}

// The four random words covering columns [4·(column/4), 4·(column/4) + 4) of one row.
FM_HD Philox4 dropout_words(std::uint64_t seed, std::uint64_t offset, std::uint32_t row_id,
                            std::uint32_t column_group) {
  return philox4x32_10(column_group, row_id, static_cast<std::uint32_t>(offset),
                       static_cast<std::uint32_t>(offset >> 32), static_cast<std::uint32_t>(seed),
                       static_cast<std::uint32_t>(seed >> 32));
}

FM_HD bool dropout_keep(std::uint64_t seed, std::uint64_t offset, std::uint32_t threshold,
                        std::uint32_t row_id, std::uint32_t column) {
  return dropout_words(seed, offset, row_id, column / 4).x[column % 4] >= threshold;
}

}  // namespace flashmonoid::detail
