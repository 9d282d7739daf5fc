// The CUDA backend behind src/api/dispatch.cpp: the support table, pointer checks, workspace sizes
// and the launches (forward and its split-KV plan, backward, the public merge).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "api/params.hpp"
#include "common/check.cuh"
#include "common/device_guard.cuh"
#include "common/device_props.cuh"
#include "common/pdl.cuh"
#include "common/types.cuh"
#include "cuda_backend.hpp"
#include "flashmonoid/detail/monoid.hpp"
#include "flashmonoid/error.hpp"
#include "sm80/bwd_sm80.hpp"
#include "sm80/fwd_sm80.hpp"
#include "sm80/tile_fwd_sm80.hpp"
#include "sm90/bwd_sm90.hpp"
#include "sm90/fwd_sm90.hpp"
#include "sm90/tile_fwd_sm90.hpp"

namespace flashmonoid::cuda {
namespace {

// The kernels move rows in 16-byte vectors (8 fp16/bf16): head dims must be multiples of 8, and
// base pointers and row/head/batch strides must keep every row 16-byte aligned.
constexpr int kVectorBytes = 16;
using detail::kMaxHeadDim;
constexpr int kMinMajor = 8;  // mma.sync m16n8k16 with bf16, cp.async, ldmatrix: sm80 and later

// ptr is device memory of `device` (or nullptr: an absent optional argument; required ones are
// checked by validation), aligned to `align` bytes. With PointerSource::dlpack the producer of the
// arrays declared where they live and validation matched the devices: the runtime is not asked.
void check_pointer(const void* ptr, const char* name, int device, int align, PointerSource source) {
  if (ptr == nullptr) return;
  if (source == PointerSource::unverified) {
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error so later launches are unaffected
      throw Error(name, std::string("is not memory the CUDA runtime knows (") + cudaGetErrorString(err) + ")");
    }
    if (attr.type == cudaMemoryTypeUnregistered || attr.type == cudaMemoryTypeHost)
      throw Error(name, "is host memory, but the tensors are on cuda:" + std::to_string(device) +
                            "; pass device memory (cudaMalloc) or use a CPU tensor for every argument");
    if (attr.type == cudaMemoryTypeDevice && attr.device != device)
      throw Error(name, "is on cuda:" + std::to_string(attr.device) + " but the call runs on cuda:" +
                            std::to_string(device));
  }
  if (reinterpret_cast<std::uintptr_t>(ptr) % align != 0)
    throw Error(name, "base address must be " + std::to_string(align) +
                          "-byte aligned for the CUDA kernels' vector loads");
}

// Strides in elements of 2-byte dtypes: a multiple of 8 keeps rows 16-byte aligned. A dimension of
// extent 1 never steps, so its stride is free.
void check_strides(const detail::Strides& st, const char* name, int batch, int heads, bool varlen) {
  constexpr std::int64_t kElems = kVectorBytes / 2;
  auto bad = [&](std::int64_t s) { return s % kElems != 0; };
  if (bad(st.row) || (heads > 1 && bad(st.head)) || (!varlen && batch > 1 && bad(st.batch)))
    throw Error(name, "row, head and batch strides must be multiples of 8 elements (16 bytes) on the CUDA "
                      "backend; make the tensor contiguous in its last dimension with rows 16-byte aligned");
}

void check_fwd_pointers(const detail::FwdParams& p, PointerSource src) {
  const int dev = p.device.index;
  check_pointer(p.q, "q", dev, kVectorBytes, src);
  check_pointer(p.k, "k", dev, kVectorBytes, src);
  check_pointer(p.v, "v", dev, kVectorBytes, src);
  check_pointer(p.out, "out", dev, kVectorBytes, src);
  check_pointer(p.lse, "lse", dev, sizeof(float), src);
  check_pointer(p.cu_seqlens_q, "cu_seqlens_q", dev, sizeof(int), src);
  check_pointer(p.cu_seqlens_k, "cu_seqlens_k", dev, sizeof(int), src);
  check_pointer(p.seqused_q, "seqused_q", dev, sizeof(int), src);
  check_pointer(p.seqused_k, "seqused_k", dev, sizeof(int), src);
  check_pointer(p.alibi, "options.alibi_slopes", dev, sizeof(float), src);
  check_pointer(p.kv.seqlens, "seqlens", dev, sizeof(int), src);
  check_pointer(p.kv.leftpad, "leftpad", dev, sizeof(int), src);
  check_pointer(p.kv.batch_idx, "batch_idx", dev, sizeof(int), src);
  check_pointer(p.kv.block_table, "block_table", dev, sizeof(int), src);
  const bool varlen = p.cu_seqlens_q != nullptr;
  const bool packed_kv = varlen && p.kv.block_table == nullptr;  // pages step by their batch stride
  check_strides(p.q_stride, "q", p.batch, p.h, varlen);
  check_strides(p.k_stride, "k", p.batch, p.h_k, packed_kv);
  check_strides(p.v_stride, "v", p.batch, p.h_k, packed_kv);
  check_strides(p.o_stride, "out", p.batch, p.h, varlen);
}

template <class F>
void with_dtype(DType t, F&& f) {
  if (t == DType::bf16)
    f(__nv_bfloat16{});
  else
    f(__half{});
}

// The head-dim bucket as a template argument: the one place where it becomes one, among the buckets a
// kernel family is instantiated for (64, 128, 256 everywhere; the sm90 forward adds 96 and 192:
// fwd_head_dim_bucket_sm90).
template <int... kBuckets, class F>
void with_bucket(int bucket, F&& f) {
  (void)((bucket == kBuckets && (f(std::integral_constant<int, kBuckets>{}), true)) || ...);
}
template <class F>
void with_head_dim(int d, F&& f) {
  with_bucket<64, 128, 256>(head_dim_bucket(d), std::forward<F>(f));
}

template <class T>
void run_fwd(const detail::FwdParams& p, const FwdLaunch& launch) {
  with_head_dim(p.d, [&](auto hd) { run_fwd_sm80<T, decltype(hd)::value>(p, launch); });
}

#ifdef FLASHMONOID_WITH_SM90
constexpr bool kBuiltSm90 = true;
#else
constexpr bool kBuiltSm90 = false;
#endif

template <class T>
void run_fwd_hopper(const detail::FwdParams& p, const FwdLaunchSm90& launch) {
#ifdef FLASHMONOID_WITH_SM90
  with_bucket<64, 96, 128, 192, 256>(fwd_head_dim_bucket_sm90(p.d),
                                     [&](auto hd) { run_fwd_sm90<T, decltype(hd)::value>(p, launch); });
#else
  (void)p, (void)launch;
#endif
}

// The forced path: Context::cuda_path, or with `automatic` the environment (read here only).
CudaPath requested_path(CudaPath ctx_path) {
  if (ctx_path != CudaPath::automatic) return ctx_path;
  const char* env = std::getenv("FLASHMONOID_CUDA_PATH");
  if (env == nullptr) return CudaPath::automatic;
  if (std::strcmp(env, "sm80") == 0) return CudaPath::sm80;
  if (std::strcmp(env, "sm90") == 0) return CudaPath::sm90;
  throw Error("FLASHMONOID_CUDA_PATH", std::string("must be sm80 or sm90 (or unset), got '") + env + "'");
}

int compute_major(int device) { return device_props(device).major; }

template <class T>
void run_bwd(const detail::BwdParams& p, const BwdLaunch& launch) {
  with_head_dim(p.d, [&](auto hd) { run_bwd_sm80<T, decltype(hd)::value>(p, launch); });
}

template <class T>
void run_bwd_hopper(const detail::BwdParams& p, const BwdLaunch& launch) {
#ifdef FLASHMONOID_WITH_SM90
  with_head_dim(p.d, [&](auto hd) { run_bwd_sm90<T, decltype(hd)::value>(p, launch); });
#else
  (void)p, (void)launch;
#endif
}

// ---- merge of n partial results (public API) ----------------------------------------------------

// Parts per launch: kernel parameters are limited to 4 KB and a MergePart is 48 bytes. Longer lists
// are folded in chunks, the running (out, lse) entering the next chunk as its first part.
constexpr int kMaxMergeParts = 64;
constexpr int kMergeWarps = 4;
constexpr int kMergeColsPerLane = kMaxHeadDim / 32;

struct MergeArgs {
  int n = 0;
  detail::MergePart parts[kMaxMergeParts];
  void* out = nullptr;
  DType dtype = DType::f32;
  detail::Strides o_stride;
  float* lse = nullptr;
  int batch = 0, seqlen = 0, h = 0, d = 0;
};

__device__ __forceinline__ float load_as_float(const void* base, DType t, std::int64_t i) {
  switch (t) {
    case DType::f16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}
__device__ __forceinline__ void store_from_float(void* base, DType t, std::int64_t i, float x) {
  switch (t) {
    case DType::f16: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(base)[i] = x; break;
  }
}

// One warp per (batch, row, head): fold the parts with detail::merge_lse, lanes over the head dim.
__global__ void __launch_bounds__(kMergeWarps * 32) merge_kernel(const __grid_constant__ MergeArgs a) {
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  if (row >= static_cast<std::int64_t>(a.batch) * a.seqlen * a.h) return;
  const int head = static_cast<int>(row % a.h);
  const std::int64_t s = (row / a.h) % a.seqlen;
  const int b = static_cast<int>(row / (static_cast<std::int64_t>(a.h) * a.seqlen));
  const std::int64_t lse_i = (static_cast<std::int64_t>(b) * a.h + head) * a.seqlen + s;

  float lse = -INFINITY;
  float acc[kMergeColsPerLane] = {};
  for (int part = 0; part < a.n; ++part) {
    const detail::MergePart& mp = a.parts[part];
    float wa, wb;
    lse = detail::merge_lse(lse, mp.lse[lse_i], &wa, &wb);
    if (wb == 0.0f) continue;  // an empty part (lse = -inf) contributes nothing, whatever its out holds
    const std::int64_t base = detail::offset_of(mp.stride, b, s, head);
#pragma unroll
    for (int c = 0; c < kMergeColsPerLane; ++c) {
      const int col = c * 32 + lane;
      if (col < a.d) acc[c] = acc[c] * wa + load_as_float(mp.out, mp.dtype, base + col) * wb;
    }
  }
  const std::int64_t base = detail::offset_of(a.o_stride, b, s, head);
#pragma unroll
  for (int c = 0; c < kMergeColsPerLane; ++c) {
    const int col = c * 32 + lane;
    if (col < a.d) store_from_float(a.out, a.dtype, base + col, acc[c]);
  }
  if (lane == 0) a.lse[lse_i] = lse;
}

// Zeroes d elements of `elem_bytes` at every (entry, row, head) of a strided view: `rows` rows in
// each of `entries` batch entries (varlen: one entry of all the packed rows, batch stride 0). Only
// for a backward without query rows or without key rows, whose dK, dV (a sum over no query) or dQ
// (over no key) are 0: the kernels' grids are sized by both, and speed does not matter there.
__global__ void zero_rows_kernel(unsigned char* base, detail::Strides st, int elem_bytes, int entries, std::int64_t rows,
                                 int heads, int d) {
  const std::int64_t n = static_cast<std::int64_t>(entries) * rows * heads;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int head = static_cast<int>(i % heads);
    const std::int64_t row = i / heads % rows;
    const int entry = static_cast<int>(i / heads / rows);
    unsigned char* dst = base + detail::offset_of(st, entry, row, head) * elem_bytes;
    for (int c = 0; c < d * elem_bytes; ++c) dst[c] = 0;
  }
}

void zero_empty_grads(const detail::BwdParams& p, cudaStream_t stream) {
  const int entries = p.is_varlen() ? 1 : p.batch;
  const int bytes = static_cast<int>(dtype_size(p.dtype));
  const std::int64_t q_rows = p.is_varlen() ? p.total_q : p.seqlen_q, k_rows = p.is_varlen() ? p.total_k : p.seqlen_k;
  const struct {
    void* t;
    detail::Strides st;
    std::int64_t rows;
    int heads;
  } grads[] = {{p.dq, p.dq_stride, q_rows, p.h}, {p.dk, p.dk_stride, k_rows, p.h_k}, {p.dv, p.dv_stride, k_rows, p.h_k}};
  for (const auto& g : grads) {
    const std::int64_t n = static_cast<std::int64_t>(entries) * g.rows * g.heads;
    if (n == 0) continue;
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 1024));
    zero_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<unsigned char*>(g.t), g.st, bytes, entries, g.rows, g.heads, p.d);
    FM_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

