#include "dist/local_transport.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace flashmonoid::dist {

int LocalTransport::start(Message send, Message recv, int shift) {
  std::lock_guard<std::mutex> lock(ring_.mutex_);
  auto& mine = ring_.posted_[rank_];
  mine.push_back({send, recv, shift});
  return static_cast<int>(mine.size()) - 1;
}

void LocalTransport::wait(int ticket) {
  ring_.barrier_.arrive_and_wait();  // every rank has posted this exchange
  {
    std::lock_guard<std::mutex> lock(ring_.mutex_);
    const int prev = ((rank_ - ring_.posted_[rank_].at(ticket).shift) % world_size() + world_size()) % world_size();
    const Message from = ring_.posted_[prev].at(ticket).send;
    const Message to = ring_.posted_[rank_].at(ticket).recv;
    if (from.bytes != to.bytes) {  // a schedule bug; throwing would leave the other ranks at the barrier
      std::fprintf(stderr, "ring exchange %d: rank %d sends %zu bytes, rank %d expects %zu\n", ticket, prev, from.bytes,
                   rank_, to.bytes);
      std::abort();
    }
    std::memcpy(to.data, from.data, from.bytes);
  }
  ring_.barrier_.arrive_and_wait();  // every copy out of the send buffers is done
}

}  // namespace flashmonoid::dist
