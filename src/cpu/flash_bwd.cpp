// CPU flash backward (FlashAttention-2), deterministic for any thread count: no two threads ever
// write the same output element, and every sum runs in a fixed order.
//   pass 0: D = rowsum(dO ∘ O) for every (head, query row).
//   pass 1: threads over (batch, KV head, key block); each accumulates its dK, dV rows over all
//           query heads of the GQA group and all query blocks, recomputing P from lse.
//   pass 2: threads over (batch, query head, query block); each accumulates its dQ rows over the
//           key blocks, recomputing P and dP.
// Pass 2 recomputes two of pass 1's four products (7 block products instead of FlashAttention-2's
// 5 with atomic dQ): the price of determinism without per-thread dQ copies.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/flash_tiles.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace flashmonoid::cpu {
namespace {

using detail::Band;
using detail::BwdParams;
using detail::SeqInfo;
using tiles::kLanes;

// 64×64 tiles: the backward keeps six (64, d) operand tiles and three (64, 64) score tiles per
// thread, 144 KiB at d = 128, inside the 1 MiB L2.
constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // keys per tile
static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "tiles must be multiples of the 16-column panel");

// Blocks of `block` rows per batch entry, numbered across the batch: entry b owns [first[b], first[b+1]).
struct BlockGrid {
  std::vector<std::int64_t> first;
  BlockGrid(const BwdParams& p, int block, bool keys) : first(p.batch + 1, 0) {
    for (int b = 0; b < p.batch; ++b) {
      SeqInfo si = seq_info(p, b);
      first[b + 1] = first[b] + ((keys ? si.len_k : si.len_q) + block - 1) / block;
    }
  }
  std::int64_t total() const { return first.back(); }
  int batch_of(std::int64_t block) const {
    return static_cast<int>(std::upper_bound(first.begin(), first.end(), block) - first.begin()) - 1;
  }
};

// K and V of every (key block, KV head) in fp32, in the four layouts the products read, zero-padded:
// Kᵀ, Vᵀ (d, kBlockN) and K, V (kBlockN, dp). O(total_k·h_k·d) memory, converted once.
struct PackedKV {
  int d = 0, dp = 0;
  std::vector<float> kt, vt, k, v;
  const float* kt_tile(std::int64_t t) const { return kt.data() + t * d * kBlockN; }
  const float* vt_tile(std::int64_t t) const { return vt.data() + t * d * kBlockN; }
  const float* k_tile(std::int64_t t) const { return k.data() + t * kBlockN * dp; }
  const float* v_tile(std::int64_t t) const { return v.data() + t * kBlockN * dp; }
};

void size_packed(const BwdParams& p, const BlockGrid& kgrid, PackedKV& kv) {
  kv.d = p.d;
  kv.dp = tiles::round_up(p.d, kLanes);
  const std::int64_t n_tiles = kgrid.total() * p.h_k;  // tile index: key block · h_k + KV head
  kv.kt.resize(static_cast<std::size_t>(n_tiles) * p.d * kBlockN);
  kv.vt.resize(kv.kt.size());
  kv.k.resize(static_cast<std::size_t>(n_tiles) * kBlockN * kv.dp);
  kv.v.resize(kv.k.size());
}

void pack_tile(const BwdParams& p, const BlockGrid& kgrid, PackedKV& kv, std::int64_t t, float* row) {
  const std::int64_t block = t / p.h_k;
  const int hk = static_cast<int>(t % p.h_k);
  const int b = kgrid.batch_of(block);
  const SeqInfo si = seq_info(p, b);
  const std::int64_t j0 = (block - kgrid.first[b]) * kBlockN;
  const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
  const std::int64_t r0 = si.k_row0 + j0;
  tiles::load_tile_transposed(p.k, p.dtype, p.k_stride, b, r0, hk, n, p.d, kBlockN, 1.0f, row,
                              kv.kt.data() + t * p.d * kBlockN);
  tiles::load_tile_transposed(p.v, p.dtype, p.v_stride, b, r0, hk, n, p.d, kBlockN, 1.0f, row,
                              kv.vt.data() + t * p.d * kBlockN);
  tiles::load_tile(p.k, p.dtype, p.k_stride, b, r0, hk, n, kBlockN, p.d, kv.dp, 1.0f, kv.k.data() + t * kBlockN * kv.dp);
  tiles::load_tile(p.v, p.dtype, p.v_stride, b, r0, hk, n, kBlockN, p.d, kv.dp, 1.0f, kv.v.data() + t * kBlockN * kv.dp);
}