bool available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  for (int dev = 0; dev < count; ++dev) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= kMinMajor)
      return true;
  }
  return false;
}

// The one support table of the CUDA backend.
std::string unsupported_reason(const detail::FwdParams& p) {
  const int dev = p.device.index;
  DeviceProps props;
  if (!find_device_props(dev, &props)) return "no CUDA device cuda:" + std::to_string(dev) + " is visible";
  const int major = props.major, minor = props.minor;
  if (major < kMinMajor)
    return "cuda:" + std::to_string(dev) + " has compute capability " + std::to_string(major) + "." +
           std::to_string(minor) + "; the CUDA kernels need 8.0 or newer (Ampere, Hopper)";
  if (p.dtype != DType::f16 && p.dtype != DType::bf16)
    return "the CUDA backend computes in fp16 or bf16 (tensor cores), not " + to_string(p.dtype) +
           "; use fp16/bf16 tensors or the CPU backend";
  if (p.d % 8 != 0 || p.d > kMaxHeadDim || p.d <= 0)
    return "head dim " + std::to_string(p.d) +
           " is not supported on CUDA: it must be a multiple of 8 (16-byte rows) and at most " + std::to_string(kMaxHeadDim) + "; pad the "
           "head dim with zeros (exact for attention) or use the CPU backend";
  return "";
}

