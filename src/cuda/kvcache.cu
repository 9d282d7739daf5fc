// The CUDA forward_kvcache: one small launch that appends k_new, v_new into the cache (k rotated)
// and writes the rotated q into the workspace, then the sm80 forward (split-KV and its combine as
// the heuristic or ctx.num_splits decide) reading K/V through FwdParams::kv. Nothing is read on the
// host, nothing synchronises or allocates: the call can be captured in a CUDA graph and replayed
// with new cache_seqlens, leftpad, batch index and block-table values. Outside a capture, a call
// with a small cache sends its kernels as one cached graph (Context::call_launch, launch_as_graph).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "api/kvcache_params.hpp"
#include "common/check.cuh"
#include "common/device_guard.cuh"
#include "common/launch_batch.hpp"
#include "common/pdl.cuh"
#include "common/trace.cuh"
#include "common/types.cuh"
#include "cuda_backend.hpp"
#include "flashmonoid/detail/rotary.hpp"
#include "flashmonoid/error.hpp"

namespace flashmonoid::cuda {
namespace {

constexpr std::size_t kAlign = 256;
constexpr std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
constexpr int kAppendWarps = 4;

// Bytes of the rotated q: contiguous (b, s_q, h, d) of q's dtype.
std::size_t rotated_q_bytes(const detail::KvCacheCall& c) {
  if (c.rotary.dim == 0) return 0;
  return align_up(static_cast<std::size_t>(c.attn.total_q) * c.attn.h * c.attn.d * 2);
}

detail::Strides dense_q_strides(const detail::FwdParams& p) {
  return {static_cast<std::int64_t>(p.seqlen_q) * p.h * p.d, static_cast<std::int64_t>(p.h) * p.d, p.d};
}

// destination() <- src (one row of d features), the first rotary.dim rotated at position() when
// rotate (their loads: cache_seqlens and leftpad, then the block table). Lane l takes pairs l,
// l + 32, ... and the pass-through features l + rotary.dim, ...; the math is detail::rotate, the
// CPU's, so the cache holds the same bits on every backend. Every load of src is issued before
// position(), the cos/sin loads before destination(), all before the first store: two dependent
// round trips to memory per row (three through a block table). Loaded and stored pair by pair (a
// store may alias the next pair's loads), a row of hdim 128 took four, and decoding waits for this
// kernel: ~4 us of SM time under ncu (H100, b = 1 32k).
template <class T, class Position, class Destination>
__device__ __forceinline__ void rotate_row(const detail::RotaryParams& r, bool rotate, const T* src, int d,
                                           Position position, Destination destination, int lane) {
  constexpr int kPairs = detail::kMaxHeadDim / 64, kFeatures = detail::kMaxHeadDim / 32;
  const int rd = rotate ? r.dim : 0;
  T xa[kPairs], xb[kPairs], xp[kFeatures];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int i = lane + 32 * j;
    if (i < rd / 2) {
      const detail::RotaryPair pr = detail::rotary_pair(i, rd, r.interleaved);
      xa[j] = src[pr.a];
      xb[j] = src[pr.b];
    }
  }
#pragma unroll
  for (int j = 0; j < kFeatures; ++j)
    if (rd + lane + 32 * j < d) xp[j] = src[rd + lane + 32 * j];
  const std::int64_t pos = position();
  const T* cos = static_cast<const T*>(r.cos) + pos * r.cos_stride;
  const T* sin = static_cast<const T*>(r.sin) + pos * r.sin_stride;
  T c[kPairs], s[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j)
    if (lane + 32 * j < rd / 2) {
      c[j] = cos[lane + 32 * j];
      s[j] = sin[lane + 32 * j];
    }
  T* dst = destination();
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int i = lane + 32 * j;
    if (i < rd / 2) {
      const detail::RotaryPair pr = detail::rotary_pair(i, rd, r.interleaved);
      float ya, yb;
      detail::rotate(to_float(xa[j]), to_float(xb[j]), to_float(c[j]), to_float(s[j]), &ya, &yb);
      dst[pr.a] = from_float<T>(ya);
      dst[pr.b] = from_float<T>(yb);
    }
  }
#pragma unroll
  for (int j = 0; j < kFeatures; ++j)
    if (rd + lane + 32 * j < d) dst[rd + lane + 32 * j] = xp[j];
}

