// CPU flash backward (FlashAttention-2), deterministic for any thread count: no two threads ever
// write the same output element, and every sum runs in an order fixed by the shape alone.
//   pass 0: Q, dO (and their transposes), K, V packed to fp32 tiles once; D = rowsum(dO ∘ O).
//   pass 1: threads over (batch, key chunk, KV head). A key chunk is a fixed run of key blocks;
//           for each of its key blocks the task accumulates dK, dV over all query heads of the GQA
//           group and all query blocks, and adds dS·K into the chunk's own partial dQ.
//   pass 2: threads over (batch, query head, query block): dQ = scale · Σ_c partial_c, chunks in
//           order.
// Five block products per tile pair, as FlashAttention-2 with atomic dQ. The earlier version
// recomputed S and dP in a separate dQ pass (7 products); the partials cost O(chunks·total_q·h·d)
// memory instead, the chunk count bounded by kMaxChunks (ChunkPlan). The packed copies and the
// partials are one region of the calling thread's kept scratch (cpu/scratch.hpp) up to 256 MiB.
//
// As in the forward (flash_fwd.cpp), bf16 inputs run the products on bf16 pairs where the kernel
// table has a bf16 dot product (AVX512_BF16): Q, K, V and dO stay exactly the input, Sᵀ is scaled
// in fp32 after its product and dK at its store, and P and dS are rounded to bf16 before the
// products that read them, as the FlashAttention rule's input-precision reference rounds them.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/flash_tiles.hpp"
#include "cpu/kernels.hpp"
#include "cpu/scratch.hpp"
#include "flashmonoid/detail/philox.hpp"

namespace flashmonoid::cpu {
namespace {

using detail::Band;
using detail::BwdParams;
using detail::SeqInfo;
using tiles::kLanes;

// 64×64 tiles: per thread four (64, 64) score tiles (64 KiB) and the dK, dV accumulators of
// key_group() key blocks (256 KiB at d = 128 for 4 of them), inside the 1 MiB L2. A sweep of
// 48×96, 96×48, 96×96 and 64×128 (s = 2k at d = 64 and 128, s = 1k causal at d = 128; 2 threads)
// found none faster than 64×64 by more than the machine's ±10% noise in every case.
constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // keys per tile
static_assert(kBlockM % 32 == 0 && kBlockN % 16 == 0,
              "kBlockM must be a multiple of the micro-kernels' panels (Kernels::panel), kBlockN of 16");

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

// Key chunks of pass 1, from the shape alone (never the thread count), so the order of the dQ sum
// is the same for any number of threads. A batch entry with nb key blocks takes
//   min(nb, max(lo, min(hi, nb / kMinChunkBlocks)))
// chunks: lo gives kMinTasks (batch, chunk, KV head) tasks whatever the chunks' size; hi up to
// kTargetTasks while a chunk keeps kMinChunkBlocks key blocks (one key group, key_group(), on
// the Xeon: smaller chunks read the query side once more per chunk) and the call's scratch with
// the partial dQ buffers past lo's (each the size of Q in fp32) stays within what a thread keeps
// (kKeepScratchBytes: past it every call faults its pages in again; 6 chunks at 8k keys lost 10%
// to that). On a 16-core Xeon (b = 1, h = h_k = 8, alternated rounds), against 16 tasks: 4k keys
// 1.19-1.23x at 16 threads, 1.15x at 12 (16 tasks leave 4 threads a second round), 1.11-1.22x at
// 8; 8k 1.27-1.31x at 16. At 2 threads on the EPYC 4k costs 2.5-5% (the partials' traffic). 8
// chunks of 2 blocks at 1k keys gained nothing on the Xeon and cost 5-10% at 2 threads.
constexpr int kMinTasks = 16;
constexpr int kTargetTasks = 64;
constexpr int kMinChunkBlocks = 8;
constexpr int kMaxChunks = 8;

// The chunks of every batch entry. The chunks split an entry's work, the query blocks that see
// each key block (Band::query_begin / query_end), into about equal shares, the blocks in order,
// each block in one chunk (a chunk may get none); evenly by block count where no query sees any
// key. Split by block count instead, a causal call's first chunk holds 3/4 of the work at 2 chunks
// (every later query sees its keys): at b = 1, h_k = 8 (16 tasks) on 16 threads the balanced split
// made the whole causal backward 1.25-1.34x faster on the Xeon; unchanged without a mask.
struct ChunkPlan {
  int max = 0;                       // the most chunks an entry takes: the number of dQ partials
  std::vector<int> used;             // (batch) chunks of each entry
  std::vector<std::int64_t> starts;  // (batch, kMaxChunks + 1) first key block of each chunk, then nb

