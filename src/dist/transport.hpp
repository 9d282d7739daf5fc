// How K/V shards and their gradients move around the ring. The driver (ring.cpp) is written once
// against this interface; NcclTransport (nccl_transport.cu) moves bytes with ncclSend/ncclRecv on
// a communication stream, LocalTransport (local_transport.hpp) copies between ranks that are
// threads of one process (the CPU simulation the tests run).
#pragma once

#include <cstddef>

namespace flashmonoid::dist {

struct Message {
  void* data = nullptr;
  std::size_t bytes = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Queues one ring exchange: `send` goes to rank + shift, `recv` is filled from rank - shift
  // (mod P; shift 1 but for dK/dV going home after a ring that stopped early). The exchange
  // is ordered after all work queued so far on the compute stream (which may still be writing
  // `send` or reading the old contents of `recv`); the host does not wait for it. Every rank calls
  // start and wait in the same order. Returns a ticket for wait().
  virtual int start(Message send, Message recv, int shift) = 0;
  // Work queued on the compute stream after this call sees exchange `ticket` complete; until then
  // neither buffer of that exchange may be touched.
  virtual void wait(int ticket) = 0;
};

}  // namespace flashmonoid::dist