struct AppendArgs {
  detail::KvCacheCall c;
  const void* q = nullptr;  // the caller's q (c.attn.q already points at the rotated copy)
  detail::Strides q_stride;
  std::int64_t k_rows = 0, q_rows = 0;  // b·s_new·h_k rows of k (and as many of v), b·s_q·h of q
  bool programmatic = false;            // launched under the kernel before it in the stream (pdl.cuh)
};

// One warp per row: k_new rows (rotated into the cache), v_new rows (copied), q rows (rotated into
// the workspace). Every cache row written is below the clamped capacity (detail::seq_info), so a
// bad cache_seqlens entry cannot write past the sequence's cache. The forward after it launches
// under it (pdl.cuh) and waits for it before reading q or K/V. It launches under whatever kernel
// comes before it in the stream (where the device has PDL), and waits for that kernel before it
// reads or writes anything, so its launch overlaps that kernel's tail (a decoding step's previous
// attention call, whose last kernel lets it launch early; a kernel that does not simply lets it
// launch when it ends). The forward is let launch only after that wait: it reads cache_seqlens and
// the block table before its own wait for this grid, and the kernel before may have written them.
template <class T>
__global__ void __launch_bounds__(kAppendWarps * 32) append_rotary_kernel(const __grid_constant__ AppendArgs a) {
  trace_mark(a.c.attn, TraceKernel::append, 1);  // launched (before its wait)
  if (a.programmatic) pdl_wait();
  pdl_launch_dependents();  // the forward may launch now: it waits for this grid where it must
  const detail::FwdParams& p = a.c.attn;
  trace_mark(p, TraceKernel::append, 0);
  const int lane = threadIdx.x % 32;
  std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kAppendWarps + threadIdx.x / 32;
  const bool rotary = a.c.rotary.dim > 0;
  if (row < 2 * a.k_rows) {
    const bool is_v = row >= a.k_rows;
    if (is_v) row -= a.k_rows;
    const int hk = static_cast<int>(row % p.h_k);
    const int t = static_cast<int>(row / p.h_k % p.kv.seqlen_new);
    const int b = static_cast<int>(row / p.h_k / p.kv.seqlen_new);
    const T* src = static_cast<const T*>(is_v ? a.c.v_new : a.c.k_new) +
                   detail::offset_of(is_v ? a.c.v_new_stride : a.c.k_new_stride, b, t, hk);
    std::int64_t dst_row = 0;
    rotate_row(
        a.c.rotary, rotary && !is_v, src, p.d,
        [&] { return dst_row = detail::cache_rows_before(p, detail::seq_info(p, b)) + t; },
        [&] {
          return const_cast<T*>(static_cast<const T*>(is_v ? p.v : p.k)) +
                 detail::kv_offset(p, is_v ? p.v_stride : p.k_stride, b, dst_row, hk);
        },
        lane);
    trace_mark(p, TraceKernel::append, 3);  // warp 0's row done
    return;
  }
  row -= 2 * a.k_rows;
  if (row >= a.q_rows) return;
  const int hq = static_cast<int>(row % p.h);
  const int i = static_cast<int>(row / p.h % p.seqlen_q);
  const int b = static_cast<int>(row / p.h / p.seqlen_q);
  const T* src = static_cast<const T*>(a.q) + detail::offset_of(a.q_stride, b, i, hq);
  T* dst = const_cast<T*>(static_cast<const T*>(p.q)) + detail::offset_of(p.q_stride, b, i, hq);
  rotate_row(
      a.c.rotary, true, src, p.d,
      [&] {
        const int held = detail::cache_rows_before(p, detail::seq_info(p, b));
        return detail::rotary_query_position(held, i, a.c.rotary.per_row, a.c.rotary.seqlen);
      },
      [&] { return dst; }, lane);
  trace_mark(p, TraceKernel::append, 3);
}

// Context::call_launch: whether the call's kernels go out as one cached graph. automatic: where
// the K/V the call may read (its capacity, or the known length with a host cache_seqlens) is at
// most kGraphKvBytes. Back-to-back calls with the graph (H200, gpu_bench --kv-eager, b = 1 with
// append and rotary) take 10.5 us at 4 MB, 12.7 at 17 MB, 15.1 at 34 MB, 20.4 at 50 MB of device
// time: up to ~34 MB under the host time of a Python call whose kernels go one by one (13-14 us
// with the graph, plus the 5.5 us the graph saves), so the saving counts in full there; above it
// the device is the bound and launches one by one keep the first kernel's overlap with the kernel
// before (~1 us). Never while the stream is being captured.
constexpr double kGraphKvBytes = 32.0 * (1 << 20);

