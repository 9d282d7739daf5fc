// Score modifications, masks and dropout on register fragments, for the forward and the backward,
// each a direct use of the shared definitions in flashmonoid/detail/ (mask.hpp, philox.hpp), so
// that the GPU keeps and drops exactly the elements the CPU does, in both directions.
//
// Interface. A kernel names each accumulator element by tile-local (query qi, key kj) through a
// small coordinate functor, so that one helper serves every fragment layout:
//   FragCoords<kRowsAreKeys>   m16n8 accumulators (mma.sync, and wgmma's per-warp 16 rows):
//       element e of n tile ni, m tile mi sits at row row0 + 16·mi + 8·(e/2), column
//       col0 + 8·ni + (e & 1), with row0 = (the warp's first row) + lane/4, col0 = 2·(lane%4).
//       Rows are queries in the forward (S), keys in the backward (Sᵀ, dPᵀ): the sm80 backward's
//       warp tiles and the sm90 backward's Sᵀ (row 16·warp + lane/4 + 8·(e/2), column 8·j + ...)
//       are both FragCoords<true>.
//   TileBand      detail::Band for one (query block i0.., key block j0..) tile in 32-bit offsets:
//       visible(qi, kj) = key_visible(qi, kj) && query_valid(qi) (band and both sequence ends),
//       alibi_distance(qi, kj) = i + diag - j.
//   ScoreMod      raw q·k -> score in log2 units (scale, softcap), and for the backward the
//       softcap derivative d(cap·tanh(x/cap))/dx = 1 - tanh²(x/cap) by which dS is multiplied.
//   alibi_log2    ALiBi's bias in log2 units from the distance (detail::alibi_bias_at).
//   dropout_keep_bits / dropout_pair_words   the Philox keep rule (detail::dropout_words) for 32
//       consecutive keys of a row (the backward's per-tile bit table, dropout_keep_tile) or an
//       even/odd key pair (the forward's fragments); apply_dropout zeroes the forward's dropped P.
//   apply_mask    the forward's per-row form of the band (a compare or a bit per element, a select).
// Forward fragment helpers (ScoreMod::apply, apply_mask, apply_dropout) index query rows through
// RowCoords (GQA packing) and columns with fragment_col.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "api/params.hpp"
#include "common/softmax.cuh"
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

// Tile-local (query, key) of the elements of m16n8 accumulator fragments (see the top of the file).
template <bool kRowsAreKeys>
struct FragCoords {
  int row0, col0, lane;
  __device__ __forceinline__ FragCoords(int warp_row0, int warp_col0, int lane_)
      : row0(warp_row0), col0(warp_col0 + 2 * (lane_ % 4)), lane(lane_) {}
  __device__ __forceinline__ int row(int mi, int e) const { return row0 + 16 * mi + lane / 4 + 8 * (e / 2); }
  __device__ __forceinline__ int col(int ni, int e) const { return col0 + 8 * ni + (e & 1); }
  __device__ __forceinline__ int query(int mi, int ni, int e) const { return kRowsAreKeys ? col(ni, e) : row(mi, e); }
  __device__ __forceinline__ int key(int mi, int ni, int e) const { return kRowsAreKeys ? row(mi, e) : col(ni, e); }
};

// detail::Band on the tile of queries i0 + qi (qi < queries) and keys j0 + kj (kj < keys): for
// key kj and query qi, i + diag - j = qi - kj + diag_ij. 32-bit per-tile forms of the 64-bit
// per-element indices, which cost ptxas 64 bytes of spills in the backward at hdim 128.
struct TileBand {
  int diag_ij;       // i0 + diag - j0
  int dk_lo, dk_hi;  // visible band: dk_lo <= kj - qi <= dk_hi
  int keys, queries;

