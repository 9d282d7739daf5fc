// LaunchBatch::launch (common/launch_batch.hpp): the cache of instantiated graphs, one per (device,
// stream, kernel sequence with its programmatic flags). Per stream because launches of one
// executable graph are ordered behind each other: a graph shared by two streams would serialise
// them (cudaStreamPerThread, one handle for a stream per thread, is keyed by thread too). The cache
// keeps at most kMaxGraphs (a decoding loop uses one or two); the oldest goes first, and an
// executable graph destroyed while in flight is freed when it completes (the runtime's rule). It is
// never freed at exit: the CUDA context may be gone by then.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/check.cuh"
#include "common/launch_batch.hpp"
#include "common/pdl.cuh"
#include "flashmonoid/error.hpp"

namespace flashmonoid::cuda {
namespace {

constexpr std::size_t kMaxGraphs = 32;

struct GraphKey {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::thread::id thread;  // for cudaStreamPerThread only: one handle, a stream per thread
  int count = 0;
  const void* funcs[LaunchBatch::kMaxKernels] = {};
  bool programmatic[LaunchBatch::kMaxKernels] = {};

  bool operator==(const GraphKey& o) const {
    if (device != o.device || stream != o.stream || thread != o.thread || count != o.count) return false;
    for (int i = 0; i < count; ++i)
      if (funcs[i] != o.funcs[i] || programmatic[i] != o.programmatic[i]) return false;
    return true;
  }
};

// What a node of an instantiated graph was last given: a call whose kernel repeats it byte for
// byte (a steady decoding loop: the same tensors, and torch hands back the same output blocks)
// skips cudaGraphExecKernelNodeSetParams: the bindings' route took 3.9-4.0 us of host time per
// three-kernel call with the skip, 5.2-6.5 without (H200).
struct NodeState {
  std::vector<unsigned char> bytes;  // every argument's object representation, in order
  dim3 grid, block;
  std::size_t smem = 0;
  bool matches(const LaunchBatch::Kernel& k) const {
    if (k.smem != smem || k.grid.x != grid.x || k.grid.y != grid.y || k.grid.z != grid.z || k.block.x != block.x ||
        k.block.y != block.y || k.block.z != block.z)
      return false;
    std::size_t at = 0;
    for (int i = 0; i < k.args->count; ++i) {
      const std::size_t n = k.args->sizes[i];
      if (at + n > bytes.size() || std::memcmp(bytes.data() + at, k.args->params[i], n) != 0) return false;
      at += n;
    }
    return at == bytes.size();
  }
  void take(const LaunchBatch::Kernel& k) {
    bytes.clear();
    for (int i = 0; i < k.args->count; ++i) {
      const auto* v = static_cast<const unsigned char*>(k.args->params[i]);
      bytes.insert(bytes.end(), v, v + k.args->sizes[i]);
    }
    grid = k.grid;
    block = k.block;
    smem = k.smem;
  }
};

struct CachedGraph {
  GraphKey key;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t nodes[LaunchBatch::kMaxKernels] = {};  // in the batch's order
  NodeState state[LaunchBatch::kMaxKernels];
};

struct GraphCache {
  std::mutex mutex;
  std::deque<CachedGraph> graphs;
  std::vector<cudaStream_t> capture_streams;  // per device: where a new graph is captured
};

GraphCache& graph_cache() {
  static GraphCache* cache = new GraphCache;  // never freed (above)
  return *cache;
}

cudaStream_t capture_stream(GraphCache& cache, int device) {
  if (device >= static_cast<int>(cache.capture_streams.size())) cache.capture_streams.resize(device + 1, nullptr);
  cudaStream_t& s = cache.capture_streams[device];
  if (s == nullptr) FM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

// The batch's kernels captured on a private stream (so every edge is what launch_now makes:
// programmatic where asked) and instantiated; nodes mapped to the batch's order by function (the
// key's functions are distinct: LaunchBatch::launch checks). Called in relaxed capture mode.
CachedGraph build(GraphCache& cache, const GraphKey& key, const LaunchBatch::Kernel* kernels) {
  CachedGraph g;
  g.key = key;
  const cudaStream_t s = capture_stream(cache, key.device);
  FM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    for (int i = 0; i < key.count; ++i) launch_now(kernels[i], s);
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(s, &broken);
    if (broken != nullptr) cudaGraphDestroy(broken);
    throw;
  }
  FM_CUDA_CHECK(cudaStreamEndCapture(s, &g.graph));
  std::size_t n = 0;
  FM_CUDA_CHECK(cudaGraphGetNodes(g.graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  FM_CUDA_CHECK(cudaGraphGetNodes(g.graph, nodes.data(), &n));
  for (cudaGraphNode_t node : nodes) {
    cudaKernelNodeParams p{};
    FM_CUDA_CHECK(cudaGraphKernelNodeGetParams(node, &p));
    for (int i = 0; i < key.count; ++i)
      if (p.func == key.funcs[i]) g.nodes[i] = node;
  }
  for (int i = 0; i < key.count; ++i)
    if (g.nodes[i] == nullptr) {
      cudaGraphDestroy(g.graph);
      throw DeviceError("flashmonoid: a captured launch batch lacks kernel " + std::to_string(i));
    }
  const cudaError_t err = cudaGraphInstantiate(&g.exec, g.graph, 0);
  if (err != cudaSuccess) {
    cudaGraphDestroy(g.graph);
    FM_CUDA_CHECK(err);
  }
  for (int i = 0; i < key.count; ++i) g.state[i].take(kernels[i]);  // as captured
  return g;
}

}  // namespace

void LaunchBatch::check_room() const {
  if (count_ == kMaxKernels)
    throw DeviceError("flashmonoid: a launch batch holds at most " + std::to_string(kMaxKernels) + " kernels");
}

void launch_now(const LaunchBatch::Kernel& k, cudaStream_t stream) {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t config = programmatic_config(k.grid, k.block, k.smem, stream, attr);
  if (!k.programmatic) config.numAttrs = 0;
  FM_CUDA_CHECK(cudaLaunchKernelExC(&config, k.func, k.args->params));
}

void LaunchBatch::launch(cudaStream_t stream, int device) {
  const int count = count_;
  count_ = 0;
  GraphKey key;
  key.device = device;
  key.stream = stream;
  if (stream == cudaStreamPerThread) key.thread = std::this_thread::get_id();
  key.count = count;
  bool distinct = true;
  for (int i = 0; i < count; ++i) {
    key.funcs[i] = kernels_[i].func;
    key.programmatic[i] = kernels_[i].programmatic;
    for (int j = 0; j < i; ++j) distinct = distinct && key.funcs[j] != key.funcs[i];
  }
  if (count <= 1 || !distinct) {  // a graph of one kernel saves nothing; repeated kernels are not mapped
    for (int i = 0; i < count; ++i) launch_now(kernels_[i], stream);
    return;
  }
  GraphCache& cache = graph_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);  // a node's arguments and the launch that uses them
  auto it = std::find_if(cache.graphs.begin(), cache.graphs.end(), [&](const CachedGraph& g) { return g.key == key; });
  if (it == cache.graphs.end()) {
    // Evicting and instantiating graphs are "unsafe" while any thread captures in global mode
    // (torch.cuda.graph's default): this thread's calls meanwhile in relaxed mode (check.cuh).
    const RelaxedCaptureMode relaxed;
    if (cache.graphs.size() == kMaxGraphs) {
      cudaGraphExecDestroy(cache.graphs.front().exec);
      cudaGraphDestroy(cache.graphs.front().graph);
      cache.graphs.pop_front();
    }
    cache.graphs.push_back(build(cache, key, kernels_));
    it = cache.graphs.end() - 1;
  }
  for (int i = 0; i < count; ++i) {
    const Kernel& k = kernels_[i];
    if (it->state[i].matches(k)) continue;
    cudaKernelNodeParams p{};
    p.func = const_cast<void*>(k.func);
    p.gridDim = k.grid;
    p.blockDim = k.block;
    p.sharedMemBytes = static_cast<unsigned>(k.smem);
    p.kernelParams = k.args->params;
    FM_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(it->exec, it->nodes[i], &p));
    it->state[i].take(k);
  }
  FM_CUDA_CHECK(cudaGraphLaunch(it->exec, stream));
}

}  // namespace flashmonoid::cuda
