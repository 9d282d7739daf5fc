// Score transform and masks, shared by every backend. For query row i and key column j of one
// sequence (lengths s_q, s_k) the score is
//     s  = scale · q_i·k_j
//     s  = softcap · tanh(s / softcap)                 if softcap > 0
//     s += -slope · |i + s_k - s_q - j|                if ALiBi
//     s  = -inf                                        if j is outside the window (see options.hpp)
#pragma once

#include <cstdint>

#include "flashmonoid/detail/host_device.hpp"

namespace flashmonoid::detail {

// Bottom-right aligned band: row i sees [i + diag - left, i + diag + right], diag = s_k - s_q;
// a negative left/right is unbounded on that side.
struct Band {
  std::int64_t diag = 0;
  int left = -1;
  int right = -1;

  FM_HD bool visible(std::int64_t i, std::int64_t j) const {
    std::int64_t c = i + diag;
    return (right < 0 || j <= c + right) && (left < 0 || j >= c - left);
  }
  // First and one-past-last visible key for rows [row_begin, row_end), clipped to [0, s_k):
  // a tile of keys outside [key_begin, key_end) is fully masked for every row of the block.
  FM_HD std::int64_t key_begin(std::int64_t row_begin, std::int64_t) const {
    if (left < 0) return 0;
    std::int64_t b = row_begin + diag - left;
    return b < 0 ? 0 : b;
  }
  FM_HD std::int64_t key_end(std::int64_t row_end, std::int64_t s_k) const {
    if (right < 0) return s_k;
    std::int64_t e = row_end - 1 + diag + right + 1;
    return e < 0 ? 0 : (e > s_k ? s_k : e);
  }
  // The transpose: first and one-past-last query row that sees a key of [key_begin, key_end)
  // (key j is seen by rows [j - diag - right, j - diag + left]), clipped to [0, s_q).
  FM_HD std::int64_t query_begin(std::int64_t key_begin) const {
    if (right < 0) return 0;
    std::int64_t b = key_begin - diag - right;
    return b < 0 ? 0 : b;
  }
  FM_HD std::int64_t query_end(std::int64_t key_end, std::int64_t s_q) const {
    if (left < 0) return s_q;
    std::int64_t e = key_end - 1 - diag + left + 1;
    return e < 0 ? 0 : (e > s_q ? s_q : e);
  }
  // Whether the key tile [kb, ke) x row tile [rb, re) needs per-element masking.
  FM_HD bool tile_needs_mask(std::int64_t rb, std::int64_t re, std::int64_t kb, std::int64_t ke,
                             std::int64_t s_k) const {
    bool right_ok = right < 0 || ke - 1 <= rb + diag + right;
    bool left_ok = left < 0 || kb >= re - 1 + diag - left;
    return !(right_ok && left_ok && ke <= s_k);
  }
};

// ALiBi's bias from the signed distance d = i + diag - j (kernels that hold d in 32 bits per tile
// pass an int; the bias is the same function of it).
template <class Int>
FM_HD float alibi_bias_at(float slope, Int d) {
  return -slope * static_cast<float>(d < 0 ? -d : d);
}

FM_HD float alibi_bias(float slope, std::int64_t i, std::int64_t j, std::int64_t diag) {
  return alibi_bias_at(slope, i + diag - j);
}

}  // namespace flashmonoid::detail