  __device__ __forceinline__ TileBand(const detail::Band& band, std::int64_t i0, std::int64_t j0, int queries_,
                                      int keys_)
      : keys(keys_), queries(queries_) {
    const std::int64_t d = i0 + band.diag - j0;
    diag_ij = clamp32(d);
    dk_hi = band.right < 0 ? INT32_MAX : clamp32(d + band.right);
    dk_lo = band.left < 0 ? INT32_MIN : clamp32(d - band.left);
  }
  // Key kj exists and query qi sees it; whether query qi exists is query_valid(qi).
  __device__ __forceinline__ bool key_visible(int qi, int kj) const {
    return kj < keys && kj - qi <= dk_hi && kj - qi >= dk_lo;
  }
  __device__ __forceinline__ bool query_valid(int qi) const { return qi < queries; }
  __device__ __forceinline__ bool visible(int qi, int kj) const { return key_visible(qi, kj) && query_valid(qi); }
  __device__ __forceinline__ int alibi_distance(int qi, int kj) const { return qi - kj + diag_ij; }

 private:
  __device__ static __forceinline__ int clamp32(std::int64_t x) {
    return static_cast<int>(x > INT32_MAX ? INT32_MAX : x < INT32_MIN ? INT32_MIN : x);
  }
};

// ALiBi's bias in log2 units (slope_log2 = slope·log2 e) at distance i + diag - j.
__device__ __forceinline__ float alibi_log2(float slope_log2, int distance) {
  return detail::alibi_bias_at(slope_log2, distance);
}

// tanh(x) for x = qk·scale / softcap, from e = 2^(tanh_mul·|qk|) = e^(2|x|) (ScoreMod::tanh_mul):
// sign(x)·(1 - r), r = 2 / (e + 1). Two MUFU operations (ex2, rcp) and four others, where tanhf adds
// a degree-9 polynomial below |x| 0.6 and selects, 17 instructions in all (softcap's forward
// executed 4.8x the plain kernel's instructions: H100, ncu, hdim 128 16k). Absolute error below
// 1e-6 (ex2.approx 2 ulp, rcp.approx 1 ulp), < 5e-5 in a score capped at 50: far below bf16/fp16
// rounding of P. tanh.approx is one MUFU operation, but its 2^-11 relative error times a softcap of
// ~30 moves scores by ~0.015.
__device__ __forceinline__ float softcap_tanh(float qk, float tanh_mul) {
  return copysignf(1.0f - 2.0f * fast_rcp(fast_exp2(tanh_mul * fabsf(qk)) + 1.0f), qk);
}

// Softcap and ALiBi. Turns raw q·k into scores in log2 units (the softmax multiplier becomes 1):
// s = scale·qk, s = softcap·tanh(s/softcap) (softcap_tanh), s -= slope·|i + diag - j|, all times
// log2(e).
struct ScoreMod {
  float scale_log2 = 1.0f;  // scale·log2(e)
  float tanh_mul = 0.0f;    // 2·log2(e)·scale / softcap: softcap_tanh's multiplier of qk
  float cap_log2 = 0.0f;    // softcap·log2(e)
  bool softcap = false;
  bool alibi = false;

  __host__ __device__ explicit ScoreMod(const detail::FwdParams& p)
      : scale_log2(p.scale_log2),
        tanh_mul(p.softcap > 0.0f ? 2.0f * kLog2e * p.scale / p.softcap : 0.0f),
        cap_log2(p.softcap * kLog2e),
        softcap(p.softcap > 0.0f),
        alibi(p.alibi != nullptr) {}
  __device__ __forceinline__ bool active() const { return softcap || alibi; }
  // Raw q·k -> scale·q·k (or its softcapped form) in log2 units.
  __device__ __forceinline__ float log2_score(float qk) const {
    return softcap ? cap_log2 * softcap_tanh(qk, tanh_mul) : qk * scale_log2;
  }
  // The same, and d(score)/d(scale·q·k) for the backward's dS: 1 - tanh² under softcap, else 1.
  // The uncapped form is computed unconditionally: as an else branch it cost a jump per element.
  __device__ __forceinline__ float log2_score(float qk, float& dscore) const {
    float x = qk * scale_log2;
    dscore = 1.0f;
    if (softcap) {
      // tanhf here, not softcap_tanh: with it the hdim-128 sm90 backward's score-modifier kernel spilled
      // 8 bytes (ptxas; three leaner forms tried). The two differ by < 1e-6 in tanh, so the
      // backward's recomputed P matches the forward's lse far below bf16/fp16 rounding.
      const float th = tanhf(qk * (0.5f * detail::kLn2 * tanh_mul));
      dscore = 1.0f - th * th;
      x = th * cap_log2;
    }
    return x;
  }
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
          float x = log2_score(s[mi][ni][e]);
          if (alibi) x += detail::alibi_bias(slope_log2[r], rows.i(r), n0 + fragment_col(ni, e, lane), diag);
          s[mi][ni][e] = x;
        }
  }
};

