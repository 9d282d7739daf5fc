// A number new at every kernel launch of the process, for flags and counters that live in a
// caller's workspace and must not be mistaken for an earlier launch's (the sm90 forward's split
// tail, the sm80 forward's shared split tiles): never 0 (odd), from a random start, so that no word
// left in a reused workspace by an earlier launch or another process matches it. A CUDA graph
// replays its launches' epochs, so those words are set back to 0 at the end of every launch.
#pragma once

#include <atomic>
#include <chrono>
#include <random>

namespace flashmonoid::cuda {

inline unsigned long long next_launch_epoch() {
  static std::atomic<unsigned long long> next{[] {
    std::random_device rd;
    const unsigned long long t = static_cast<unsigned long long>(std::chrono::steady_clock::now().time_since_epoch().count());
    return ((static_cast<unsigned long long>(rd()) << 32) ^ rd() ^ (t * 0x9E3779B97F4A7C15ull)) | 1ull;
  }()};
  return next.fetch_add(2, std::memory_order_relaxed);
}

}  // namespace flashmonoid::cuda
