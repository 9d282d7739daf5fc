// Context parallelism: ring attention over NCCL (target flashmonoid::dist, built when CMake finds
// NCCL; this header is installed only then). One process per GPU; the sequence of seqlen_total
// tokens is sharded over the ranks of the caller's communicator, Q, K and V alike:
//   Layout::zigzag      2P chunks, rank r holds chunks r and 2P-1-r, in that order (for causal:
//                       every rank then has the same work at every step);
//   Layout::contiguous  P chunks, rank r holds chunk r.
// Chunk i of n covers tokens [floor(i·S/n), floor((i+1)·S/n)): no padding, any S >= n works and
// chunks differ by at most one token. shard_ranges() lists a rank's token ranges.
//
// K/V shards travel around the ring (ncclSend/ncclRecv on the Ring's communication stream),
// double-buffered so that the next exchange overlaps the current block's attention on the compute
// stream (ctx.stream); CUDA events order the two streams and the host never waits. Partial
// results fold into (out, lse) with flashmonoid::merge. Backward: dQ stays local, dK/dV sum in
// fp32 and travel with their shard. The results equal single-device attention on the whole
// sequence with the same Options (causal, windows, softcap, softmax_scale, GQA/MQA; ALiBi and
// dropout are rejected).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "flashmonoid/options.hpp"
#include "flashmonoid/tensor.hpp"

// nccl.h's handle type, declared the same way so that this header does not need nccl.h.
typedef struct ncclComm* ncclComm_t;

namespace flashmonoid::ring {

enum class Layout : std::uint8_t { contiguous, zigzag };

class Ring {
 public:
  // Borrows comm (the caller keeps and destroys it); creates a communication stream and a few
  // events on the current CUDA device.
  // layout is how the caller sharded Q, K and V (zigzag for causal attention).
  Ring(ncclComm_t comm, std::int64_t seqlen_total, Layout layout);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  int rank() const;
  int world_size() const;
  std::int64_t seqlen_total() const;
  Layout layout() const;
  // Rows of this rank's shard, and the token ranges [begin, end) they hold, in local order.
  std::int64_t local_len() const;
  std::vector<std::pair<std::int64_t, std::int64_t>> shard_ranges(int rank) const;

  // Bytes of ctx.workspace (device memory) that forward / backward need.
  std::size_t forward_workspace_size(const TensorView& q, const TensorView& k, const Options& options = {}) const;
  std::size_t backward_workspace_size(const TensorView& q, const TensorView& k, const Options& options = {}) const;

  // q (b, n, h, d), k, v (b, n, h_k, d) with n = local_len(); out like q, lse fp32 (b, h, n).
  // Collective: every rank of the communicator calls it with the same options.
  void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
               const TensorView& lse, const Options& options, const Context& ctx);
  // out and lse are this rank's rows of the forward's results.
  void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                const TensorView& dv, const Options& options, const Context& ctx);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashmonoid::ring