  // partial_bytes: one dQ partial's scratch; other_bytes: the rest of the call's scratch.
  ChunkPlan(const BwdParams& p, const BlockGrid& kgrid, std::int64_t partial_bytes, std::int64_t other_bytes)
      : used(p.batch), starts(static_cast<std::size_t>(p.batch) * (kMaxChunks + 1)) {
    const auto chunks_for = [&](int tasks) {
      return std::clamp((tasks + p.batch * p.h_k - 1) / (p.batch * p.h_k), 1, kMaxChunks);
    };
    const int lo = chunks_for(kMinTasks);
    // No query rows (partial_bytes 0): no partials to bound; the chunks still split dK, dV's blocks.
    const std::int64_t room = static_cast<std::int64_t>(kKeepScratchBytes) - other_bytes - lo * partial_bytes;
    const std::int64_t extra = partial_bytes > 0 ? std::max<std::int64_t>(room, 0) / partial_bytes : kMaxChunks;
    const int hi = static_cast<int>(std::clamp<std::int64_t>(lo + extra, lo, chunks_for(kTargetTasks)));
    for (int b = 0; b < p.batch; ++b) {
      const std::int64_t nb = kgrid.first[b + 1] - kgrid.first[b];
      used[b] = static_cast<int>(std::min<std::int64_t>(nb, std::clamp<std::int64_t>(nb / kMinChunkBlocks, lo, hi)));
      max = std::max(max, used[b]);
      split(p, b, nb);
    }
  }
  const std::int64_t* of(int b) const { return starts.data() + static_cast<std::size_t>(b) * (kMaxChunks + 1); }

