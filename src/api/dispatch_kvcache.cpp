// forward_kvcache and its workspace query: validated once (validate_kvcache.cpp), then the CPU or
// CUDA backend.
#include "api/kvcache_params.hpp"
#include "api/pointer_source.hpp"
#include "api/validate_util.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/isa.hpp"
#include "flashmonoid/kvcache.hpp"
#ifdef FLASHMONOID_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace flashmonoid {

std::size_t detail::forward_kvcache(const TensorView& q, const KVCache& cache, const TensorView& k_new,
                                    const TensorView& v_new, const Rotary& rotary, const TensorView& out,
                                    const TensorView& lse, const Options& options, const Context& ctx,
                                    PointerSource source, bool report_short_workspace) {
  const detail::KvCacheCall c = detail::make_kvcache_params(q, cache, k_new, v_new, rotary, out, lse, options);
  if (c.attn.device.kind == DeviceKind::cpu) {
    cpu::forward_kvcache(c, ctx.cpu_algorithm == CpuAlgorithm::reference, ctx.num_threads,
                         cpu::kernels_for(cpu::isa_for(ctx.cpu_isa)));
    return 0;
  }
#ifdef FLASHMONOID_WITH_CUDA
  const std::string why = cuda::unsupported_reason(c.attn);
  if (!why.empty()) throw NotSupported("q", why);
  if (report_short_workspace) {
    const std::size_t need = cuda::forward_kvcache_workspace_size(c);
    if (need > 0 && (ctx.workspace == nullptr || ctx.workspace_bytes < need)) return need;
  }
  cuda::forward_kvcache(c, ctx, source);
  return 0;
#else
  (void)source, (void)report_short_workspace;
  throw NotSupported("q", "this build of flashmonoid has no CUDA backend (configure with -DFLASHMONOID_CUDA=ON)");
#endif
}

bool detail::stream_is_capturing(void* stream) {
#ifdef FLASHMONOID_WITH_CUDA
  return cuda::stream_is_capturing(stream);
#else
  (void)stream;
  return false;
#endif
}

void forward_kvcache(const TensorView& q, const KVCache& cache, const TensorView& k_new, const TensorView& v_new,
                     const Rotary& rotary, const TensorView& out, const TensorView& lse, const Options& options,
                     const Context& ctx) {
  detail::forward_kvcache(q, cache, k_new, v_new, rotary, out, lse, options, ctx, detail::PointerSource::unverified,
                          false);
}

std::size_t forward_kvcache_workspace_size(const TensorView& q, const KVCache& cache, const TensorView& k_new,
                                           const Rotary& rotary, const Options& options) {
  if (q.device.kind == DeviceKind::cpu) return 0;
#ifdef FLASHMONOID_WITH_CUDA
  // Shapes only, no invented pointers: the call is validated with q's rows cut to none, so that
  // out and lse have no elements and need no data, and the plan then takes the rows back (s_q sets
  // seqlen_q and total_q and nothing else in the params). No value behind a view is read on CUDA.
  TensorView q_rowless = q;
  q_rowless.shape[1] = 0;
  const TensorView out(nullptr, q.dtype, q.device, {q.size(0), 0, q.size(2), q.size(3)});
  const TensorView lse(nullptr, DType::f32, q.device, {q.size(0), q.size(2), 0});
  detail::KvCacheCall c = detail::make_kvcache_params(q_rowless, cache, k_new, k_new, rotary, out, lse, options);
  detail::check_int_range(q.size(1), "q");
  c.attn.seqlen_q = static_cast<int>(q.size(1));
  c.attn.total_q = q.size(0) * q.size(1);
  if (!cuda::unsupported_reason(c.attn).empty()) return 0;
  return cuda::forward_kvcache_workspace_size(c);
#else
  (void)cache, (void)k_new, (void)rotary, (void)options;
  return 0;
#endif
}

}  // namespace flashmonoid
