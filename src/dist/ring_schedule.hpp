// The ring schedule of context-parallel attention, independent of any backend or transport.
//
// A sequence of seqlen_total tokens (self-attention: queries and keys are the same positions) is
// split into chunks; rank r holds some chunks of Q, K and V (its "shard", rows in ascending
// chunk order). At step t rank r holds the K/V shard of rank src = (r - t) mod P, which it received
// from rank r - 1 and passes on to rank r + 1. Each step is a list of Tasks: rectangles (local q
// rows) x (rows of the visiting K/V shard) with the Options mask that reproduces, in the library's
// bottom-right convention, the global mask on that rectangle. Pairs of chunks that the mask
// empties are not computed; neighbouring rectangles are coalesced into one call where one mask is
// exact for all of them (the zigzag diagonal step is a single causal call).
//
// Layouts, with chunk i of n covering rows [floor(i·S/n), floor((i+1)·S/n)) (no padding: chunks of
// an S not divisible by n differ by one row; every rank computes the same boundaries from S):
//   contiguous: n = P chunks, rank r holds chunk r.                (the default without causal)
//   zigzag:     n = 2P chunks, rank r holds chunks r and 2P-1-r.   (the default with causal: every
//               rank then has the same causal work at every step)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashmonoid::dist {

enum class Layout : std::uint8_t { contiguous, zigzag };
std::string to_string(Layout l);

// Rows [global_begin, global_begin + length) of the sequence, stored from local row local_begin.
struct Segment {
  std::int64_t global_begin = 0, local_begin = 0, length = 0;
};

// One library call: q rows [q_begin, q_end) of the local shard against rows [k_begin, k_end) of
// the visiting K/V shard, masked by (window_left, window_right) in the library's bottom-right
// convention (-1 unbounded; window_right = 0 with window_left = -1 is causal).
struct Task {
  std::int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0;
  int window_left = -1, window_right = -1;
  friend bool operator==(const Task&, const Task&) = default;
};

// What rank `rank` does at one step: the source of the visiting K/V and the tasks, grouped into
// layers whose q rows are disjoint (each layer is one partial (out, lse) folded into the running
// state with merge; layers of one step cover different key sets of the same rows or different rows).
struct Step {
  int src = 0;
  std::vector<std::vector<Task>> layers;
  bool empty() const { return layers.empty(); }
};

class RingSchedule {
 public:
  // window_left / window_right: the global mask as Options has it (-1 unbounded; causal means
  // window_right = 0). Throws flashmonoid::Error for world_size < 1 or a sequence shorter than the
  // number of chunks.
  RingSchedule(int world_size, std::int64_t seqlen_total, Layout layout, int window_left, int window_right);

  int world_size() const { return world_; }
  std::int64_t seqlen_total() const { return seqlen_; }
  Layout layout() const { return layout_; }
  int chunks() const { return layout_ == Layout::zigzag ? 2 * world_ : world_; }
  std::int64_t chunk_begin(int i) const { return static_cast<std::int64_t>(i) * seqlen_ / chunks(); }

  std::vector<Segment> segments(int rank) const;
  std::int64_t local_len(int rank) const;
  std::int64_t max_local_len() const;
  // Steps 0 .. num_steps()-1 of a rank; step t visits the shard of rank (rank - t) mod P.
  std::vector<Step> steps(int rank) const;
  // P, or fewer when a window leaves every rank's last steps empty (causal with a left window on
  // the contiguous layout: a window of w needs ceil(w / shard) + 1 steps). The ring then stops
  // early and sends dK/dV home directly (shift home_shift()).
  int num_steps() const { return num_steps_; }
  // After the last step, rank r holds the dK/dV sums of shard r - (num_steps() - 1); they go to
  // rank r + home_shift(). 0 when they are already home (a single step).
  int home_shift() const { return (world_ - num_steps() + 1) % world_; }
  static int source(int rank, int step, int world) { return ((rank - step) % world + world) % world; }

 private:
  std::vector<Step> all_steps(int rank) const;  // all P steps, empty ones included

  int world_;
  std::int64_t seqlen_;
  Layout layout_;
  std::int64_t lo_, hi_;  // key j is visible to query i iff lo_ <= j - i <= hi_ (global positions)
  int num_steps_ = 1;
};

}  // namespace flashmonoid::dist