// Pass 0: dsum[lse_index(b, head, i)] = Σ_c dO[i, c] · O[i, c] (accumulated in double) for the
// rows of query block `block` (numbered across the batch) of head hq. o, dout: (d) staging rows.
void row_dot(const BwdParams& p, const BlockGrid& qgrid, std::int64_t block, int hq, float* o, float* dout,
             std::vector<float>& dsum) {
  const int b = qgrid.batch_of(block);
  const SeqInfo si = seq_info(p, b);
  const std::int64_t i0 = (block - qgrid.first[b]) * kBlockM;
  const std::int64_t i1 = std::min<std::int64_t>(i0 + kBlockM, si.len_q);
  for (std::int64_t i = i0; i < i1; ++i) {
    tiles::load_row(p.out, p.dtype, offset_of(p.o_stride, b, si.q_row0 + i, hq), p.d, 1.0f, o);
    tiles::load_row(p.dout, p.dtype, offset_of(p.do_stride, b, si.q_row0 + i, hq), p.d, 1.0f, dout);
    double acc = 0.0;
    for (int c = 0; c < p.d; ++c) acc += static_cast<double>(o[c]) * dout[c];
    dsum[lse_index(p, b, hq, si, i)] = static_cast<float>(acc);
  }
}

// The gradient of one row of a score tile. Element c is query i, key j = ij(c). On entry s[c] is
// scale·q·k and dp[c] = dO·v; lse[c], dsum[c] are those of element c's query row, lse with -inf
// replaced by +inf so that exp(s - lse) is exactly 0 for a row that saw no key. On return
//   s[c]  = P·Z                      (Z = keep/(1-p), or 1 without dropout): the dV operand
//   dp[c] = ds_mul · P∘(dP·Z − D) · (1 − tanh²)   (softcap chain rule): the dK / dQ operand.
// cnt is the number of valid elements; s and dp have room for round_up(cnt, 8).
template <class IJ>
void score_grads(const BwdParams& p, const Band& band, float slope, bool needs_mask, int hq, const SeqInfo& si,
                 int cnt, IJ ij, const float* lse, const float* dsum, float ds_mul, float* s, float* dp, float* th) {
  if (p.softcap > 0.0f) {
    const float inv = 1.0f / p.softcap;
    for (int c = 0; c < cnt; ++c) {
      th[c] = std::tanh(s[c] * inv);
      s[c] = p.softcap * th[c];
    }
  }
  if (p.alibi != nullptr)
    for (int c = 0; c < cnt; ++c) {
      auto [i, j] = ij(c);
      s[c] += detail::alibi_bias(slope, i, j, band.diag);
    }
  if (needs_mask)
    for (int c = 0; c < cnt; ++c) {
      auto [i, j] = ij(c);
      if (!band.visible(i, j)) s[c] = -INFINITY;
    }
  for (int c = 0; c < cnt; c += kLanes)
    _mm256_storeu_ps(s + c, tiles::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), _mm256_loadu_ps(lse + c))));

  if (p.dropout_p > 0.0f) {
    for (int c = 0; c < cnt; ++c) {
      auto [i, j] = ij(c);
      const bool keep = detail::dropout_keep(p.seed, p.offset, p.dropout_threshold,
                                             detail::dropout_row_id(p, hq, si, i), static_cast<std::uint32_t>(j));
      const float z = keep ? p.dropout_rescale : 0.0f;
      const float prob = s[c];
      dp[c] = prob * (dp[c] * z - dsum[c]);
      s[c] = prob * z;
    }
  } else {
    for (int c = 0; c < cnt; ++c) dp[c] = s[c] * (dp[c] - dsum[c]);
  }
  if (p.softcap > 0.0f)
    for (int c = 0; c < cnt; ++c) dp[c] *= 1.0f - th[c] * th[c];
  for (int c = 0; c < cnt; ++c) dp[c] *= ds_mul;
}

