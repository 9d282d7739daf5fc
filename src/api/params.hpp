// The one normalised description of an attention call that every backend consumes. The API layer
// (validate.cpp) fills it after checking every rule; backends trust it.
#pragma once

#include <cstdint>

#include "flashmonoid/detail/host_device.hpp"
#include "flashmonoid/detail/mask.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid::detail {

inline constexpr int kMaxHeadDim = 256;  // the largest head dim any backend supports

// Strides in elements. Sequence b starts at row row_begin(b) of a tensor whose rows of one batch
// entry are `row` apart and whose batch entries are `batch` apart (0 for varlen, which packs rows).
struct Strides {
  std::int64_t batch = 0, row = 0, head = 0;
};

// K/V rows read through a KV cache (forward_kvcache) or pages (paged varlen); see kvcache.hpp.
// Row r of sequence b is row r of cache entry batch_idx[b] (or b), or, paged, row r % page_size of
// page block_table[b, r / page_size]. Every value read here is clamped (seq_info, kv_offset), so
// values only the device sees never address memory outside the cache.
struct KvCacheParams {
  bool active = false;               // a forward_kvcache call: lengths come from seqlens below
  const int* seqlens = nullptr;      // (b) rows before the append, or nullptr: seqlen_fixed
  int seqlen_fixed = 0;
  const int* leftpad = nullptr;      // (b) or nullptr
  int seqlen_new = 0;                // rows this call appends
  int capacity = 0;                  // rows one sequence can hold
  const int* batch_idx = nullptr;    // (b) or nullptr
  int cache_batch = 0;               // b_cache
  const int* block_table = nullptr;  // (b, max_pages) or nullptr
  std::int64_t block_table_stride = 0;
  int page_size = 0, num_pages = 0;
};

struct FwdParams {
  DType dtype = DType::f32;  // of q, k, v, out (and dout, dq, dk, dv in backward)
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // contiguous; (b, h, s_q) or varlen (h, total_q)
  Strides q_stride, k_stride, v_stride, o_stride;

  int batch = 0, h = 0, h_k = 0, d = 0;
  int seqlen_q = 0, seqlen_k = 0;              // per sequence; the max ones for varlen
  const int* cu_seqlens_q = nullptr;           // varlen only (device of q)
  const int* cu_seqlens_k = nullptr;
  const int* seqused_q = nullptr;              // varlen: used rows of each slot (b), or nullptr
  const int* seqused_k = nullptr;
  std::int64_t total_q = 0;                    // b·s_q, or rows of packed q
  std::int64_t total_k = 0;                    // b·s_k, or rows of packed k

  float scale = 1.0f;        // softmax scale
  float scale_log2 = 1.0f;   // scale · log2(e), for exp2-based kernels
  float softcap = 0.0f;      // 0 = off
  bool causal = false;       // implied by window_right == 0; kept for dispatch
  // Options::deterministic: bit-identical results run to run (the backward without floating-point
  // atomics, the forward's split blocks on fixed key ranges: fwd_split_shares_tiles). Beside causal,
  // in its padding: at the end of FwdParams its 8 bytes moved the kernels' parameters and ptxas
  // serialised the wgmma products of six sm90 score-modifier forward kernels (tools/check_spills.py).
  bool deterministic = false;
  int window_left = -1, window_right = -1;
  const float* alibi = nullptr;            // fp32 slopes, or nullptr
  std::int64_t alibi_batch_stride = 0;     // 0 when slopes are (h)
  float dropout_p = 0.0f;
  std::uint32_t dropout_threshold = 0;     // see detail/philox.hpp
  float dropout_rescale = 1.0f;            // 1 / (1 - p)
  std::uint64_t seed = 0, offset = 0;

  KvCacheParams kv;  // K/V addressing of forward_kvcache and paged varlen; inactive otherwise
#ifdef FLASHMONOID_TRACE
  unsigned long long* trace = nullptr;  // block timelines (src/cuda/common/trace.cuh), profiling builds only
#endif

  Device device{};
  FM_HD bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FM_HD int group() const { return h / h_k; }  // query heads per KV head
  // Softcap, ALiBi or dropout: the CUDA kernels compile these into a variant of their own.
  FM_HD bool score_mods() const { return softcap > 0.0f || alibi != nullptr || dropout_p > 0.0f; }
};

struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides do_stride, dq_stride, dk_stride, dv_stride;
};

// Where sequence b lives and how long it is. Host and device alike.
struct SeqInfo {
  std::int64_t q_row0 = 0, k_row0 = 0;  // first row of the sequence in the (packed) tensors
  int len_q = 0, len_k = 0;
  std::int64_t global_q_row0 = 0;  // b·s_q or cu_seqlens_q[b]: the row used by lse and dropout
};

FM_HD int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Rows of varlen sequence b: its slot [cu[b], cu[b+1]), or the slot's first used[b] rows (clamped to
// it) with used lengths (Varlen::seqused_q / seqused_k).
FM_HD int varlen_len(const int* cu, const int* used, int b) {
  const int slot = cu[b + 1] - cu[b];
  return used != nullptr ? clamp_int(used[b], 0, slot) : slot;
}

