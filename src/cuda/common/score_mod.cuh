// Score modifications, masks and dropout on register fragments (layout as in warp_gemm_sm80.cuh),
// each a direct use of the shared definitions in flashmonoid/detail/ (mask.hpp, philox.hpp), so
// that the GPU keeps and drops exactly the elements the CPU does. Column of accumulator entry e of
// n tile ni: key n0 + 8·ni + 2·(lane%4) + (e & 1); row: the thread's row r = 2·mi + e/2.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "api/params.hpp"
#include "flashmonoid/detail/mask.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace flashmonoid::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;

// Which query row (within its sequence) and head each of a thread's rows is. With GQA packing a
// block's rows interleave the query heads of one KV head: packed row R is query R / pack of head
// head_base + R % pack. Computed on use from the lane's first row: arrays of i, head and valid
// (6 registers per m tile) stayed live across the whole mainloop and, at 2 m tiles per warp, pushed
// epilogue values into spills; the divisions only run on masked tiles and in the epilogue.
template <int kMTiles>
struct RowCoords {
  static constexpr int kRows = 2 * kMTiles;
  int first;  // packed row of the thread's row r = 0
  int rows_total, pack, head_base;

  __device__ __forceinline__ RowCoords(int first_row, int rows_total_, int pack_, int head_base_, int lane)
      : first(first_row + lane / 4), rows_total(rows_total_), pack(pack_), head_base(head_base_) {}
  // Row r = 2·mi + half sits 16·mi + 8·half rows below row 0.
  __device__ __forceinline__ int packed(int r) const { return first + (r / 2) * 16 + (r % 2) * 8; }
  __device__ __forceinline__ int i(int r) const { return pack == 1 ? packed(r) : packed(r) / pack; }
  __device__ __forceinline__ int head(int r) const { return pack == 1 ? head_base : head_base + packed(r) % pack; }
  __device__ __forceinline__ bool valid(int r) const { return packed(r) < rows_total; }  // the row exists
};

__device__ __forceinline__ int fragment_col(int ni, int e, int lane) { return 8 * ni + 2 * (lane & 3) + (e & 1); }

// Softcap and ALiBi. Turns raw q·k into scores in log2 units (the softmax multiplier becomes 1):
// s = scale·qk, s = softcap·tanh(s/softcap), s -= slope·|i + diag - j|, all times log2(e).
// tanhf rather than tanh.approx: the latter's 2^-11 relative error, times a softcap of ~30, moves
// scores by ~0.015, far more than bf16 rounding of P.
struct ScoreMod {
  float scale_log2 = 1.0f;      // scale·log2(e)
  float scale_over_cap = 0.0f;  // scale / softcap
  float cap_log2 = 0.0f;        // softcap·log2(e)
  bool softcap = false;
  bool alibi = false;

  __host__ __device__ explicit ScoreMod(const detail::FwdParams& p)
      : scale_log2(p.scale_log2),
        scale_over_cap(p.softcap > 0.0f ? p.scale / p.softcap : 0.0f),
        cap_log2(p.softcap * kLog2e),
        softcap(p.softcap > 0.0f),
        alibi(p.alibi != nullptr) {}
  __device__ __forceinline__ bool active() const { return softcap || alibi; }
  // Multiplier from the mainloop's score units to log2 units, for OnlineSoftmax.
  __device__ __forceinline__ float softmax_mul() const { return active() ? 1.0f : scale_log2; }

  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], const float (&slope_log2)[2 * kMTiles],
                                        const RowCoords<kMTiles>& rows, std::int64_t diag, int n0, int lane) const {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 2 * mi + e / 2;
          float x = softcap ? cap_log2 * tanhf(s[mi][ni][e] * scale_over_cap) : s[mi][ni][e] * scale_log2;
          if (alibi) x += detail::alibi_bias(slope_log2[r], rows.i(r), n0 + fragment_col(ni, e, lane), diag);
          s[mi][ni][e] = x;
        }
  }
};

// -inf outside the band and past the sequence's last key; only called on tiles that
// detail::Band::tile_needs_mask flags (the diagonal and ragged tiles). Row i sees exactly the keys
// [key_begin(i), key_end(i + 1)) of detail::Band, so each element costs two integer compares
// and a select (per-element Band::visible compiled to 64-bit branches and spilled).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], const detail::Band& band,
                                           const RowCoords<kMTiles>& rows, int len_k, int n0, int lane) {
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) {
    const int lo = static_cast<int>(band.key_begin(rows.i(r), len_k)) - n0;
    const int hi = static_cast<int>(band.key_end(rows.i(r) + 1, len_k)) - n0;
    const int mi = r / 2, e0 = 2 * (r % 2);
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int e = e0; e < e0 + 2; ++e) {
        const int j = fragment_col(ni, e, lane);
        s[mi][ni][e] = j >= lo && j < hi ? s[mi][ni][e] : -INFINITY;
      }
  }
}

// Zero the dropped probabilities (after the softmax has summed them into l, which normalises over
// every key); the 1/(1-p) rescale is folded into the epilogue's 1/l. Entries 2c and 2c+1 share one
// Philox call (same column group of 4).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_dropout(float (&s)[kMTiles][kNTiles][4], const detail::FwdParams& p,
                                              const std::uint32_t (&row_id)[2 * kMTiles], int n0, int lane) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = n0 + fragment_col(ni, 0, lane);
        const detail::Philox4 w =
            detail::dropout_words(p.seed, p.offset, row_id[2 * mi + half], static_cast<std::uint32_t>(j) / 4);
        // j is even, so j and j + 1 are words j%4 and j%4 + 1 of one group: dropout_keep's rule,
        // with the word picked by selects (a run-time array index would go to local memory).
        const bool low_pair = (j & 3) == 0;
        const std::uint32_t r0 = low_pair ? w.x[0] : w.x[2], r1 = low_pair ? w.x[1] : w.x[3];
        if (r0 < p.dropout_threshold) s[mi][ni][2 * half] = 0.0f;
        if (r1 < p.dropout_threshold) s[mi][ni][2 * half + 1] = 0.0f;
      }
}

// The band of one (query block, key block) tile in 32-bit tile-relative coordinates: query i0 + di
// sees key j0 + dj iff lo <= dj - di <= hi and j0 + dj < len_k (detail::Band::visible rewritten
// for offsets: i + diag - left <= j <= i + diag + right). Any fragment layout can test its
// elements with it, rows being queries or keys.
struct TileBand {
  int lo, hi, keys;  // keys: valid keys from j0 on

  __device__ __forceinline__ TileBand(const detail::Band& band, std::int64_t i0, std::int64_t j0, int len_k) {
    auto clamp32 = [](std::int64_t x) {
      return static_cast<int>(x > INT32_MAX ? INT32_MAX : (x < INT32_MIN ? INT32_MIN : x));
    };
    const std::int64_t diag = i0 + band.diag - j0;
    hi = band.right < 0 ? INT32_MAX : clamp32(diag + band.right);
    lo = band.left < 0 ? INT32_MIN : clamp32(diag - band.left);
    keys = clamp32(len_k - j0);
  }
  __device__ __forceinline__ bool visible(int di, int dj) const {
    const int t = dj - di;
    return t >= lo && t <= hi && dj < keys;
  }
};

}  // namespace flashmonoid::cuda