// (kBlockM) lse of rows [i0, i0 + m) of head hq with -inf -> +inf, padding +inf; dsum likewise (0).
void load_row_stats(const BwdParams& p, const std::vector<float>& dsum_all, int b, int hq, const SeqInfo& si,
                    std::int64_t i0, int m, float* lse, float* dsum) {
  for (int r = 0; r < kBlockM; ++r) {
    if (r < m) {
      const std::int64_t idx = lse_index(p, b, hq, si, i0 + r);
      lse[r] = p.lse[idx] == -INFINITY ? INFINITY : p.lse[idx];
      dsum[r] = dsum_all[idx];
    } else {
      lse[r] = INFINITY;
      dsum[r] = 0.0f;
    }
  }
}

// Whether any (query, key) pair of the tile is visible: bands are monotone in the row, so the
// first row's first key and the last row's end bound the whole tile.
bool tile_visible(const Band& band, std::int64_t i0, int m, std::int64_t j0, int n, std::int64_t len_k) {
  return band.key_begin(i0, len_k) < j0 + n && band.key_end(i0 + m, len_k) > j0;
}

// Pass 1: dK, dV of key block kb of KV head hk.
struct KeyWorkspace {
  int dp;
  std::vector<float> qt, q, dot, dout;  // (d, kBlockM) (scale·Q)ᵀ, (kBlockM, dp) scale·Q, dOᵀ, dO
  std::vector<float> st, dpt, th;       // (kBlockN, kBlockM) Sᵀ -> (P·Z)ᵀ, dPᵀ -> dSᵀ, tanh
  std::vector<float> dk, dv;            // (kBlockN, dp) accumulators
  std::vector<float> lse, dsum, row;    // (kBlockM), (kBlockM), (d)
  explicit KeyWorkspace(int d)
      : dp(tiles::round_up(d, kLanes)), qt(static_cast<std::size_t>(d) * kBlockM), q(kBlockM * dp), dot(qt.size()),
        dout(q.size()), st(kBlockN * kBlockM), dpt(st.size()), th(st.size()), dk(kBlockN * dp), dv(dk.size()),
        lse(kBlockM), dsum(kBlockM), row(d) {}
};

