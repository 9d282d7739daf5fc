// Internal entry points for callers that vouch for where their arrays live (the Python bindings).
// Not part of the installed API: a C++ caller can put any address in a TensorView, so the public
// calls ask the CUDA runtime about every pointer.
#pragma once

#include <cstddef>

#include "flashmonoid/kvcache.hpp"

namespace flashmonoid::detail {

// Who says that a CUDA view's data pointer is device memory of the view's device.
//  - unverified: nobody; the CUDA backend asks cudaPointerGetAttributes per pointer (0.08 us each
//    on the H100 VM, up to 14 per forward_kvcache) and names the argument that is host memory,
//    unknown to the runtime or on another GPU. The public API's only mode.
//  - dlpack: every view was made from a DLPack array whose producer (torch, CuPy) declared its
//    device, and the caller checked any buffer that is no view (the workspace) against q's device.
//    Validation still requires one device for all views (a CPU array among CUDA ones is an Error),
//    and the backend still checks alignments and strides; only the runtime query is skipped.
enum class PointerSource { unverified, dlpack };

// flashmonoid::forward_kvcache with the pointers' provenance stated. With report_short_workspace,
// for a caller that keeps one workspace and grows it instead of asking for its size per call: when
// ctx.workspace holds fewer than forward_kvcache_workspace_size bytes (the split-KV partials
// included), nothing runs and that size is returned, after validation; 0 when the call ran.
std::size_t forward_kvcache(const TensorView& q, const KVCache& cache, const TensorView& k_new,
                            const TensorView& v_new, const Rotary& rotary, const TensorView& out,
                            const TensorView& lse, const Options& options, const Context& ctx,
                            PointerSource source, bool report_short_workspace);

// Whether `stream` (a cudaStream_t; nullptr = the legacy default stream) is being captured into a
// CUDA graph; false in a build without CUDA, and where the runtime cannot say. For a caller that
// keeps a workspace across calls (the Python bindings): a captured call needs a buffer the graph owns.
bool stream_is_capturing(void* stream);

}  // namespace flashmonoid::detail
