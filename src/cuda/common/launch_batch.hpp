// The kernels of one library call (forward_kvcache: the append, the forward, the split-KV combine),
// collected in order and launched together: as one CUDA graph, instantiated once per kernel sequence
// and stream and given each call's arguments and grids (cudaGraphExecKernelNodeSetParams) before
// its launch. The graph keeps the kernels' programmatic edges (a kernel added with `programmatic`
// launches under the one before it, as launch_kernel's). What it saves is host time: three kernels
// chained by programmatic launches cost the host 10.2-10.7 us one by one and 4.0-4.1 us as the
// cached graph (H200 VM, bench/experiments/graph-launch-probe.cu). What it costs: the graph's first
// kernel cannot launch under the kernel before it in the stream, 1.0-1.1 us of device time per call
// when calls run back to back and the device is the bound (same probe). Why not CCCL or CUB: neither
// has a launch cache; the runtime's graph API is the whole mechanism.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

namespace flashmonoid::cuda {

class LaunchBatch {
 public:
  static constexpr int kMaxKernels = 4;

  // kernel<<<grid, block, smem>>>(args...) once the batch is launched; `programmatic`: it may launch
  // under the kernel added before it (pdl.cuh; ignored for the first one, which follows the stream).
  template <class... Params, class... Args>
  void add(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, bool programmatic, Args&&... args) {
    check_room();
    auto held = std::make_unique<Held<std::remove_cv_t<std::remove_reference_t<Params>>...>>(std::forward<Args>(args)...);
    Kernel& k = kernels_[count_++];
    k.func = reinterpret_cast<const void*>(kernel);
    k.grid = grid;
    k.block = block;
    k.smem = smem;
    k.programmatic = programmatic;
    k.args = std::move(held);
  }

  // Every kernel added, in order, into `stream` on the current device (`device`), then the batch is
  // empty. One kernel is launched as such; more go out as the cached graph.
  void launch(cudaStream_t stream, int device);

 private:
  struct HeldBase {
    virtual ~HeldBase() = default;
    void** params = nullptr;              // a pointer to each argument, in order
    const std::size_t* sizes = nullptr;   // and its size
    int count = 0;
  };
  // The arguments as the kernel's parameter types, and a pointer to each (the runtime copies them
  // at the launch or at cudaGraphExecKernelNodeSetParams).
  template <class... P>
  struct Held final : HeldBase {
    static constexpr std::size_t kSizes[sizeof...(P) + 1] = {sizeof(P)..., 0};
    std::tuple<P...> values;
    void* pointers[sizeof...(P) > 0 ? sizeof...(P) : 1] = {};
    template <class... A>
    explicit Held(A&&... a) : values(std::forward<A>(a)...) {
      std::apply([this](auto&... v) {
        int i = 0;
        ((pointers[i++] = static_cast<void*>(&v)), ...);
      }, values);
      params = pointers;
      sizes = kSizes;
      count = sizeof...(P);
    }
  };

 public:
  struct Kernel {
    const void* func = nullptr;
    dim3 grid, block;
    std::size_t smem = 0;
    bool programmatic = false;
    std::unique_ptr<HeldBase> args;
  };

 private:
  void check_room() const;
  Kernel kernels_[kMaxKernels];
  int count_ = 0;
};

// One kernel of a batch launched into `stream` as launch_kernel does (pdl.cuh).
void launch_now(const LaunchBatch::Kernel& k, cudaStream_t stream);

}  // namespace flashmonoid::cuda