bool launch_as_graph(const detail::FwdParams& p, const Context& ctx, cudaStream_t stream) {
  if (ctx.call_launch == CallLaunch::kernels || stream_is_capturing(stream)) return false;
  if (ctx.call_launch == CallLaunch::graph) return true;
  const int rows = p.kv.seqlens == nullptr ? std::min(p.kv.capacity, p.kv.seqlen_fixed + p.kv.seqlen_new)
                                           : p.kv.capacity;
  const double bytes = 2.0 * p.batch * rows * p.h_k * p.d * dtype_size(p.dtype);
  return bytes <= kGraphKvBytes;
}

void check_kvcache_pointers(const detail::KvCacheCall& c, PointerSource src) {
  const int dev = c.attn.device.index;
  check_device_pointer(c.attn.q, "q", dev, 2, src);
  check_device_pointer(c.k_new, "k_new", dev, 2, src);
  check_device_pointer(c.v_new, "v_new", dev, 2, src);
  check_device_pointer(c.rotary.cos, "rotary.cos", dev, 2, src);
  check_device_pointer(c.rotary.sin, "rotary.sin", dev, 2, src);
}

#ifdef FLASHMONOID_TRACE
void* g_trace = nullptr;
#endif

}  // namespace

#ifdef FLASHMONOID_TRACE
void set_trace_buffer(void* buffer) { g_trace = buffer; }
void* trace_buffer() { return g_trace; }
#endif

bool stream_is_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; whatever is wrong with the stream, a launch reports it
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

std::size_t forward_kvcache_workspace_size(const detail::KvCacheCall& c) {
  return rotated_q_bytes(c) + forward_workspace_size(c.attn);
}

void forward_kvcache(const detail::KvCacheCall& c, const Context& ctx, PointerSource source) {
  DeviceGuard guard(c.attn.device.index);
  check_kvcache_pointers(c, source);
  AppendArgs a;
  a.c = c;
#ifdef FLASHMONOID_TRACE
  a.c.attn.trace = static_cast<unsigned long long*>(trace_buffer());
#endif
  a.q = c.attn.q;
  a.q_stride = c.attn.q_stride;
  a.k_rows = static_cast<std::int64_t>(c.attn.batch) * c.attn.kv.seqlen_new * c.attn.h_k;
  Context rest = ctx;
  const std::size_t q_bytes = rotated_q_bytes(c);
  if (q_bytes > 0) {  // attention reads q from a rotated copy at the head of the workspace
    if (ctx.workspace == nullptr || ctx.workspace_bytes < q_bytes)
      throw Error("ctx.workspace", "forward_kvcache with rotary needs " + std::to_string(q_bytes) +
                                       " bytes of device workspace for the rotated q (forward_kvcache_workspace_size), "
                                       "got " + std::to_string(ctx.workspace == nullptr ? 0 : ctx.workspace_bytes));
    a.c.attn.q = ctx.workspace;
    a.c.attn.q_stride = dense_q_strides(c.attn);
    a.q_rows = c.attn.total_q * c.attn.h;
    rest.workspace = static_cast<char*>(ctx.workspace) + q_bytes;
    rest.workspace_bytes = ctx.workspace_bytes - q_bytes;
  }
  check_pointers(a.c.attn, source);
  const auto stream = static_cast<cudaStream_t>(ctx.stream);
  LaunchBatch batch;
  LaunchBatch* const graph = launch_as_graph(c.attn, ctx, stream) ? &batch : nullptr;
  const std::int64_t rows = 2 * a.k_rows + a.q_rows;
  if (rows > 0) {
    const unsigned blocks = static_cast<unsigned>((rows + kAppendWarps - 1) / kAppendWarps);
    // Under the kernel before it in the stream; a graph's first kernel waits for that one to end.
    a.programmatic = pdl_available(device_props(c.attn.device.index)) && graph == nullptr;
    launch_kernel(graph, c.attn.dtype == DType::bf16 ? append_rotary_kernel<__nv_bfloat16> : append_rotary_kernel<__half>,
                  dim3(blocks), dim3(kAppendWarps * 32), 0, stream, a.programmatic, a);
  }
  forward(a.c.attn, rest, rows > 0, graph);
  if (graph != nullptr) graph->launch(stream, c.attn.device.index);
}

}  // namespace flashmonoid::cuda