// The one decision of which forward kernel family runs p: sm90 on compute capability 9.x for
// prefill-shaped calls without forced KV splits, sm80 otherwise; "" or why a forced sm90 cannot run.
std::string fwd_path_why_not_sm90(const detail::FwdParams& p, int num_splits) {
  if (!kBuiltSm90) return "this build has no sm90 kernels (CMAKE_CUDA_ARCHITECTURES without 90)";
  if (compute_major(p.device.index) != 9) return "the sm90 kernels need compute capability 9.x (Hopper)";
  if (num_splits > 1) return "the sm90 forward does not split the keys (num_splits > 1)";
  if (!fwd_sm90_eligible(p))
    return "the sm90 forward runs prefill shapes (s_q > 64, some keys) without KV caches";
  return "";
}

// ctx's forced family, else sm90 where why_not_sm90() is "" (asked only when it matters).
template <class WhyNot>
KernelArch choose_arch(const Context& ctx, WhyNot why_not_sm90) {
  const CudaPath want = requested_path(ctx.cuda_path);
  if (want == CudaPath::sm80) return KernelArch::sm80;
  const std::string why = why_not_sm90();
  if (want == CudaPath::sm90 && !why.empty()) throw NotSupported("ctx.cuda_path", "sm90 was forced but " + why);
  return why.empty() ? KernelArch::sm90 : KernelArch::sm80;
}

