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
  std::int64_t total_q = 0;                    // b·s_q, or rows of packed q
  std::int64_t total_k = 0;                    // b·s_k, or rows of packed k

  float scale = 1.0f;        // softmax scale
  float scale_log2 = 1.0f;   // scale · log2(e), for exp2-based kernels
  float softcap = 0.0f;      // 0 = off
  bool causal = false;       // implied by window_right == 0; kept for dispatch
  int window_left = -1, window_right = -1;
  const float* alibi = nullptr;            // fp32 slopes, or nullptr
  std::int64_t alibi_batch_stride = 0;     // 0 when slopes are (h)
  float dropout_p = 0.0f;
  std::uint32_t dropout_threshold = 0;     // see detail/philox.hpp
  float dropout_rescale = 1.0f;            // 1 / (1 - p)
  std::uint64_t seed = 0, offset = 0;

  Device device{};
  FM_HD bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FM_HD int group() const { return h / h_k; }  // query heads per KV head
};

struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides do_stride, dq_stride, dk_stride, dv_stride;
  bool deterministic = false;
};

// Where sequence b lives and how long it is. Host and device alike.
struct SeqInfo {
  std::int64_t q_row0 = 0, k_row0 = 0;  // first row of the sequence in the (packed) tensors
  int len_q = 0, len_k = 0;
  std::int64_t global_q_row0 = 0;  // b·s_q or cu_seqlens_q[b]: the row used by lse and dropout
};

FM_HD SeqInfo seq_info(const FwdParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    s.q_row0 = p.cu_seqlens_q[b];
    s.k_row0 = p.cu_seqlens_k[b];
    s.len_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    s.len_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    s.global_q_row0 = s.q_row0;
  } else {
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
    s.global_q_row0 = static_cast<std::int64_t>(b) * p.seqlen_q;
  }
  return s;
}

// Element offset of (batch b, row, head hd) in a tensor with strides st.
// row is the row in the (packed) tensor: SeqInfo::q_row0 / k_row0 plus the row in the sequence.
FM_HD std::int64_t offset_of(const Strides& st, int b, std::int64_t row, int hd) {
  return b * st.batch + row * st.row + hd * st.head;
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
