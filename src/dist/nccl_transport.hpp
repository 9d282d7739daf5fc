// The ring's Transport over NCCL point-to-point (ring_nccl.cu). Exchanges run on a communication
// stream: each waits (event `ready`) for the compute stream's work queued before it, and the
// compute stream waits (events `done`) only where the driver calls wait(). No host synchronisation.
#pragma once

#include <array>

#include "dist/transport.hpp"

typedef struct ncclComm* ncclComm_t;

namespace flashmonoid::dist {

// The communication stream and events, created once per flashmonoid::ring::Ring (CUDA handles as void*).
struct NcclStreams {
  static constexpr int kEvents = 4;
  void* comm = nullptr;
  void* ready = nullptr;
  std::array<void*, kEvents> done{};
  static NcclStreams create();
  void destroy();
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(ncclComm_t comm, const NcclStreams& streams, void* compute_stream);
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int start(Message send, Message recv, int shift) override;
  void wait(int ticket) override;

 private:
  ncclComm_t comm_;
  NcclStreams streams_;
  void* compute_;
  int rank_ = 0, world_ = 1, next_ = 0;
};

}  // namespace flashmonoid::dist
