// Routes validated calls to a backend: the CPU (reference or flash) or CUDA.
#include <string>
#include <vector>

#include "api/kvcache_params.hpp"
#include "api/validate.hpp"
#include "cpu/cpu_backend.hpp"
#include "flashmonoid/attention.hpp"
#ifdef FLASHMONOID_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace flashmonoid {
namespace {

using detail::BwdParams;
using detail::FwdParams;

// The one support table: "" when the device of p can run it, else why not.
std::string unsupported_reason(const FwdParams& p) {
  if (p.device.kind == DeviceKind::cpu) return "";  // the CPU backends run every valid input
#ifdef FLASHMONOID_WITH_CUDA
  return cuda::unsupported_reason(p);
#else
  return "this build of flashmonoid has no CUDA backend (configure with -DFLASHMONOID_CUDA=ON)";
#endif
}

void require_supported(const FwdParams& p) {
  std::string why = unsupported_reason(p);
  if (!why.empty()) throw NotSupported("q", why);
}

void run_forward(const FwdParams& p, const Context& ctx) {
  if (ctx.sm_margin < 0)
    throw Error("ctx.sm_margin", "must be >= 0 (multiprocessors left free), got " + std::to_string(ctx.sm_margin));
  require_supported(p);
  if (p.device.kind == DeviceKind::cpu) {
    if (ctx.cpu_algorithm == CpuAlgorithm::reference)
      cpu::reference_forward(p);
    else
      cpu::flash_forward(p, ctx.num_threads, cpu::kernels_for(cpu::isa_for(ctx.cpu_isa)));
    return;
  }
#ifdef FLASHMONOID_WITH_CUDA
  cuda::check_pointers(p);
  cuda::forward(p, ctx);
#endif
}

void run_backward(const BwdParams& p, const Context& ctx) {
  require_supported(p);
  if (p.device.kind == DeviceKind::cpu) {
    if (ctx.cpu_algorithm == CpuAlgorithm::reference)
      cpu::reference_backward(p);
    else
      cpu::flash_backward(p, ctx.num_threads, cpu::kernels_for(cpu::isa_for(ctx.cpu_isa)));
    return;
  }
#ifdef FLASHMONOID_WITH_CUDA
  cuda::check_pointers(p);
  cuda::backward(p, ctx);
#endif
}

// A view without data for the outputs of the size and support queries.
TensorView like(const TensorView& t, DType dtype, std::initializer_list<std::int64_t> dims) {
  return TensorView(nullptr, dtype, t.device, dims);
}

// Params for the size and support queries: the shape rules only (validate.hpp: Check::shapes), so
// q and k may come without data and no pointer is read. ALiBi slopes change no size or support.
FwdParams query_params(const TensorView& q, const TensorView& k, const Options& options, const Varlen* varlen) {
  TensorView lse = varlen ? like(q, DType::f32, {q.size(1), q.size(0)}) : like(q, DType::f32, {q.size(0), q.size(2), q.size(1)});
  Options o = options;
  o.alibi_slopes = {};
  TensorView out = q;  // q's shape and strides, no data
  out.data = nullptr;
  return detail::make_fwd_params(q, k, k, out, lse, o, varlen, detail::Check::shapes);
}

}  // namespace

void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
             const TensorView& lse, const Options& options, const Context& ctx) {
  run_forward(detail::make_fwd_params(q, k, v, out, lse, options, nullptr), ctx);
}

void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const Varlen& varlen,
                    const TensorView& out, const TensorView& lse, const Options& options, const Context& ctx) {
  run_forward(varlen.block_table.defined() ? detail::make_paged_varlen_params(q, k, v, varlen, out, lse, options)
                                           : detail::make_fwd_params(q, k, v, out, lse, options, &varlen),
              ctx);
}

void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
              const TensorView& dv, const Options& options, const Context& ctx) {
  run_backward(detail::make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, options, nullptr), ctx);
}

void backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                     const Varlen& varlen, const TensorView& out, const TensorView& lse, const TensorView& dq,
                     const TensorView& dk, const TensorView& dv, const Options& options, const Context& ctx) {
  run_backward(detail::make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, options, &varlen), ctx);
}

void merge(std::span<const TensorView> outs, std::span<const TensorView> lses, const TensorView& out,
           const TensorView& lse, const Context& ctx) {
  std::vector<detail::MergePart> parts;
  detail::MergeParams p = detail::make_merge_params(outs, lses, out, lse, parts);
  if (p.device.kind == DeviceKind::cpu) {
    cpu::merge(p);
    return;
  }
#ifdef FLASHMONOID_WITH_CUDA
  cuda::merge(p, ctx);
#else
  (void)ctx;
  throw NotSupported("out", "this build of flashmonoid has no CUDA backend (configure with -DFLASHMONOID_CUDA=ON)");
#endif
}

std::size_t forward_workspace_size(const TensorView& q, const TensorView& k, const Options& options,
                                   const Varlen* varlen) {
  if (q.device.kind == DeviceKind::cpu) return 0;
#ifdef FLASHMONOID_WITH_CUDA
  const FwdParams p = query_params(q, k, options, varlen);
  if (!unsupported_reason(p).empty()) return 0;
  return cuda::forward_workspace_size(p);
#else
  (void)k, (void)options, (void)varlen;
  return 0;
#endif
}

std::size_t backward_workspace_size(const TensorView& q, const TensorView& k, const Options& options,
                                    const Varlen* varlen) {
  if (q.device.kind == DeviceKind::cpu) return 0;
#ifdef FLASHMONOID_WITH_CUDA
  BwdParams p;
  static_cast<FwdParams&>(p) = query_params(q, k, options, varlen);
  p.deterministic = options.deterministic;
  if (!unsupported_reason(p).empty()) return 0;
  return cuda::backward_workspace_size(p);
#else
  (void)k, (void)options, (void)varlen;
  return 0;
#endif
}

Support supports(const TensorView& q, const TensorView& k, const Options& options) {
  try {
    std::string why, path = "cpu";
    if (q.device.kind == DeviceKind::cpu) {
      if (q.ndim < 3 || q.size(-1) < 1 || q.size(-1) > detail::kMaxHeadDim)
        why = "head dim must be in [1, " + std::to_string(detail::kMaxHeadDim) + "]";
    } else {
      const FwdParams p = query_params(q, k, options, nullptr);
      why = unsupported_reason(p);
#ifdef FLASHMONOID_WITH_CUDA
      if (why.empty()) path = cuda::forward_path(p, Context{}) == cuda::KernelArch::sm90 ? "cuda-sm90" : "cuda-sm80";
#endif
    }
    return Support{why.empty(), why, why.empty() ? path : ""};
  } catch (const Error& e) {
    return Support{false, e.what(), ""};
  }
}

bool cuda_available() {
#ifdef FLASHMONOID_WITH_CUDA
  return cuda::available();
#else
  return false;
#endif
}

}  // namespace flashmonoid