// -inf outside the band and past the sequence's last key; only called on tiles that
// detail::Band::tile_needs_mask flags (the diagonal and ragged tiles). Row i sees exactly the keys
// [key_begin(i), key_end(i + 1)) of detail::Band; per-element Band::visible compiled to 64-bit
// branches and spilled, so each row's bounds are taken once, relative to the tile, and each element
// is selected (FSEL) by one of two predicate forms (kBits):
// - compare: an integer compare per element (two with a left bound);
// - bits: a lane holds a row's columns 8·ni + c0 + q (c0 = 2·(lane % 4), q = 0, 1), so for each row
//   and q the visible ni form one run: a bit mask of it, whose bits ptxas moves into predicates 7 at
//   a time (R2P; FlashAttention-4's mask_r2p). Fewer instructions (hdim 64 sm90 short_band: 466 ->
//   117 ISETP in SASS; the diagonal step's mask was 10% of that kernel's instructions), but in a
//   kernel's code it changes ptxas's register assignment of the whole mainloop (the exponents' FFMAs
//   lose their operand reuse), which costs 1.7-3.9% at 16k keys even where no mask runs (H100), so
//   only the kernels of short causal work take it (FwdTileSm90::mask_bits).
// Without a left bound (causal, right windows, ragged ends: key_begin is 0) there is one bound.
template <bool kLeft, int kNTiles>
__device__ __forceinline__ std::uint32_t visible_tiles(int lo, int hi) {
  static_assert(kNTiles < 32, "one 32-bit mask per row covers the key tile's columns");
  // ceil(x / 8) by an arithmetic shift (negative x too), clamped to [0, kNTiles].
  auto tiles_below = [](int x) {
    const int n = (x + 7) >> 3;
    return n < 0 ? 0 : n > kNTiles ? kNTiles : n;
  };
  const std::uint32_t below_hi = (1u << tiles_below(hi)) - 1u;
  return kLeft ? below_hi & ~((1u << tiles_below(lo)) - 1u) : below_hi;
}
template <bool kLeft, bool kBits, int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_rows(float (&s)[kMTiles][kNTiles][4], const detail::Band& band,
                                          const RowCoords<kMTiles>& rows, int len_k, int n0, int lane) {
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) {
    int lo = kLeft ? static_cast<int>(band.key_begin(rows.i(r), len_k)) - n0 : 0;
    int hi = static_cast<int>(band.key_end(rows.i(r) + 1, len_k)) - n0;
    const int mi = r / 2, e0 = 2 * (r % 2);
    if constexpr (kBits) {
      constexpr int kSpan = 8 * kNTiles + 8;  // bounds clamped to [-8, kSpan]: the shifts cannot overflow
      const int c0 = fragment_col(0, 0, lane);
      lo = lo < -8 ? -8 : lo > kSpan ? kSpan : lo;
      hi = hi < -8 ? -8 : hi > kSpan ? kSpan : hi;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const std::uint32_t keep = visible_tiles<kLeft, kNTiles>(lo - c0 - q, hi - c0 - q);
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) s[mi][ni][e0 + q] = (keep >> ni) & 1u ? s[mi][ni][e0 + q] : -INFINITY;
      }
    } else {
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = e0; e < e0 + 2; ++e) {
          const int j = fragment_col(ni, e, lane);
          s[mi][ni][e] = j < hi && (!kLeft || j >= lo) ? s[mi][ni][e] : -INFINITY;
        }
    }
  }
}
template <bool kBits = false, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], const detail::Band& band,
                                           const RowCoords<kMTiles>& rows, int len_k, int n0, int lane) {
  if (band.left < 0) {
    mask_rows<false, kBits>(s, band, rows, len_k, n0, lane);
    return;
  }
  mask_rows<true, kBits>(s, band, rows, len_k, n0, lane);
}