KernelArch forward_path(const detail::FwdParams& p, const Context& ctx) {
  return choose_arch(ctx, [&] { return fwd_path_why_not_sm90(p, ctx.num_splits); });
}

// The same decision for the backward: sm90 on compute capability 9.x for what bwd_sm90_eligible
// takes, sm80 otherwise.
std::string bwd_path_why_not_sm90(const detail::BwdParams& p) {
  if (!kBuiltSm90) return "this build has no sm90 kernels (CMAKE_CUDA_ARCHITECTURES without 90)";
  if (compute_major(p.device.index) != 9) return "the sm90 kernels need compute capability 9.x (Hopper)";
  if (!bwd_sm90_eligible(p))
    return "the sm90 backward runs head dims up to 256 without KV caches, deterministic up to 128, softcap/ALiBi/dropout above 64";
  return "";
}

KernelArch backward_path(const detail::BwdParams& p, const Context& ctx) {
  return choose_arch(ctx, [&] { return bwd_path_why_not_sm90(p); });
}

std::size_t bwd_path_workspace_bytes(const detail::BwdParams& p, KernelArch path) {
  return path == KernelArch::sm90 ? bwd_workspace_layout_sm90(p).total : bwd_workspace_bytes(p);
}

void check_pointers(const detail::FwdParams& p, PointerSource source) { check_fwd_pointers(p, source); }