void key_block(const BwdParams& p, const PackedKV& kv, const std::vector<float>& dsum_all, int b, std::int64_t tile,
               std::int64_t j0, int hk, KeyWorkspace& ws) {
  const SeqInfo si = seq_info(p, b);
  const Band band = band_of(p, si);
  const int d = p.d, dp = ws.dp;
  const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
  std::fill(ws.dk.begin(), ws.dk.end(), 0.0f);
  std::fill(ws.dv.begin(), ws.dv.end(), 0.0f);

  for (int hq = hk * p.group(); hq < (hk + 1) * p.group(); ++hq) {
    const float slope = detail::alibi_slope(p, b, hq);
    for (std::int64_t i0 = 0; i0 < si.len_q; i0 += kBlockM) {
      const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
      if (!tile_visible(band, i0, m, j0, n, si.len_k)) continue;
      const std::int64_t r0 = si.q_row0 + i0;
      tiles::load_tile_transposed(p.q, p.dtype, p.q_stride, b, r0, hq, m, d, kBlockM, p.scale, ws.row.data(), ws.qt.data());
      tiles::load_tile(p.q, p.dtype, p.q_stride, b, r0, hq, m, m, d, dp, p.scale, ws.q.data());
      tiles::load_tile_transposed(p.dout, p.dtype, p.do_stride, b, r0, hq, m, d, kBlockM, 1.0f, ws.row.data(), ws.dot.data());
      tiles::load_tile(p.dout, p.dtype, p.do_stride, b, r0, hq, m, m, d, dp, 1.0f, ws.dout.data());
      load_row_stats(p, dsum_all, b, hq, si, i0, m, ws.lse.data(), ws.dsum.data());

      // Sᵀ (n, kBlockM) = K (n, d) · (scale·Q)ᵀ (d, kBlockM);  dPᵀ (n, kBlockM) = V (n, d) · dOᵀ (d, kBlockM)
      tiles::gemm<false>(n, kBlockM, d, kv.k_tile(tile), dp, ws.qt.data(), kBlockM, ws.st.data(), kBlockM);
      tiles::gemm<false>(n, kBlockM, d, kv.v_tile(tile), dp, ws.dot.data(), kBlockM, ws.dpt.data(), kBlockM);
      const bool needs_mask = band.tile_needs_mask(i0, i0 + m, j0, j0 + n, si.len_k);
      for (int r = 0; r < n; ++r) {
        const std::int64_t j = j0 + r;
        auto ij = [i0, j](int c) { return std::pair<std::int64_t, std::int64_t>{i0 + c, j}; };
        score_grads(p, band, slope, needs_mask, hq, si, m, ij, ws.lse.data(), ws.dsum.data(), 1.0f,
                    ws.st.data() + r * kBlockM, ws.dpt.data() + r * kBlockM, ws.th.data() + r * kBlockM);
      }
      // dV (n, dp) += (P·Z)ᵀ (n, m) · dO (m, dp);  dK (n, dp) += dSᵀ (n, m) · (scale·Q) (m, dp)
      tiles::gemm<true>(n, dp, m, ws.st.data(), kBlockM, ws.dout.data(), dp, ws.dv.data(), dp);
      tiles::gemm<true>(n, dp, m, ws.dpt.data(), kBlockM, ws.q.data(), dp, ws.dk.data(), dp);
    }
  }
  for (int r = 0; r < n; ++r) {
    tiles::store_row(p.dk, p.dtype, offset_of(p.dk_stride, b, si.k_row0 + j0 + r, hk), d, ws.dk.data() + r * dp);
    tiles::store_row(p.dv, p.dtype, offset_of(p.dv_stride, b, si.k_row0 + j0 + r, hk), d, ws.dv.data() + r * dp);
  }
}

// Pass 2: dQ of query block (rows i0 ..) of head hq.
struct QueryWorkspace {
  int dp;
  std::vector<float> q, dout;    // (kBlockM, d) scale·Q, dO
  std::vector<float> s, dps, th; // (kBlockM, kBlockN) S -> P, dP -> scale·dS, tanh
  std::vector<float> dq;         // (kBlockM, dp) accumulator
  std::vector<float> lse, dsum;  // (kBlockN) one row's value repeated, for score_grads
  std::vector<float> row_lse, row_dsum;  // (kBlockM)
  std::vector<float> row;                // (d) staging row
  explicit QueryWorkspace(int d)
      : dp(tiles::round_up(d, kLanes)), q(kBlockM * d), dout(q.size()), s(kBlockM * kBlockN), dps(s.size()),
        th(s.size()), dq(kBlockM * dp), lse(kBlockN), dsum(kBlockN), row_lse(kBlockM), row_dsum(kBlockM), row(d) {}
};

