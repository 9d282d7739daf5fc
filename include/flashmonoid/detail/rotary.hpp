// Rotary position embedding (RoPE), defined once for every backend. For a row x at position pos
// and pair index i < rotary_dim / 2, with c = cos[pos, i], s = sin[pos, i]:
//     (x[a], x[b]) <- (x[a]·c - x[b]·s,  x[a]·s + x[b]·c)
// where (a, b) = (2i, 2i + 1) interleaved (GPT-J) or (i, i + rotary_dim / 2) (GPT-NeoX); features
// at or past rotary_dim pass through. fp32 math with fused multiply-adds in a fixed order, so the
// CPU and the GPU produce the same bits; the result is then rounded to the storage dtype.
#pragma once

#include <cmath>
#include <cstdint>

#include "flashmonoid/detail/host_device.hpp"

namespace flashmonoid::detail {

struct RotaryPair {
  int a, b;
};

FM_HD RotaryPair rotary_pair(int i, int rotary_dim, bool interleaved) {
  return interleaved ? RotaryPair{2 * i, 2 * i + 1} : RotaryPair{i, i + rotary_dim / 2};
}

// (x_a, x_b) rotated by the angle whose cosine and sine are c, s.
FM_HD void rotate(float x_a, float x_b, float c, float s, float* y_a, float* y_b) {
  *y_a = ::fmaf(x_a, c, -(x_b * s));
  *y_b = ::fmaf(x_a, s, x_b * c);
}

// Position of query row i of a KV-cache call whose sequence held cache_rows rows before the
// append: flash-attn's rule, per row when the call is causal or windowed, else the same for all.
// cos/sin hold `positions` rows (at least the cache's capacity); a query past them (more queries
// than appended keys, in a full cache) takes the last row instead of reading past the table.
FM_HD std::int64_t rotary_query_position(std::int64_t cache_rows, std::int64_t i, bool per_row,
                                         std::int64_t positions) {
  const std::int64_t pos = cache_rows + (per_row ? i : 0);
  return pos < positions ? pos : positions - 1;
}

}  // namespace flashmonoid::detail