void check_device_pointer(const void* ptr, const char* name, int device, int align, PointerSource source) {
  check_pointer(ptr, name, device, align, source);
}

void check_pointers(const detail::BwdParams& p) {
  constexpr PointerSource src = PointerSource::unverified;
  check_fwd_pointers(p, src);
  const int dev = p.device.index;
  check_pointer(p.dout, "dout", dev, kVectorBytes, src);
  check_pointer(p.dq, "dq", dev, kVectorBytes, src);
  check_pointer(p.dk, "dk", dev, kVectorBytes, src);
  check_pointer(p.dv, "dv", dev, kVectorBytes, src);
  const bool varlen = p.cu_seqlens_q != nullptr;
  check_strides(p.do_stride, "dout", p.batch, p.h, varlen);
  check_strides(p.dq_stride, "dq", p.batch, p.h, varlen);
  check_strides(p.dk_stride, "dk", p.batch, p.h_k, varlen);
  check_strides(p.dv_stride, "dv", p.batch, p.h_k, varlen);
}

std::size_t forward_workspace_size(const detail::FwdParams& p) {
  DeviceGuard guard(p.device.index);
  const DeviceProps props = device_props(p.device.index);
  if (forward_path(p, Context{}) == KernelArch::sm90) {
    // The split tail's exchange for a grid of every multiprocessor (a margin only shrinks it).
    const int bucket = fwd_head_dim_bucket_sm90(p.d);
    const FwdVariantSm90 variant = fwd_variant_sm90(p, bucket);
    if (p.is_varlen() || !fwd_split_tail(bucket, variant)) return 0;
    return fwd_tail_layout_sm90(fwd_tile_sm90(bucket, variant), bucket, props.num_sms).total;
  }
  if (p.seqused_q != nullptr) return 0;  // runs unsplit (forward below)
  return fwd_split_workspace_bytes(p, fwd_choose_num_splits(p, props.num_sms, props.smem_per_sm));
}

// Enough for either path: the size query has no Context, and a call may force either one.
std::size_t backward_workspace_size(const detail::BwdParams& p) {
  const std::size_t sm80 = bwd_workspace_bytes(p);
  if (!kBuiltSm90 || !bwd_sm90_eligible(p)) return sm80;
  const std::size_t sm90 = bwd_workspace_layout_sm90(p).total;
  return sm90 > sm80 ? sm90 : sm80;
}

