// flashmonoid::ring::Ring: the ring driver (dist/ring.cpp) over NCCL point-to-point on a
// communication stream, ordered against the compute stream with events, never the host.
#include <nccl.h>

#include <array>
#include <string>

#include "cuda/common/check.cuh"
#include "dist/nccl_transport.hpp"
#include "dist/ring.hpp"
#include "flashmonoid/error.hpp"
#include "flashmonoid/ring.hpp"

namespace flashmonoid::dist {

void nccl_check(int result, const char* call) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r != ncclSuccess && r != ncclInProgress)
    throw DeviceError(std::string("flashmonoid: NCCL error in ") + call + ": " + ncclGetErrorString(r));
}
#define FM_NCCL_CHECK(call) ::flashmonoid::dist::nccl_check(static_cast<int>(call), #call)

NcclTransport::NcclTransport(ncclComm_t comm, const NcclStreams& streams, void* compute_stream)
    : comm_(comm), streams_(streams), compute_(compute_stream) {
  FM_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
  FM_NCCL_CHECK(ncclCommCount(comm, &world_));
}

int NcclTransport::start(Message send, Message recv, int shift) {
  const auto compute = static_cast<cudaStream_t>(compute_), comm = static_cast<cudaStream_t>(streams_.comm);
  FM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(streams_.ready), compute));
  FM_CUDA_CHECK(cudaStreamWaitEvent(comm, static_cast<cudaEvent_t>(streams_.ready), 0));
  FM_NCCL_CHECK(ncclGroupStart());
  FM_NCCL_CHECK(ncclSend(send.data, send.bytes, ncclUint8, (rank_ + shift) % world_, comm_, comm));
  FM_NCCL_CHECK(ncclRecv(recv.data, recv.bytes, ncclUint8, ((rank_ - shift) % world_ + world_) % world_, comm_, comm));
  FM_NCCL_CHECK(ncclGroupEnd());
  const int ticket = next_++;
  FM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(streams_.done[ticket % NcclStreams::kEvents]), comm));
  return ticket;
}

void NcclTransport::wait(int ticket) {
  // The driver keeps at most two exchanges in flight (K/V and dK/dV), so kEvents = 4 never reuses
  // an event that a pending wait still needs.
  FM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(compute_),
                                    static_cast<cudaEvent_t>(streams_.done[ticket % NcclStreams::kEvents]), 0));
}

NcclStreams NcclStreams::create() {
  NcclStreams s;
  // Highest priority: when an attention kernel's CTAs retire, the block scheduler places NCCL's
  // CTAs first, so transfers progress while attention fills the GPU.
  int least = 0, greatest = 0;
  FM_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t comm;
  FM_CUDA_CHECK(cudaStreamCreateWithPriority(&comm, cudaStreamNonBlocking, greatest));
  s.comm = comm;
  cudaEvent_t e;
  FM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  s.ready = e;
  for (auto& d : s.done) {
    FM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    d = e;
  }
  return s;
}

void NcclStreams::destroy() {
  if (comm) cudaStreamDestroy(static_cast<cudaStream_t>(comm));
  if (ready) cudaEventDestroy(static_cast<cudaEvent_t>(ready));
  for (void* d : done)
    if (d) cudaEventDestroy(static_cast<cudaEvent_t>(d));
  *this = NcclStreams{};
}

}  // namespace flashmonoid::dist

namespace flashmonoid::ring {

struct Ring::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0, world = 1;
  std::int64_t seqlen = 0;
  Layout layout = Layout::zigzag;
  dist::NcclStreams streams;

  dist::RingSchedule schedule(const Options& o) const {
    return dist::make_schedule(world, seqlen, layout == Layout::zigzag ? dist::Layout::zigzag : dist::Layout::contiguous, o);
  }
};

namespace {
void check_cuda(const TensorView& q) {
  if (q.device.kind != DeviceKind::cuda) throw Error("q", "ring attention runs on CUDA tensors, got " + to_string(q.device));
}
}  // namespace

Ring::Ring(ncclComm_t comm, std::int64_t seqlen_total, Layout layout) : impl_(std::make_unique<Impl>()) {
  if (comm == nullptr) throw Error("comm", "is null");
  impl_->comm = comm;
  FM_NCCL_CHECK(ncclCommUserRank(comm, &impl_->rank));
  FM_NCCL_CHECK(ncclCommCount(comm, &impl_->world));
  impl_->seqlen = seqlen_total;
  impl_->layout = layout;
  impl_->schedule(Options{});  // validates seqlen_total against the layout
  impl_->streams = dist::NcclStreams::create();
}

Ring::~Ring() { impl_->streams.destroy(); }

int Ring::rank() const { return impl_->rank; }
int Ring::world_size() const { return impl_->world; }
std::int64_t Ring::seqlen_total() const { return impl_->seqlen; }
Layout Ring::layout() const { return impl_->layout; }
std::int64_t Ring::local_len() const { return impl_->schedule(Options{}).local_len(impl_->rank); }

std::vector<std::pair<std::int64_t, std::int64_t>> Ring::shard_ranges(int rank) const {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (const dist::Segment& s : impl_->schedule(Options{}).segments(rank))
    out.emplace_back(s.global_begin, s.global_begin + s.length);
  return out;
}

std::size_t Ring::forward_workspace_size(const TensorView& q, const TensorView& k, const Options& o) const {
  return dist::ring_forward_workspace_size(q, k, o, impl_->schedule(o), impl_->rank);
}

std::size_t Ring::backward_workspace_size(const TensorView& q, const TensorView& k, const Options& o) const {
  return dist::ring_backward_workspace_size(q, k, o, impl_->schedule(o), impl_->rank);
}

void Ring::forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                   const TensorView& lse, const Options& o, const Context& ctx) {
  check_cuda(q);
  dist::NcclTransport transport(impl_->comm, impl_->streams, ctx.stream);
  dist::CudaOps ops(ctx.stream);
  dist::ring_forward(q, k, v, out, lse, o, impl_->schedule(o), transport, ops, ctx);
}

void Ring::backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                    const TensorView& dv, const Options& o, const Context& ctx) {
  check_cuda(q);
  dist::NcclTransport transport(impl_->comm, impl_->streams, ctx.stream);
  dist::CudaOps ops(ctx.stream);
  dist::ring_backward(dout, q, k, v, out, lse, dq, dk, dv, o, impl_->schedule(o), transport, ops, ctx);
}

}  // namespace flashmonoid::ring