 private:
  void split(const BwdParams& p, int b, std::int64_t nb) {
    const SeqInfo si = seq_info(p, b);
    const Band band = band_of(p, si);
    std::vector<std::int64_t> before(nb + 1, 0);  // work of key blocks [0, kb)
    for (std::int64_t kb = 0; kb < nb; ++kb) {
      const std::int64_t j0 = kb * kBlockN, j1 = std::min<std::int64_t>(j0 + kBlockN, si.len_k);
      const std::int64_t q0 = band.query_begin(j0), q1 = band.query_end(j1, si.len_q);
      before[kb + 1] = before[kb] + (q1 > q0 ? (q1 + kBlockM - 1) / kBlockM - q0 / kBlockM : 0);
    }
    const std::int64_t total = before[nb];
    const int n = used[b];
    std::int64_t* st = starts.data() + static_cast<std::size_t>(b) * (kMaxChunks + 1);
    for (int c = 0; c < n; ++c)
      st[c] = total == 0 ? nb * c / n
                         : std::partition_point(before.begin(), before.end(),
                                                [&](std::int64_t w) { return w * n < total * c; }) -
                               before.begin();
    st[n] = nb;
  }
};

// An uninitialised array, a slice of the call's scratch (kept_scratch; flash_backward places every
// array once the shape has sized them). The packed copies and the dQ partials are written in full by
// the workers before anything reads them; std::vector's zero fill of them (24 MiB at s = 1k, d = 128,
// h = 4) ran on one thread before the parallel region and took every page fault there. Dropping it,
// with skipping untouched partials, took that shape (causal, 2 threads) from 39.6 to 26.5 ms.
template <class T>
struct Uninit {
  T* p = nullptr;
  std::size_t n = 0;
  void resize(std::size_t count) { n = count; }
  std::size_t bytes() const { return (n * sizeof(T) + 63) / 64 * 64; }
  void place(std::byte*& at) {
    p = reinterpret_cast<T*>(at);
    at += bytes();
  }
  T* data() { return p; }
  const T* data() const { return p; }
};
using Floats = Uninit<float>;
using Pairs = Uninit<std::uint32_t>;  // bf16 pairs (src/cpu/simd_bf16.hpp)

// Whether this call's products run on bf16 pairs.
bool pair_products(const BwdParams& p, const Kernels& kn) { return p.dtype == DType::bf16 && kn.gemm_bf16 != nullptr; }

// Rows r < n of a bf16 tile (element offset of row r: row(r)), as pairs: along d into (kBlockN, d2)
// rows (`along`, the A operand of Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ), and across rows into (rows / 2, dp)
// (`across`, the B operand of products summing over these rows); rows past n are zero.
template <class Row>
void pack_pairs(const void* base, Row&& row, int n, int rows, int d, int dp, std::uint32_t* along,
                std::uint32_t* across) {
  const auto* x = static_cast<const std::uint16_t*>(base);
  const int d2 = (d + 1) / 2;
  if (along != nullptr)
    for (int r = 0; r < rows; ++r) {
      std::uint32_t* dst = along + static_cast<std::int64_t>(r) * d2;
      if (r < n)
        tiles::pairs_of_row(x + row(r), d, dst);
      else
        std::fill(dst, dst + d2, 0u);
    }
  if (across != nullptr)
    for (int j = 0; j < rows / 2; ++j) {
      std::uint32_t* dst = across + static_cast<std::int64_t>(j) * dp;
      if (2 * j < n)
        tiles::pairs_across_rows(x + row(2 * j), 2 * j + 1 < n ? x + row(2 * j + 1) : nullptr, d, dp, dst);
      else
        std::fill(dst, dst + dp, 0u);
    }
}

// K and V of every (key block, KV head), zero-padded: every product reads them in these layouts
// (Kᵀ and Vᵀ were for the dQ pass that recomputed S and dP). O(total_k·h_k·d) memory, packed once.
// - fp32 products: k, v (kBlockN, dp) tiles converted to fp32;
// - bf16 products (`pairs`): k2, v2 (kBlockN, d2) pairs along d, and kx2 (kBlockN / 2, dp), K's
//   pairs across keys for dQ += dS·K.
struct PackedKV {
  int dp = 0, d2 = 0;
  bool pairs = false;
  Floats k, v;
  Pairs k2, v2, kx2;
  const float* k_tile(std::int64_t t) const { return k.data() + t * kBlockN * dp; }
  const float* v_tile(std::int64_t t) const { return v.data() + t * kBlockN * dp; }
  const std::uint32_t* k2_tile(std::int64_t t) const { return k2.data() + t * kBlockN * d2; }
  const std::uint32_t* v2_tile(std::int64_t t) const { return v2.data() + t * kBlockN * d2; }
  const std::uint32_t* kx2_tile(std::int64_t t) const { return kx2.data() + t * kBlockN / 2 * dp; }
};

void size_packed(const BwdParams& p, const BlockGrid& kgrid, bool pairs, PackedKV& kv) {
  kv.dp = tiles::round_up(p.d, kLanes);
  kv.d2 = (p.d + 1) / 2;
  kv.pairs = pairs;
  const auto n_tiles = static_cast<std::size_t>(kgrid.total() * p.h_k);  // tile: key block · h_k + KV head
  if (pairs) {
    kv.k2.resize(n_tiles * kBlockN * kv.d2);
    kv.v2.resize(n_tiles * kBlockN * kv.d2);
    kv.kx2.resize(n_tiles * kBlockN / 2 * kv.dp);
  } else {
    kv.k.resize(n_tiles * kBlockN * kv.dp);
    kv.v.resize(n_tiles * kBlockN * kv.dp);
  }
}

void pack_tile(const BwdParams& p, const BlockGrid& kgrid, PackedKV& kv, std::int64_t t) {
  const std::int64_t block = t / p.h_k;
  const int hk = static_cast<int>(t % p.h_k);
  const int b = kgrid.batch_of(block);
  const SeqInfo si = seq_info(p, b);
  const std::int64_t j0 = (block - kgrid.first[b]) * kBlockN;
  const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
  const std::int64_t r0 = si.k_row0 + j0;
  if (kv.pairs) {
    auto k_row = [&](int r) { return offset_of(p.k_stride, b, r0 + r, hk); };
    auto v_row = [&](int r) { return offset_of(p.v_stride, b, r0 + r, hk); };
    std::uint32_t* kx2 = kv.kx2.data() + t * kBlockN / 2 * kv.dp;
    pack_pairs(p.k, k_row, n, kBlockN, p.d, kv.dp, kv.k2.data() + t * kBlockN * kv.d2, kx2);
    pack_pairs(p.v, v_row, n, kBlockN, p.d, kv.dp, kv.v2.data() + t * kBlockN * kv.d2, nullptr);
    return;
  }
  tiles::load_tile(p.k, p.dtype, p.k_stride, b, r0, hk, n, kBlockN, p.d, kv.dp, 1.0f, kv.k.data() + t * kBlockN * kv.dp);
  tiles::load_tile(p.v, p.dtype, p.v_stride, b, r0, hk, n, kBlockN, p.d, kv.dp, 1.0f, kv.v.data() + t * kBlockN * kv.dp);
}

// Q and dO of every (query block, query head) in fp32, packed once per call like K and V, in the four
// layouts the products read, zero-padded: (scale·log2(e)·Q)ᵀ (for scores in log2 units, as the
// forward's), dOᵀ (d, kBlockM) and scale·Q, dO (kBlockM, dp), each as column panels
// (tiles::to_panels; the backward 5-10% faster at s = 2k than row-major); plus each row's lse in
// log2 units (-inf -> +inf so that 2^(s - lse) is exactly 0 for a row that saw no key; padding +inf)
// and D = rowsum(dO ∘ O) (padding 0). Pass 1 used to repack (and transpose) Q and dO
// for every (key block, query block) pair: O(N²·d / kBlockN) conversion work, now O(N·d) once.
// Memory: four fp32 copies of Q's size, O(total_q·h·d) like PackedKV. For bf16 products
// (`pairs`) the same four as bf16 pairs, unscaled: qt2, dot2 (d2, kBlockM) pairs along d, q2, dout2
// (kBlockM / 2, dp) pairs across queries, all as column panels; half the bytes.
struct PackedQ {
  int d = 0, dp = 0, panel = 0, vp = 0;  // vp: dp rounded up to whole panels
  int d2 = 0;
  bool pairs = false;
  Floats qt, dot, q, dout;  // tile index: query block · h + query head
  Pairs qt2, dot2, q2, dout2;
  Floats lse, dsum;         // (kBlockM) per tile
  const float* qt_tile(std::int64_t t) const { return qt.data() + t * d * kBlockM; }
  const float* dot_tile(std::int64_t t) const { return dot.data() + t * d * kBlockM; }
  const float* q_tile(std::int64_t t) const { return q.data() + t * kBlockM * vp; }
  const float* dout_tile(std::int64_t t) const { return dout.data() + t * kBlockM * vp; }
  const std::uint32_t* qt2_tile(std::int64_t t) const { return qt2.data() + t * d2 * kBlockM; }
  const std::uint32_t* dot2_tile(std::int64_t t) const { return dot2.data() + t * d2 * kBlockM; }
  const std::uint32_t* q2_tile(std::int64_t t) const { return q2.data() + t * kBlockM / 2 * vp; }
  const std::uint32_t* dout2_tile(std::int64_t t) const { return dout2.data() + t * kBlockM / 2 * vp; }
  const float* lse_tile(std::int64_t t) const { return lse.data() + t * kBlockM; }
  const float* dsum_tile(std::int64_t t) const { return dsum.data() + t * kBlockM; }
};

void size_packed(const BwdParams& p, const BlockGrid& qgrid, int panel, bool pairs, PackedQ& pq) {
  pq.d = p.d;
  pq.dp = tiles::round_up(p.d, kLanes);
  pq.d2 = (p.d + 1) / 2;
  pq.pairs = pairs;
  pq.panel = panel;
  pq.vp = tiles::round_up(pq.dp, panel);
  const auto n_tiles = static_cast<std::size_t>(qgrid.total() * p.h);
  if (pairs) {
    for (Pairs* x : {&pq.qt2, &pq.dot2}) x->resize(n_tiles * pq.d2 * kBlockM);
    for (Pairs* x : {&pq.q2, &pq.dout2}) x->resize(n_tiles * kBlockM / 2 * pq.vp);
  } else {
    for (Floats* x : {&pq.qt, &pq.dot}) x->resize(n_tiles * p.d * kBlockM);
    for (Floats* x : {&pq.q, &pq.dout}) x->resize(n_tiles * kBlockM * pq.vp);
  }
  pq.lse.resize(n_tiles * kBlockM);
  pq.dsum.resize(n_tiles * kBlockM);
}

// Rows r < m of a bf16 Q-side tensor (element offset of row r: row(r)) as the pairs PackedQ keeps:
// (d2, kBlockM) pairs along d, transposed (`along_t`), and (kBlockM / 2, dp) pairs across rows
// (`across`), both then as panels.
template <class Row>
void pack_q_pairs(const PackedQ& pq, const void* base, Row&& row, int m, std::uint32_t* along_t, std::uint32_t* across) {
  std::vector<std::uint32_t> along(static_cast<std::size_t>(kBlockM) * pq.d2), t(along.size()),
      x(static_cast<std::size_t>(kBlockM) / 2 * pq.dp);
  pack_pairs(base, row, m, kBlockM, pq.d, pq.dp, along.data(), x.data());
  tiles::transpose(along.data(), kBlockM, pq.d2, pq.d2, t.data(), kBlockM);
  tiles::to_panels(t.data(), pq.d2, kBlockM, kBlockM, pq.panel, along_t);
  tiles::to_panels(x.data(), kBlockM / 2, pq.dp, pq.dp, pq.panel, across);
}

// Packs tile t (query block t / h, head t % h) and computes its rows' D = Σ_c dO[i, c] · O[i, c],
// accumulated in double. o: (d) staging row.
void pack_tile(const BwdParams& p, const BlockGrid& qgrid, PackedQ& pq, std::int64_t t, float* o) {
  const std::int64_t block = t / p.h;
  const int hq = static_cast<int>(t % p.h);
  const int b = qgrid.batch_of(block);
  const SeqInfo si = seq_info(p, b);
  const std::int64_t i0 = (block - qgrid.first[b]) * kBlockM;
  const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
  const std::int64_t r0 = si.q_row0 + i0;
  const int d = p.d, dp = pq.dp;
  // Row-major staging first, (kBlockM, dp) and (d, kBlockM), then the panels. dO in fp32 for D below.
  std::vector<float> dout(static_cast<std::size_t>(kBlockM) * dp);
  tiles::load_tile(p.dout, p.dtype, p.do_stride, b, r0, hq, m, kBlockM, d, dp, 1.0f, dout.data());
  if (pq.pairs) {
    pack_q_pairs(pq, p.q, [&](int r) { return offset_of(p.q_stride, b, r0 + r, hq); }, m,
                 pq.qt2.data() + t * pq.d2 * kBlockM, pq.q2.data() + t * kBlockM / 2 * pq.vp);
    pack_q_pairs(pq, p.dout, [&](int r) { return offset_of(p.do_stride, b, r0 + r, hq); }, m,
                 pq.dot2.data() + t * pq.d2 * kBlockM, pq.dout2.data() + t * kBlockM / 2 * pq.vp);
  } else {
    std::vector<float> q(dout.size()), qt(dout.size()), dot(dout.size());
    tiles::load_tile(p.q, p.dtype, p.q_stride, b, r0, hq, m, kBlockM, d, dp, p.scale, q.data());
    tiles::transpose(q.data(), kBlockM, d, dp, qt.data(), kBlockM);
    tiles::transpose(dout.data(), kBlockM, d, dp, dot.data(), kBlockM);
    tiles::to_panels(q.data(), kBlockM, dp, dp, pq.panel, pq.q.data() + t * kBlockM * pq.vp);
    tiles::to_panels(dout.data(), kBlockM, dp, dp, pq.panel, pq.dout.data() + t * kBlockM * pq.vp);
    tiles::to_panels(qt.data(), d, kBlockM, kBlockM, pq.panel, pq.qt.data() + t * d * kBlockM);
    tiles::to_panels(dot.data(), d, kBlockM, kBlockM, pq.panel, pq.dot.data() + t * d * kBlockM);
  }
  float* lse = pq.lse.data() + t * kBlockM;
  float* dsum = pq.dsum.data() + t * kBlockM;
  for (int r = 0; r < kBlockM; ++r) {
    if (r < m) {
      const std::int64_t idx = lse_index(p, b, hq, si, i0 + r);
      lse[r] = p.lse[idx] == -INFINITY ? INFINITY : p.lse[idx] * tiles::kLog2e;
      tiles::load_row(p.out, p.dtype, offset_of(p.o_stride, b, r0 + r, hq), d, 1.0f, o);
      dsum[r] = static_cast<float>(tiles::dot_f64(o, dout.data() + r * dp, d));
    } else {
      lse[r] = INFINITY;
      dsum[r] = 0.0f;
    }
  }
}

// The gradient of one row of a score tile. Element c is query i, key j = ij(c). On entry s[c] is
// scale·q·k (natural units, tiles::kLog2e) and dp[c] = dO·v; lse[c] (log2 units), dsum[c] are the packed statistics of element c's query row
// (lse already +inf where the row saw no key); z[c] is keep/(1-p) (0 if dropped) under dropout,
// z = nullptr without. On return
//   s[c]  = P·Z                 (Z = z[c], or 1 without dropout): the dV operand
//   dp[c] = P∘(dP·Z − D) · (1 − tanh²)   (softcap chain rule): the dK / dQ operand (dS).
// cnt is the number of valid elements; s, dp, th and z have room for round_up(cnt, 8).
template <class IJ>
void score_grads(const BwdParams& p, const Kernels& kn, const Band& band, float slope, bool needs_mask, int cnt,
                 IJ ij, const float* lse, const float* dsum, const float* z, float* s, float* dp, float* th) {
  const bool softcap = p.softcap > 0.0f;
  if (softcap) {
    const __m256 inv = _mm256_set1_ps(1.0f / p.softcap), cap = _mm256_set1_ps(p.softcap);
    for (int c = 0; c < cnt; c += kLanes) {
      const __m256 t = tiles::tanh8(_mm256_mul_ps(_mm256_loadu_ps(s + c), inv));
      _mm256_storeu_ps(th + c, t);
      _mm256_storeu_ps(s + c, _mm256_mul_ps(cap, t));
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
  kn.softmax_grad(tiles::round_up(cnt, kLanes), lse, dsum, z, softcap ? th : nullptr, s, dp);
}

// zt (n, kBlockM) <- Zᵀ of the tile of queries i0 .. i0 + m and keys j0 .. j0 + n of head hq:
// keep/(1-p) or 0. One Philox call covers 4 consecutive keys of a query row (detail/philox.hpp),
// i.e. 4 rows of the transposed tile; a call per element made dropout 2.7x the plain backward.
void dropout_tile(const BwdParams& p, int hq, const SeqInfo& si, std::int64_t i0, int m, std::int64_t j0, int n,
                  float* zt) {
  static_assert(kBlockN % 4 == 0, "key tiles must start on a Philox column group");
  for (int c = 0; c < m; ++c) {
    const std::uint32_t row_id = detail::dropout_row_id(p, hq, si, i0 + c);
    for (int r = 0; r < n; r += 4) {
      const detail::Philox4 w =
          detail::dropout_words(p.seed, p.offset, row_id, static_cast<std::uint32_t>((j0 + r) / 4));
      for (int u = 0; u < 4 && r + u < n; ++u)
        zt[(r + u) * kBlockM + c] = w.x[u] >= p.dropout_threshold ? p.dropout_rescale : 0.0f;
    }
  }
}

// Whether any (query, key) pair of the tile is visible: bands are monotone in the row, so the
// first row's first key and the last row's end bound the whole tile.
bool tile_visible(const Band& band, std::int64_t i0, int m, std::int64_t j0, int n, std::int64_t len_k) {
  return band.key_begin(i0, len_k) < j0 + n && band.key_end(i0 + m, len_k) > j0;
}

// Pass 1: dK, dV of the key blocks of chunk c of batch entry b and KV head hk, and that chunk's
// partial dQ for every query head of the group. Key blocks are taken key_group() at a time, the
// query tiles outside them, so that each query tile's four packed operands and its dQ partial are
// read from memory once per group instead of once per key block: at s = 4k, d = 64 one head's
// Q-side tiles (4 MiB) and partials (1 MiB) no longer fit the 1 MiB-per-core L2 and streamed from L3
// for every key block. The sums keep their order: each dK/dV row still adds (head, query tile) in
// order, each dQ partial still adds key blocks in ascending order, so the group size does not change
// the bits. 4 key blocks (dK, dV accumulators 256 KiB at d = 128) where L2 is under 2 MiB; 8 where it
// is 2 MiB or more: on the Xeon VM of issue 13's session 6 (2 MiB L2) the backward at s = 8k,
// d = 128, 2 threads ran 2617-2692 ms with 4 and 2463-2637 with 8 (three alternated rounds), and
// no slower at s = 1k-4k or d = 64.
int key_group() {
  static const int group = cache_bytes(2, 0) >= (2L << 20) ? 8 : 4;
  return group;
}

struct KeyWorkspace {
  int dp;
  std::vector<float> st, dpt, th, zt;  // (kBlockN, kBlockM) Sᵀ -> (P·Z)ᵀ, dPᵀ -> dSᵀ, tanh, dropout Zᵀ
  int group;                           // key blocks per group, key_group()
  std::vector<float> dk, dv;           // (group, kBlockN, dp) accumulators
  std::vector<float> row;              // (d) staging row for packing
  // bf16 products: (P·Z)ᵀ and dSᵀ as pairs along the queries (kBlockN, kBlockM / 2), dS as pairs
  // along the keys (kBlockM, kBlockN / 2).
  std::vector<std::uint32_t> pt2, dst2, ds2;
  explicit KeyWorkspace(int d)
      : dp(tiles::round_up(d, kLanes)), st(kBlockN * kBlockM), dpt(st.size()), th(st.size()), zt(st.size()),
        group(key_group()), dk(static_cast<std::size_t>(group) * kBlockN * dp), dv(dk.size()), row(d), pt2(st.size() / 2),
        dst2(st.size() / 2), ds2(st.size() / 2) {}
};

// Sᵀ (n, kBlockM) = K (n, d) · (scale·Q)ᵀ (d, kBlockM), natural units, and dPᵀ (n, kBlockM) =
// V (n, d) · dOᵀ (d, kBlockM) of key tile `tile` and query tile `qtile`. The bf16 products scale
// Sᵀ in fp32 after its product (Q stays exact).
void scores_and_dp(const BwdParams& p, const Kernels& kn, const PackedKV& kv, const PackedQ& pq, std::int64_t tile,
                   std::int64_t qtile, int n, KeyWorkspace& ws) {
  if (kv.pairs) {
    tiles::gemm_panels(kn.gemm_bf16, n, kBlockM, kv.d2, kv.k2_tile(tile), kv.d2, pq.qt2_tile(qtile), pq.d2, pq.panel,
                       ws.st.data(), kBlockM);
    tiles::gemm_panels(kn.gemm_bf16, n, kBlockM, kv.d2, kv.v2_tile(tile), kv.d2, pq.dot2_tile(qtile), pq.d2,
                       pq.panel, ws.dpt.data(), kBlockM);
    for (int r = 0; r < n; ++r) kn.scale_row(ws.st.data() + r * kBlockM, kBlockM, p.scale);
    return;
  }
  tiles::gemm_panels(kn.gemm, n, kBlockM, p.d, kv.k_tile(tile), ws.dp, pq.qt_tile(qtile), p.d, pq.panel, ws.st.data(),
                     kBlockM);
  tiles::gemm_panels(kn.gemm, n, kBlockM, p.d, kv.v_tile(tile), ws.dp, pq.dot_tile(qtile), p.d, pq.panel,
                     ws.dpt.data(), kBlockM);
}

// dV (n, dp) += (P·Z)ᵀ (n, m) · dO (m, dp);  dK (n, dp) += dSᵀ (n, m) · (scale·Q) (m, dp), for the
// bf16 products unscaled Q (the scale at dK's store);  the dQ partial (m, dp) += dS (m, n) · K (n, dp),
// or = on the partial's first product (first_dq); its scale is applied in pass 2.
void accumulate(const Kernels& kn, const PackedKV& kv, const PackedQ& pq, std::int64_t tile, std::int64_t qtile, int n,
                int m, float* dv, float* dk, float* dq, bool first_dq, KeyWorkspace& ws) {
  const int dp = ws.dp;
  if (!kv.pairs) {
    tiles::gemm_panels(kn.gemm_acc, n, dp, m, ws.st.data(), kBlockM, pq.dout_tile(qtile), kBlockM, pq.panel, dv, dp);
    tiles::gemm_panels(kn.gemm_acc, n, dp, m, ws.dpt.data(), kBlockM, pq.q_tile(qtile), kBlockM, pq.panel, dk, dp);
    // dS read from the dSᵀ tile.
    (first_dq ? kn.gemm_at : kn.gemm_at_acc)(m, dp, n, ws.dpt.data(), kBlockM, kv.k_tile(tile), dp, dq, dp);
    return;
  }
  // P·Z and dS rounded to bf16 once, as pairs along the queries; dS along the keys is the same bf16
  // values transposed.
  constexpr int kM2 = kBlockM / 2, kN2 = kBlockN / 2;
  for (int r = 0; r < n; ++r) {
    kn.to_bf16_pairs(ws.st.data() + r * kBlockM, kBlockM, ws.pt2.data() + r * kM2);
    kn.to_bf16_pairs(ws.dpt.data() + r * kBlockM, kBlockM, ws.dst2.data() + r * kM2);
  }
  const int m2 = (m + 1) / 2, n2 = (n + 1) / 2;
  tiles::gemm_panels(kn.gemm_bf16_acc, n, dp, m2, ws.pt2.data(), kM2, pq.dout2_tile(qtile), kM2, pq.panel, dv, dp);
  tiles::gemm_panels(kn.gemm_bf16_acc, n, dp, m2, ws.dst2.data(), kM2, pq.q2_tile(qtile), kM2, pq.panel, dk, dp);
  // dS's pairs along the keys: the 16-bit transpose of dSᵀ's, over whole 8 × 8 blocks, rows past n
  // zeroed first (the last pair of an odd n is (dS, 0)); element by element it took ~10% of the
  // backward (bf16, d = 128, s = 1k, AMD EPYC).
  const int n8 = tiles::round_up(n, 8), m8 = tiles::round_up(m, 8);
  std::fill(ws.dst2.begin() + n * kM2, ws.dst2.begin() + n8 * kM2, 0u);
  tiles::transpose_u16(ws.dst2.data(), n8, m8, kBlockM, ws.ds2.data(), kBlockN);
  (first_dq ? kn.gemm_bf16 : kn.gemm_bf16_acc)(m, dp, n2, ws.ds2.data(), kN2, kv.kx2_tile(tile), dp, dq, dp);
}

// dq_part: this chunk's partial dQ, (query tile, kBlockM, dp) tiles indexed like PackedQ; the
// first product into a tile overwrites it and sets touched[tile], so tiles no key of the chunk sees
// (half of them under a causal mask) are neither cleared nor summed.
void key_chunk(const BwdParams& p, const Kernels& kn, const PackedKV& kv, const BlockGrid& kgrid, const BlockGrid& qgrid, const PackedQ& pq,
               int b, int hk, std::int64_t kb_begin, std::int64_t kb_end, float* dq_part, unsigned char* touched,
               KeyWorkspace& ws) {
  const SeqInfo si = seq_info(p, b);
  const Band band = band_of(p, si);
  const int d = p.d, dp = ws.dp;
  const std::size_t q_tile_size = static_cast<std::size_t>(kBlockM) * dp;
  const std::size_t kv_acc_size = static_cast<std::size_t>(kBlockN) * dp;

  for (std::int64_t g0 = kb_begin; g0 < kb_end; g0 += ws.group) {
    const std::int64_t g1 = std::min<std::int64_t>(g0 + ws.group, kb_end);
    std::fill(ws.dk.begin(), ws.dk.end(), 0.0f);
    std::fill(ws.dv.begin(), ws.dv.end(), 0.0f);
    for (int hq = hk * p.group(); hq < (hk + 1) * p.group(); ++hq) {
      const float slope = detail::alibi_slope(p, b, hq);
      for (std::int64_t i0 = 0; i0 < si.len_q; i0 += kBlockM) {
        const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
        const std::int64_t qtile = (qgrid.first[b] + i0 / kBlockM) * p.h + hq;
        for (std::int64_t kb = g0; kb < g1; ++kb) {
          const std::int64_t j0 = kb * kBlockN;
          const std::int64_t tile = (kgrid.first[b] + kb) * p.h_k + hk;
          const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
          if (!tile_visible(band, i0, m, j0, n, si.len_k)) continue;
          float* dk = ws.dk.data() + (kb - g0) * kv_acc_size;
          float* dv = ws.dv.data() + (kb - g0) * kv_acc_size;

          scores_and_dp(p, kn, kv, pq, tile, qtile, n, ws);
          const bool needs_mask = band.tile_needs_mask(i0, i0 + m, j0, j0 + n, si.len_k);
          if (p.dropout_p > 0.0f) dropout_tile(p, hq, si, i0, m, j0, n, ws.zt.data());
          for (int r = 0; r < n; ++r) {
            const std::int64_t j = j0 + r;
            auto ij = [i0, j](int c) { return std::pair<std::int64_t, std::int64_t>{i0 + c, j}; };
            score_grads(p, kn, band, slope, needs_mask, m, ij, pq.lse_tile(qtile), pq.dsum_tile(qtile),
                        p.dropout_p > 0.0f ? ws.zt.data() + r * kBlockM : nullptr, ws.st.data() + r * kBlockM,
                        ws.dpt.data() + r * kBlockM, ws.th.data() + r * kBlockM);
          }
          accumulate(kn, kv, pq, tile, qtile, n, m, dv, dk, dq_part + qtile * q_tile_size, !touched[qtile], ws);
          touched[qtile] = 1;
        }
      }
    }
    for (std::int64_t kb = g0; kb < g1; ++kb) {
      const std::int64_t j0 = kb * kBlockN;
      const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, si.len_k - j0));
      float* dk = ws.dk.data() + (kb - g0) * kv_acc_size;
      const float* dv = ws.dv.data() + (kb - g0) * kv_acc_size;
      for (int r = 0; r < n; ++r) {
        if (kv.pairs) kn.scale_row(dk + r * dp, dp, p.scale);  // Q was packed unscaled
        tiles::store_row(p.dk, p.dtype, offset_of(p.dk_stride, b, si.k_row0 + j0 + r, hk), d, dk + r * dp);
        tiles::store_row(p.dv, p.dtype, offset_of(p.dv_stride, b, si.k_row0 + j0 + r, hk), d, dv + r * dp);
      }
    }
  }
}

// Pass 2: dQ rows of query tile qtile = scale · (partial_0 + partial_1 + ...), the touched chunks in
// order. row: (dp) staging row.
void reduce_dq(const BwdParams& p, const BlockGrid& qgrid, const Floats& dq_parts,
               const std::vector<unsigned char>& touched, const ChunkPlan& plan, std::int64_t qtile, int dp, float* row) {
  const std::int64_t block = qtile / p.h;
  const int hq = static_cast<int>(qtile % p.h);
  const int b = qgrid.batch_of(block);
  const SeqInfo si = seq_info(p, b);
  const std::int64_t i0 = (block - qgrid.first[b]) * kBlockM;
  const int m = static_cast<int>(std::min<std::int64_t>(kBlockM, si.len_q - i0));
  const std::int64_t n_qtiles = qgrid.total() * p.h;
  const std::size_t part_size = static_cast<std::size_t>(n_qtiles) * kBlockM * dp;
  const int used = plan.used[b];
  const __m256 scale = _mm256_set1_ps(p.scale);
  for (int r = 0; r < m; ++r) {
    const float* src = dq_parts.data() + (qtile * kBlockM + r) * dp;
    for (int c = 0; c < dp; c += kLanes) {
      __m256 acc = _mm256_setzero_ps();
      for (int part = 0; part < used; ++part)
        if (touched[part * n_qtiles + qtile]) acc = _mm256_add_ps(acc, _mm256_loadu_ps(src + part * part_size + c));
      _mm256_storeu_ps(row + c, _mm256_mul_ps(acc, scale));
    }
    tiles::store_row(p.dq, p.dtype, offset_of(p.dq_stride, b, si.q_row0 + i0 + r, hq), p.d, row);
  }
}

}  // namespace

void flash_backward(const BwdParams& p, int num_threads, const Kernels& kn) {
  if (p.batch == 0) return;  // no element to write (and ChunkPlan divides by batch·h_k)
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const BlockGrid qgrid(p, kBlockM, false), kgrid(p, kBlockN, true);
  const bool pairs = pair_products(p, kn);
  PackedKV kv;
  size_packed(p, kgrid, pairs, kv);
  PackedQ pq;
  size_packed(p, qgrid, kn.panel, pairs, pq);
  const std::int64_t n_ktiles = kgrid.total() * p.h_k, n_qtiles = qgrid.total() * p.h;
  // Chunk c's partial dQ, tiles laid out like PackedQ's; an entry with fewer chunks than the
  // plan's most uses only the first ones.
  const std::size_t part_size = static_cast<std::size_t>(n_qtiles) * kBlockM * pq.dp;
  const auto packed = std::tie(kv.k, kv.v, kv.k2, kv.v2, kv.kx2, pq.qt, pq.dot, pq.q, pq.dout, pq.qt2, pq.dot2, pq.q2,
                               pq.dout2, pq.lse, pq.dsum);
  const auto bytes = [](const auto&... x) { return (x.bytes() + ...); };
  const ChunkPlan plan(p, kgrid, static_cast<std::int64_t>(part_size * sizeof(float)),
                       static_cast<std::int64_t>(std::apply(bytes, packed)));
  Floats dq_parts;
  dq_parts.resize(plan.max * part_size);
  std::unique_ptr<std::byte[]> owned;
  std::apply(
      [&](auto&... x) {
        std::byte* at = kept_scratch(bytes(x..., dq_parts), owned);
        (x.place(at), ..., dq_parts.place(at));
      },
      packed);
  std::vector<unsigned char> touched(static_cast<std::size_t>(plan.max) * n_qtiles, 0);
  const std::int64_t n_tasks = static_cast<std::int64_t>(p.batch) * plan.max * p.h_k;

  // One parallel region, its loops separated by barriers: on a loaded 2-core machine each
  // fork/join cost ~10 ms (see flash_fwd.cpp).
#pragma omp parallel num_threads(threads)
  {
    KeyWorkspace ws(p.d);
#pragma omp for schedule(static) nowait
    for (std::int64_t t = 0; t < n_qtiles; ++t) pack_tile(p, qgrid, pq, t, ws.row.data());
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < n_ktiles; ++t) pack_tile(p, kgrid, kv, t);

    // Dynamic, chunks in ascending order (ChunkPlan balances their work).
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t t = 0; t < n_tasks; ++t) {
      const int c = static_cast<int>(t / (static_cast<std::int64_t>(p.batch) * p.h_k));
      const int b = static_cast<int>(t / p.h_k % p.batch);
      const int hk = static_cast<int>(t % p.h_k);
      if (c >= plan.used[b]) continue;
      key_chunk(p, kn, kv, kgrid, qgrid, pq, b, hk, plan.of(b)[c], plan.of(b)[c + 1], dq_parts.data() + c * part_size,
                touched.data() + c * n_qtiles, ws);
    }
#pragma omp for schedule(static) nowait
    for (std::int64_t t = 0; t < n_qtiles; ++t) reduce_dq(p, qgrid, dq_parts, touched, plan, t, pq.dp, ws.dk.data());
  }
}

}  // namespace flashmonoid::cpu