void forward(const detail::FwdParams& p, const Context& ctx, bool after_own_kernel, LaunchBatch* batch) {
  DeviceGuard guard(p.device.index);
  // No query row: no output element, and a grid of zero blocks would not launch (an invalid
  // argument). A KV-cache call's append kernel is queued in `batch` already; its caller launches it.
  if (p.total_q == 0) return;
  if (forward_path(p, ctx) == KernelArch::sm90) {
    // The sm90 forward runs no KV cache (fwd_sm90_eligible), so no batched call comes here; were one
    // to, its kernels go first.
    if (batch != nullptr) batch->launch(static_cast<cudaStream_t>(ctx.stream), p.device.index);
    const FwdLaunchSm90 launch{static_cast<cudaStream_t>(ctx.stream), ctx.sm_margin, ctx.persistent_kernels,
                               ctx.workspace, ctx.workspace == nullptr ? 0 : ctx.workspace_bytes};
    with_dtype(p.dtype, [&](auto t) { run_fwd_hopper<decltype(t)>(p, launch); });
    return;
  }
  FwdLaunch launch;
  launch.stream = static_cast<cudaStream_t>(ctx.stream);
  const DeviceProps props = device_props(p.device.index);
  launch.num_sms = props.num_sms;
  launch.smem_optin = props.smem_optin;
  launch.smem_per_sm = props.smem_per_sm;
  launch.pdl = pdl_available(props);
  launch.after_own_kernel = after_own_kernel;
  launch.batch = batch;
  // Used query lengths run unsplit: the combine kernels write every packed row, and the rows past the
  // used ones must keep what they held (options.hpp: Varlen).
  int splits = p.seqused_q != nullptr ? 1
               : ctx.num_splits > 0  ? ctx.num_splits
                                     : fwd_choose_num_splits(p, launch.num_sms, launch.smem_per_sm);
  // Without room for the partials the call still runs, unsplit (documented in attention.hpp).
  if (splits > 1 && (ctx.workspace == nullptr || ctx.workspace_bytes < fwd_split_workspace_bytes(p, splits)))
    splits = 1;
  launch.num_splits = splits;
  if (splits > 1)
    fwd_split_buffers(p, splits, ctx.workspace, &launch.out_partial, &launch.lse_partial, &launch.tile_counters);
  with_dtype(p.dtype, [&](auto t) { run_fwd<decltype(t)>(p, launch); });
}

void backward(const detail::BwdParams& p, const Context& ctx) {
  DeviceGuard guard(p.device.index);
  const KernelArch path = backward_path(p, ctx);
  const std::size_t need = bwd_path_workspace_bytes(p, path);
  if (need > 0 && (ctx.workspace == nullptr || ctx.workspace_bytes < need))
    throw Error("ctx.workspace", "the CUDA backward needs " + std::to_string(need) +
                                     " bytes of device workspace (backward_workspace_size), got " +
                                     std::to_string(ctx.workspace == nullptr ? 0 : ctx.workspace_bytes));
  if (p.total_q == 0 || p.total_k == 0) {  // no query or no key rows
    zero_empty_grads(p, static_cast<cudaStream_t>(ctx.stream));
    return;
  }
  BwdLaunch launch;
  launch.stream = static_cast<cudaStream_t>(ctx.stream);
  launch.workspace = ctx.workspace;
  launch.workspace_bytes = ctx.workspace_bytes;
  launch.num_sms = device_props(p.device.index).num_sms;
  launch.sm_margin = ctx.sm_margin;
  launch.persistent = ctx.persistent_kernels;
  if (path == KernelArch::sm90)
    with_dtype(p.dtype, [&](auto t) { run_bwd_hopper<decltype(t)>(p, launch); });
  else
    with_dtype(p.dtype, [&](auto t) { run_bwd<decltype(t)>(p, launch); });
}

void merge(const detail::MergeParams& p, const Context& ctx) {
  DeviceGuard guard(p.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream);
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.seqlen * p.h;
  const unsigned blocks = static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps);
  if (rows == 0) return;
  MergeArgs a;
  a.out = p.out;
  a.dtype = p.dtype;
  a.o_stride = p.o_stride;
  a.lse = p.lse;
  a.batch = p.batch;
  a.seqlen = p.seqlen;
  a.h = p.h;
  a.d = p.d;
  int next = 0;
  do {
    a.n = 0;
    if (next > 0) a.parts[a.n++] = detail::MergePart{p.out, p.dtype, p.o_stride, p.lse};  // running result
    while (next < p.n && a.n < kMaxMergeParts) a.parts[a.n++] = p.parts[next++];
    merge_kernel<<<blocks, kMergeWarps * 32, 0, stream>>>(a);
    FM_CUDA_CHECK_LAUNCH();
  } while (next < p.n);
}

}  // namespace flashmonoid::cuda
