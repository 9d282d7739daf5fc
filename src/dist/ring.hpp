// Ring attention, written once over a Transport (NCCL or in-process) and DeviceOps (CUDA or CPU).
//
// Forward, rank r, steps t = 0 .. P-1: the K/V shard of rank (r - t) mod P is in kv[t % 2]; the
// exchange that brings the next one into kv[(t+1) % 2] is started before the step's attention is
// queued, so it overlaps it. Each layer of the step (RingSchedule) is one library forward per task
// into a partial (out, lse) over all local rows (rows no task covers keep lse = -inf, the identity),
// folded into the running state by flashmonoid::merge (fp32 running out; the last merge writes
// the caller's out and lse).
//
// Backward: the per-task library backward with the final (out, lse) of the whole row is exact
// for that task's keys. dQ sums locally in fp32; dK/dV sum in fp32 buffers that travel with their
// K/V shard one exchange behind it (sent when the step's gradients are in, received while the
// next step computes) and arrive home after step P-1.
#pragma once

#include <cstddef>

#include "dist/device_ops.hpp"
#include "dist/ring_schedule.hpp"
#include "dist/transport.hpp"
#include "flashmonoid/options.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid::dist {

// The schedule of a call with these options.
RingSchedule make_schedule(int world_size, std::int64_t seqlen_total, Layout layout, const Options& options);

// Bytes of ctx.workspace the calls below need (device memory of q's device; CPU memory on the CPU).
std::size_t ring_forward_workspace_size(const TensorView& q, const TensorView& k, const Options& options,
                                        const RingSchedule& schedule, int rank);
std::size_t ring_backward_workspace_size(const TensorView& q, const TensorView& k, const Options& options,
                                         const RingSchedule& schedule, int rank);

// q (b, n_r, h, d), k, v (b, n_r, h_k, d): this rank's shard under schedule (n_r = local_len(rank));
// out, lse as flashmonoid::forward. Options as for the whole sequence (causal, windows, softcap,
// softmax_scale); ALiBi and dropout are rejected. Throws flashmonoid::Error for bad input.
void ring_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                  const TensorView& lse, const Options& options, const RingSchedule& schedule, Transport& transport,
                  DeviceOps& ops, const Context& ctx);

void ring_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                   const TensorView& dv, const Options& options, const RingSchedule& schedule, Transport& transport,
                   DeviceOps& ops, const Context& ctx);

}  // namespace flashmonoid::dist
