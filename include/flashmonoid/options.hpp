// Options of an attention call, with FlashAttention-2's semantics.
#pragma once

#include <cstdint>
#include <optional>

#include "flashmonoid/tensor.hpp"

namespace flashmonoid {

struct Options {
  // Scores are softmax_scale · q·kᵀ; default 1/sqrt(head_dim).
  std::optional<float> softmax_scale;

  // Causal and sliding-window masks, aligned to the bottom-right corner of the score matrix as
  // in FlashAttention-2: query row i sees key column j iff
  //     j <= i + s_k - s_q + window_right        (window_right >= 0; causal means window_right = 0)
  //     j >= i + s_k - s_q - window_left         (window_left >= 0)
  // -1 leaves that side unbounded. causal = true is the same as window_right = 0.
  bool causal = false;
  int window_left = -1;
  int window_right = -1;

  // Soft-capping: scores become softcap · tanh(score / softcap); 0 turns it off.
  float softcap = 0.0f;

  // ALiBi: fp32 slopes of shape (h) or (b, h) on the device of q; the score of (i, j) gains
  // -slope · |i + s_k - s_q - j|. Undefined (default) turns it off.
  TensorView alibi_slopes{};

  // Dropout on the attention probabilities, kept elements scaled by 1/(1-p). The keep-mask is a
  // pure function of (seed, offset, head, row, column): see detail/philox.hpp for the exact
  // definition shared by every backend, so CPU and GPU drop exactly the same elements.
  float dropout_p = 0.0f;
  std::uint64_t dropout_seed = 0;
  std::uint64_t dropout_offset = 0;

