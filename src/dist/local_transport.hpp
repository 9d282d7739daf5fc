// The ring on the CPU: P ranks are P threads of one process sharing a LocalRing. Each exchange is
// copied inside wait(), between two barriers, from the predecessor's send buffer as it is at that
// moment: a driver that touched a buffer between start() and wait() (a missing double buffer)
// sends or reads the wrong data and fails the tests, as it would with NCCL.
#pragma once

#include <barrier>
#include <mutex>
#include <vector>

#include "dist/transport.hpp"

namespace flashmonoid::dist {

class LocalRing {
 public:
  explicit LocalRing(int world_size) : world_(world_size), barrier_(world_size), posted_(world_size) {}
  int world_size() const { return world_; }

 private:
  friend class LocalTransport;
  struct Posted {
    Message send, recv;
    int shift = 1;
  };
  int world_;
  std::barrier<> barrier_;
  std::mutex mutex_;
  std::vector<std::vector<Posted>> posted_;  // [rank][ticket]
};

class LocalTransport final : public Transport {
 public:
  LocalTransport(LocalRing& ring, int rank) : ring_(ring), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return ring_.world_size(); }
  int start(Message send, Message recv, int shift) override;
  void wait(int ticket) override;

 private:
  LocalRing& ring_;
  int rank_;
};

}  // namespace flashmonoid::dist