void query_block(const BwdParams& p, const PackedKV& kv, const BlockGrid& kgrid, const std::vector<float>& dsum_all,
                 int b, int hq, std::int64_t i0, QueryWorkspace& ws) {
  const SeqInfo si = seq_info(p, b);
  const Band band = band_of(p, si);
  const int d = p.d, dp = ws.dp, hk = hq / p.group();
  const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
  const float slope = detail::alibi_slope(p, b, hq);
  const std::int64_t r0 = si.q_row0 + i0;
  tiles::load_tile(p.q, p.dtype, p.q_stride, b, r0, hq, m, m, d, d, p.scale, ws.q.data());
  tiles::load_tile(p.dout, p.dtype, p.do_stride, b, r0, hq, m, m, d, d, 1.0f, ws.dout.data());
  load_row_stats(p, dsum_all, b, hq, si, i0, m, ws.row_lse.data(), ws.row_dsum.data());
  std::fill(ws.dq.begin(), ws.dq.end(), 0.0f);

  for (std::int64_t j0 = 0; j0 < si.len_k; j0 += kBlockN) {
    const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
    if (!tile_visible(band, i0, m, j0, n, si.len_k)) continue;
    const std::int64_t tile = (kgrid.first[b] + j0 / kBlockN) * p.h_k + hk;
    // S (m, kBlockN) = (scale·Q) (m, d) · Kᵀ (d, kBlockN);  dP (m, kBlockN) = dO (m, d) · Vᵀ (d, kBlockN)
    tiles::gemm<false>(m, kBlockN, d, ws.q.data(), d, kv.kt_tile(tile), kBlockN, ws.s.data(), kBlockN);
    tiles::gemm<false>(m, kBlockN, d, ws.dout.data(), d, kv.vt_tile(tile), kBlockN, ws.dps.data(), kBlockN);
    const bool needs_mask = band.tile_needs_mask(i0, i0 + m, j0, j0 + n, si.len_k);
    for (int r = 0; r < m; ++r) {
      const std::int64_t i = i0 + r;
      std::fill(ws.lse.begin(), ws.lse.end(), ws.row_lse[r]);
      std::fill(ws.dsum.begin(), ws.dsum.end(), ws.row_dsum[r]);
      auto ij = [i, j0](int c) { return std::pair<std::int64_t, std::int64_t>{i, j0 + c}; };
      score_grads(p, band, slope, needs_mask, hq, si, n, ij, ws.lse.data(), ws.dsum.data(), p.scale,
                  ws.s.data() + r * kBlockN, ws.dps.data() + r * kBlockN, ws.th.data() + r * kBlockN);
    }
    // dQ (m, dp) += scale·dS (m, n) · K (n, dp)
    tiles::gemm<true>(m, dp, n, ws.dps.data(), kBlockN, kv.k_tile(tile), dp, ws.dq.data(), dp);
  }
  for (int r = 0; r < m; ++r)
    tiles::store_row(p.dq, p.dtype, offset_of(p.dq_stride, b, r0 + r, hq), d, ws.dq.data() + r * dp);
}

}  // namespace

void flash_backward(const BwdParams& p, int num_threads) {
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const BlockGrid qgrid(p, kBlockM, false), kgrid(p, kBlockN, true);
  std::vector<float> dsum(static_cast<std::size_t>(p.h) * p.total_q);
  PackedKV kv;
  size_packed(p, kgrid, kv);

  // One parallel region, its loops separated by barriers: on a loaded 2-core machine each
  // fork/join cost ~10 ms (see flash_fwd.cpp).
#pragma omp parallel num_threads(threads)
  {
    KeyWorkspace kws(p.d);
    QueryWorkspace qws(p.d);
#pragma omp for schedule(static) nowait
    for (std::int64_t t = 0; t < qgrid.total() * p.h; ++t)
      row_dot(p, qgrid, t / p.h, static_cast<int>(t % p.h), kws.row.data(), qws.row.data(), dsum);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < kgrid.total() * p.h_k; ++t) pack_tile(p, kgrid, kv, t, kws.row.data());

    // Dynamic: under causal masks the work of a key block shrinks with its index.
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t t = 0; t < kgrid.total() * p.h_k; ++t) {
      const std::int64_t block = t / p.h_k;
      const int b = kgrid.batch_of(block);
      key_block(p, kv, dsum, b, t, (block - kgrid.first[b]) * kBlockN, static_cast<int>(t % p.h_k), kws);
    }
#pragma omp for schedule(dynamic, 1) nowait
    for (std::int64_t t = 0; t < qgrid.total() * p.h; ++t) {
      const std::int64_t block = t / p.h;
      const int b = qgrid.batch_of(block);
      query_block(p, kv, kgrid, dsum, b, static_cast<int>(t % p.h), (block - qgrid.first[b]) * kBlockM, qws);
    }
  }
}

}  // namespace flashmonoid::cpu