FM_HD SeqInfo seq_info(const FwdParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    s.q_row0 = p.cu_seqlens_q[b];
    s.len_q = varlen_len(p.cu_seqlens_q, p.seqused_q, b);
    // Paged varlen calls may give the key counts by seqused_k alone (no cu_seqlens_k).
    s.k_row0 = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b] : 0;
    s.len_k = p.cu_seqlens_k != nullptr ? varlen_len(p.cu_seqlens_k, p.seqused_k, b) : p.seqused_k[b];
    s.global_q_row0 = s.q_row0;
  } else {
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
    s.global_q_row0 = static_cast<std::int64_t>(b) * p.seqlen_q;
  }
  const KvCacheParams& kv = p.kv;
  if (kv.active) {  // keys are rows [leftpad, held + seqlen_new) of the sequence's cache
    const int held = clamp_int(kv.seqlens ? kv.seqlens[b] : kv.seqlen_fixed, 0, kv.capacity - kv.seqlen_new);
    const int lp = kv.leftpad ? clamp_int(kv.leftpad[b], 0, held) : 0;
    s.k_row0 = lp;
    s.len_k = held + kv.seqlen_new - lp;
  } else if (kv.block_table != nullptr) {  // paged varlen: rows [0, len_k) of the sequence's pages
    s.k_row0 = 0;
    s.len_k = clamp_int(s.len_k, 0, kv.capacity);
  }
  return s;
}

// Rows a KV-cache sequence held before this call's append (where its new rows start).
FM_HD int cache_rows_before(const FwdParams& p, const SeqInfo& si) { return si.k_row0 + si.len_k - p.kv.seqlen_new; }

// Element offset of (batch b, row, head hd) in a tensor with strides st.
// row is the row in the (packed) tensor: SeqInfo::q_row0 / k_row0 plus the row in the sequence.
FM_HD std::int64_t offset_of(const Strides& st, int b, std::int64_t row, int hd) {
  return b * st.batch + row * st.row + hd * st.head;
}

// Where row `row` of a paged sequence b lives: its page (the block-table entry, clamped to the pool)
// and its row in that page.
struct PageRow {
  int page, row;
};
FM_HD PageRow page_row(const KvCacheParams& kv, int b, std::int64_t row) {
  return {clamp_int(kv.block_table[b * kv.block_table_stride + row / kv.page_size], 0, kv.num_pages - 1),
          static_cast<int>(row % kv.page_size)};
}

// Element offset of row `row` (k_row0 + j) of sequence b's keys or values, head hk: through the
// block table or the cache batch index when there is one.
FM_HD std::int64_t kv_offset(const FwdParams& p, const Strides& st, int b, std::int64_t row, int hk) {
  const KvCacheParams& kv = p.kv;
  if (kv.block_table != nullptr) {
    const PageRow at = page_row(kv, b, row);
    return at.page * st.batch + static_cast<std::int64_t>(at.row) * st.row + hk * st.head;
  }
  if (kv.batch_idx != nullptr) return offset_of(st, clamp_int(kv.batch_idx[b], 0, kv.cache_batch - 1), row, hk);
  return offset_of(st, b, row, hk);
}

// lse index of (b, head, row i): contiguous (b, h, s_q) batched, (h, total_q) varlen.
FM_HD std::int64_t lse_index(const FwdParams& p, int b, int head, const SeqInfo& si, std::int64_t i) {
  if (p.cu_seqlens_q != nullptr) return head * p.total_q + si.q_row0 + i;
  return (static_cast<std::int64_t>(b) * p.h + head) * p.seqlen_q + i;
}

FM_HD Band band_of(const FwdParams& p, const SeqInfo& si) {
  return Band{static_cast<std::int64_t>(si.len_k) - si.len_q, p.window_left, p.window_right};
}

FM_HD float alibi_slope(const FwdParams& p, int b, int head) {
  return p.alibi ? p.alibi[b * p.alibi_batch_stride + head] : 0.0f;
}

FM_HD std::uint32_t dropout_row_id(const FwdParams& p, int head, const SeqInfo& si, std::int64_t i) {
  return static_cast<std::uint32_t>(head * p.total_q + si.global_q_row0 + i);
}

// Merge of n partial (out, lse) results. Packed layouts are described as batch = 1.
struct MergePart {
  const void* out = nullptr;
  DType dtype = DType::f32;
  Strides stride;         // of out: (b, s, h, d)
  const float* lse = nullptr;  // contiguous (b, h, s)
};

struct MergeParams {
  int n = 0;
  const MergePart* parts = nullptr;  // host array of n parts
  void* out = nullptr;
  DType dtype = DType::f32;
  Strides o_stride;
  float* lse = nullptr;
  int batch = 0, seqlen = 0, h = 0, d = 0;
  Device device{};
};

}  // namespace flashmonoid::detail
