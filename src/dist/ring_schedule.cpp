#include "dist/ring_schedule.hpp"

#include <algorithm>
#include <optional>

#include "flashmonoid/error.hpp"

namespace flashmonoid::dist {
namespace {

// "Unbounded" for band limits; far from int64 overflow when shifted by sequence positions.
constexpr std::int64_t kInf = std::int64_t{1} << 60;

std::int64_t shifted(std::int64_t limit, std::int64_t by) {
  return limit >= kInf || limit <= -kInf ? limit : limit + by;
}

// Key column j is visible to query row i iff lo <= j - i <= hi (local coordinates of a step).
struct Band {
  std::int64_t lo = -kInf, hi = kInf;
};

// Rows [q0, q1) of the local Q against rows [k0, k1) of the visiting K/V shard.
struct Rect {
  std::int64_t q0 = 0, q1 = 0, k0 = 0, k1 = 0;
  bool empty() const { return q0 >= q1 || k0 >= k1; }
};

Rect intersect(const Rect& a, const Rect& b) {
  return {std::max(a.q0, b.q0), std::min(a.q1, b.q1), std::max(a.k0, b.k0), std::min(a.k1, b.k1)};
}
Rect bounding(const Rect& a, const Rect& b) {
  return {std::min(a.q0, b.q0), std::max(a.q1, b.q1), std::min(a.k0, b.k0), std::max(a.k1, b.k1)};
}

// The band's visible set on r is the same as the band's limits clamped to the diagonals r holds;
// every diagonal j - i in [min_d, max_d] occurs in a rectangle, so the clamped pair determines the set.
bool same_visible_set(const Rect& r, const Band& a, const Band& b) {
  const std::int64_t min_d = r.k0 - (r.q1 - 1), max_d = (r.k1 - 1) - r.q0;
  auto clamp_band = [&](const Band& x) {
    return Band{std::clamp(x.lo, min_d, max_d + 1), std::clamp(x.hi, min_d - 1, max_d)};
  };
  const Band ca = clamp_band(a), cb = clamp_band(b);
  const bool empty_a = ca.lo > ca.hi, empty_b = cb.lo > cb.hi;
  if (empty_a || empty_b) return empty_a == empty_b;
  return ca.lo == cb.lo && ca.hi == cb.hi;
}

// Rows and columns of r that see / are seen by anything under the band.
Rect trim(const Rect& r, const Band& band) {
  if (band.lo > band.hi) return {};
  return {std::max(r.q0, shifted(-band.hi, r.k0)), std::min(r.q1, shifted(-band.lo, r.k1)),
          std::max(r.k0, shifted(band.lo, r.q0)), std::min(r.k1, shifted(band.hi, r.q1))};
}

// The library call computing band on rectangle r. Its mask is bottom-right aligned:
// j - i <= (k1 - q1) + window_right and j - i >= (k1 - q1) - window_left (coordinates of the
// step), so window_right = hi - (k1 - q1) and window_left = (k1 - q1) - lo; a limit that cannot
// bind inside r becomes -1 (unbounded, the library's unmasked path). None when a limit would be
// negative (not expressible); trimmed rectangles never are.
std::optional<Task> task_for(const Rect& r, const Band& band) {
  const std::int64_t corner = r.k1 - r.q1, nq = r.q1 - r.q0, nk = r.k1 - r.k0;
  std::int64_t wr = band.hi >= kInf ? -1 : band.hi - corner;
  std::int64_t wl = band.lo <= -kInf ? -1 : corner - band.lo;
  if (wr >= nq - 1) wr = -1;
  if (wl >= nk - 1) wl = -1;
  if (wr < -1 || wl < -1) return std::nullopt;
  return Task{r.q0, r.q1, r.k0, r.k1, static_cast<int>(wl), static_cast<int>(wr)};
}

Rect rect_of(const Task& t) { return {t.q_begin, t.q_end, t.k_begin, t.k_end}; }

// The band a task computes, in step coordinates.
Band band_of(const Task& t) {
  const std::int64_t corner = t.k_end - t.q_end;
  return {t.window_left < 0 ? -kInf : corner - t.window_left, t.window_right < 0 ? kInf : corner + t.window_right};
}

struct Pair {
  Rect rect;
  Band band;
};

// One call for the bounding box of tasks a and b, when some mask is exact on every chunk pair the
// box covers (chunk pairs the true mask empties included) and the box overlaps no other task.
std::optional<Task> coalesce(const Task& a, const Task& b, const std::vector<Task>& others,
                             const std::vector<Pair>& pairs) {
  const Rect box = bounding(rect_of(a), rect_of(b));
  for (const Task& o : others)
    if (!intersect(rect_of(o), box).empty()) return std::nullopt;
  for (const Band& candidate : {band_of(a), band_of(b), Band{}}) {
    std::optional<Task> t = task_for(box, candidate);
    if (!t) continue;
    const Band computed = band_of(*t);
    bool exact = true;
    for (const Pair& p : pairs) {
      const Rect part = intersect(p.rect, box);
      if (!part.empty() && !same_visible_set(part, p.band, computed)) {
        exact = false;
        break;
      }
    }
    if (exact) return t;
  }
  return std::nullopt;
}

}  // namespace

std::string to_string(Layout l) { return l == Layout::zigzag ? "zigzag" : "contiguous"; }

RingSchedule::RingSchedule(int world_size, std::int64_t seqlen_total, Layout layout, int window_left,
                           int window_right)
    : world_(world_size), seqlen_(seqlen_total), layout_(layout) {
  if (world_size < 1) throw Error("world_size", "must be >= 1, got " + std::to_string(world_size));
  if (seqlen_total < chunks())
    throw Error("seqlen_total", "the " + to_string(layout) + " layout over " + std::to_string(world_size) +
                                    " ranks cuts the sequence into " + std::to_string(chunks()) +
                                    " chunks, so it needs at least that many tokens, got " +
                                    std::to_string(seqlen_total));
  lo_ = window_left >= 0 ? -static_cast<std::int64_t>(window_left) : -kInf;
  hi_ = window_right >= 0 ? static_cast<std::int64_t>(window_right) : kInf;
  for (int r = 0; r < world_; ++r) {  // the last step any rank computes
    const std::vector<Step> all = all_steps(r);
    for (int t = world_ - 1; t >= num_steps_; --t)
      if (!all[t].empty()) {
        num_steps_ = t + 1;
        break;
      }
  }
}

std::vector<Segment> RingSchedule::segments(int rank) const {
  std::vector<int> ids{rank};
  if (layout_ == Layout::zigzag) ids.push_back(2 * world_ - 1 - rank);
  std::vector<Segment> segs;
  std::int64_t local = 0;
  for (int c : ids) {
    const std::int64_t b = chunk_begin(c), e = chunk_begin(c + 1);
    segs.push_back({b, local, e - b});
    local += e - b;
  }
  return segs;
}

std::int64_t RingSchedule::local_len(int rank) const {
  std::int64_t n = 0;
  for (const Segment& s : segments(rank)) n += s.length;
  return n;
}

std::int64_t RingSchedule::max_local_len() const {
  std::int64_t n = 0;
  for (int r = 0; r < world_; ++r) n = std::max(n, local_len(r));
  return n;
}

std::vector<Step> RingSchedule::steps(int rank) const {
  std::vector<Step> all = all_steps(rank);
  all.resize(num_steps_);
  return all;
}

std::vector<Step> RingSchedule::all_steps(int rank) const {
  std::vector<Step> out;
  const std::vector<Segment> qs = segments(rank);
  for (int t = 0; t < world_; ++t) {
    Step step;
    step.src = source(rank, t, world_);
    // Chunk pairs, each with the global band moved into step coordinates.
    std::vector<Pair> pairs;
    std::vector<Task> tasks;
    for (const Segment& qseg : qs)
      for (const Segment& kseg : segments(step.src)) {
        const std::int64_t shift = (qseg.global_begin - qseg.local_begin) - (kseg.global_begin - kseg.local_begin);
        const Pair p{{qseg.local_begin, qseg.local_begin + qseg.length, kseg.local_begin, kseg.local_begin + kseg.length},
                     {shifted(lo_, shift), shifted(hi_, shift)}};
        pairs.push_back(p);
        const Rect visible = trim(p.rect, p.band);
        if (!visible.empty()) tasks.push_back(*task_for(visible, p.band));
      }
    for (bool merged = true; merged;) {
      merged = false;
      for (std::size_t i = 0; i < tasks.size() && !merged; ++i)
        for (std::size_t j = i + 1; j < tasks.size() && !merged; ++j) {
          std::vector<Task> others;
          for (std::size_t o = 0; o < tasks.size(); ++o)
            if (o != i && o != j) others.push_back(tasks[o]);
          if (std::optional<Task> c = coalesce(tasks[i], tasks[j], others, pairs)) {
            others.push_back(*c);
            tasks = std::move(others);
            merged = true;
          }
        }
    }
    std::sort(tasks.begin(), tasks.end(),
              [](const Task& a, const Task& b) { return a.q_begin != b.q_begin ? a.q_begin < b.q_begin : a.k_begin < b.k_begin; });
    for (const Task& t : tasks) {
      auto fits = [&](const std::vector<Task>& layer) {
        return std::none_of(layer.begin(), layer.end(),
                            [&](const Task& o) { return o.q_begin < t.q_end && t.q_begin < o.q_end; });
      };
      auto it = std::find_if(step.layers.begin(), step.layers.end(), fits);
      if (it == step.layers.end())
        step.layers.push_back({t});
      else
        it->push_back(t);
    }
    out.push_back(std::move(step));
  }
  return out;
}

}  // namespace flashmonoid::dist