  // Bit-identical results run to run. The backward without it may add partial gradients with
  // floating-point atomics. The forward is bit-identical run to run either way, but for one case:
  // CUDA split-KV decoding over a contiguous KV with at least 32 key tiles per split (long caches,
  // few sequences: 64 key tiles of 64 keys at hdim <= 128), whose split blocks take key tiles from a
  // shared counter (+2-3.5% on the H100), so the order of a partial's sums varies in the last bits;
  // with deterministic they keep fixed key ranges. The Python KV-cache call sets it when
  // torch.are_deterministic_algorithms_enabled().
  bool deterministic = false;
};

// Packed variable-length batches: q is (total_q, h, d), k and v are (total_k, h_k, d); sequence b
// owns rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q. cu_seqlens_* are int32 of length b+1 on
// the device of q. max_seqlen_* bound every sequence length (used to size launches). On the CPU
// the offsets are checked (non-decreasing, within the tensor, within max_seqlen); on CUDA reading
// them would need a synchronisation, so they are trusted as in FlashAttention-2.
//
// Paged K/V (prefill or chunked prefill into a paged cache, forward only): with block_table int32
// (b, max_pages) defined, k and v are pages (num_pages, page_size, h_k, d), any page_size >= 1,
// and key j of sequence b (j < cu_seqlens_k[b+1] - cu_seqlens_k[b]) is row j % page_size of page
// block_table[b, j / page_size]; cu_seqlens_k then only gives the lengths (see kvcache.hpp for
// what the CUDA kernels do with values only the device sees).
//
// With a block_table, seqused_k int32 (b) may give each sequence's key count instead, and
// cu_seqlens_k may then be left undefined (flash-attn 3's paged form: the cache lengths as they are;
// on the CPU each must lie in [0, pages' rows] and within max_seqlen_k, on CUDA it is clamped to the
// pages). Given both, seqused_k's entries lie within cu_seqlens_k's slots, as for packed k, v.
// seqused_q is not taken with a block_table.
//
// Used lengths (flash-attn 3's seqused_q / seqused_k; for packed k, v): with seqused_q int32
// (b) defined, sequence b is the first seqused_q[b] rows of its slot [cu_seqlens_q[b],
// cu_seqlens_q[b+1]) of q, and likewise for seqused_k, so a padded batch runs in place, each slot
// a padded sequence: q viewed as (b·s_q, h, d) with cu_seqlens_q = (0, s_q, 2·s_q, ...). max_seqlen_*
// then bound the used lengths. The rows of a slot past its used length do not enter the result and
// are not written (out, lse, dq, dk, dv keep what they held); on CUDA a call with seqused_q runs
// without KV splits (Context::num_splits is ignored). On the CPU a used length must lie in [0, slot]
// and within max_seqlen; on CUDA one outside the slot is clamped to it, and max_seqlen is trusted to
// bound it.
struct Varlen {
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  std::int64_t max_seqlen_q = 0;
  std::int64_t max_seqlen_k = 0;
  TensorView block_table;
  TensorView seqused_q;
  TensorView seqused_k;
};

// Which algorithm runs on the CPU. The reference materialises S in float64 and is meant as an
// oracle and a baseline, never for speed.
enum class CpuAlgorithm : std::uint8_t { flash, reference };

// Which CUDA kernel family runs a forward: automatic picks sm90 (wgmma + TMA, warp-specialised) on
// compute capability 9.x for prefill-shaped calls and sm80 (mma.sync) otherwise. Forcing a family
// is for tests and comparisons; forcing sm90 where it cannot run raises NotSupported. With
// `automatic`, the environment variable FLASHMONOID_CUDA_PATH=sm80|sm90 forces it too.
enum class CudaPath : std::uint8_t { automatic, sm80, sm90 };

// Which instruction set the CPU flash path may use. best: AVX-512 where the CPU has it, else AVX2,
// with bf16 inputs' products from bf16 pairs on AMX tiles where the CPU has AMX-BF16, and with
// VDPBF16PS (AVX512_BF16) on AMD CPUs, where they measured faster than fp32 products; the
// environment variable FLASHMONOID_CPU_ISA sets it for the whole process: avx2 caps it, avx512
// turns the bf16 pairs off, avx512_bf16 caps them at VDPBF16PS (on Intel Xeons it measured slower
// than the fp32 products), amx_bf16 is the default's ceiling. avx2: the AVX2 path even on AVX-512
// CPUs (tests and benchmarks compare the two).
enum class CpuIsa : std::uint8_t { best, avx2 };

// How a CUDA call of several kernels (forward_kvcache: the append, the forward and the split-KV
// combine) reaches the stream. kernels: one launch each, the first launched under the kernel
// before it in the stream (programmatic dependent launch). graph: the call's kernels as one CUDA
// graph, instantiated once per kernel sequence and stream and replayed with each call's arguments:
// 4 us of host time for three kernels against 10, but its first kernel starts only once the work
// before it has ended (~1 us of device time per call when calls run back to back; bench/NOTES.md).
// automatic: graph for calls whose K/V capacity is at most 32 MB, kernels above: a loop of Python
// calls (flash_attn_with_kvcache: 9.7-19.1 us of host time each with the graph on H200 VMs, ~5.5 us
// more without) is bound by the host up to there. A C++ loop (4.5-9 us with the graph, 10-18
// without) is bound by the device from ~8 MB on, where kernels read up to 6% faster per call (H200,
// gpu_bench --kv-eager): such a caller may set kernels. A stream being captured always gets
// kernels, so the caller's graph holds them with their programmatic edges.
enum class CallLaunch : std::uint8_t { automatic, kernels, graph };

// Where and how a call runs. The library never synchronises and never allocates device memory:
// CUDA work is queued on `stream`, and scratch memory comes from `workspace` (size it with the
// *_workspace_size functions; 0 bytes is always valid for the forward and for the CPU).
struct Context {
  void* stream = nullptr;                    // cudaStream_t; nullptr = legacy default stream
  void* workspace = nullptr;                 // device memory for split-KV partials and backward
  std::size_t workspace_bytes = 0;
  int num_splits = 0;                        // forward split-KV: 0 = heuristic, 1 = off, n = force
  CpuAlgorithm cpu_algorithm = CpuAlgorithm::flash;
  CudaPath cuda_path = CudaPath::automatic;
  CpuIsa cpu_isa = CpuIsa::best;
  int num_threads = 0;                       // CPU threads; 0 = OpenMP default
  // Multiprocessors the persistent kernels (the sm90 forward and backward: one block per SM for the
  // whole call) leave free for kernels running beside them, such as communication overlapped with
  // attention (FlashAttention-3's sm_margin). 0 = use every SM; at least one SM is always used.
  // With a workspace (forward_workspace_size) the hdim <= 64 forward splits the keys of its last
  // units over the grid, so its result may differ in the last bits between margins (never between
  // runs with the same margin and device).
  int sm_margin = 0;
  // false: the persistent kernels launch one block per work tile (backward: per work item) instead,
  // so that kernels queued beside them (on a higher-priority stream) get SMs whenever a block retires
  // rather than when the whole call ends. The ring (flashmonoid/ring.hpp) turns it off while an
  // exchange is in flight: with a persistent forward, a rank's NCCL kernel could wait for that
  // forward's end while the other rank's NCCL kernel held SMs waiting for it (ring forward efficiency
  // at 256k tokens on 2 x H200: 0.80 with it on, 1.03 off; bench/NOTES.md).
  bool persistent_kernels = true;
  CallLaunch call_launch = CallLaunch::automatic;  // forward_kvcache's kernels: one by one or as a graph
};

}  // namespace flashmonoid