// Dropout's keep bits of keys [key0, key0 + 32) of the row row_id (key0 a multiple of 4): bit c
// keeps key key0 + c. One Philox call per 4 keys (its 4 words), detail::dropout_keep's rule.
__device__ __forceinline__ std::uint32_t dropout_keep_bits(const detail::FwdParams& p, std::uint32_t row_id,
                                                           std::uint32_t key0) {
  std::uint32_t bits = 0;
#pragma unroll 1
  for (int g = 0; g < 8; ++g) {
    const detail::Philox4 r = detail::dropout_words(p.seed, p.offset, row_id, key0 / 4 + g);
#pragma unroll
    for (int c = 0; c < 4; ++c) bits |= static_cast<std::uint32_t>(r.x[c] >= p.dropout_threshold) << (4 * g + c);
  }
  return bits;
}

// Dropout keep bits of a backward step's tile (query rows row0.. of one head, keys key0 + 32·w ..)
// into shared memory: word qr · words + w holds keys key0 + 32·w .. of row row0 + qr (rows past
// the sequence keep nothing). One Philox call per 4 keys (its 4 words) rather than one per element
// as a fragment evaluation would need (a lane's fragment holds keys 8 apart). Threads tid of
// nthreads share the rows · words words.
__device__ __forceinline__ void dropout_keep_tile(const detail::FwdParams& p, int head, const detail::SeqInfo& si,
                                                  std::int64_t row0, int rows, std::int64_t key0, int words,
                                                  std::uint32_t* keep, int tid, int nthreads) {
#pragma unroll 1
  for (int word = tid; word < rows * words; word += nthreads) {
    const int qr = word / words, w = word % words;
    std::uint32_t bits = 0;
    if (row0 + qr < si.len_q)
      bits = dropout_keep_bits(p, detail::dropout_row_id(p, head, si, row0 + qr), static_cast<std::uint32_t>(key0 + 32 * w));
    keep[word] = bits;
  }
}

// The random words of keys j and j + 1 (j even) of row row_id: words j%4 and j%4 + 1 of one
// Philox group, picked by selects (a run-time array index would go to local memory). A key is
// kept iff its word >= p.dropout_threshold.
__device__ __forceinline__ void dropout_pair_words(const detail::FwdParams& p, std::uint32_t row_id, int j,
                                                   std::uint32_t& w0, std::uint32_t& w1) {
  const detail::Philox4 w = detail::dropout_words(p.seed, p.offset, row_id, static_cast<std::uint32_t>(j) / 4);
  const bool low_pair = (j & 3) == 0;
  w0 = low_pair ? w.x[0] : w.x[2];
  w1 = low_pair ? w.x[1] : w.x[3];
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
        std::uint32_t r0, r1;
        dropout_pair_words(p, row_id[2 * mi + half], n0 + fragment_col(ni, 0, lane), r0, r1);
        if (r0 < p.dropout_threshold) s[mi][ni][2 * half] = 0.0f;
        if (r1 < p.dropout_threshold) s[mi][ni][2 * half + 1] = 0.0f;
      }
}

}  // namespace flashmonoid::cuda
