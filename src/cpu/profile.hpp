// Where the CPU flash forward's cycles go, by phase (rdtsc), for machines without perf (the GPU
// machine's Xeon): compiled in only with -DFLASHMONOID_CPU_PROFILE=ON, otherwise every Lap is an
// empty object and print() does nothing. flashmonoid-bench prints the phases after each length.
#pragma once

#include <cstdio>

namespace flashmonoid::cpu::profile {

enum Phase : int { pack, load_q, scores, softmax, to_pairs, rescale, accumulate, store, merge, kPhases };

#ifdef FLASHMONOID_CPU_PROFILE
// A stopwatch over one thread's consecutive phases: charge(phase) adds the cycles since the last
// charge (or the construction) to that phase, in this thread's counters.
class Lap {
 public:
  Lap();
  void charge(Phase phase);

 private:
  unsigned long long last_;
};
// This thread's counters into the process totals (each worker calls it once its work is done).
void flush();
// The totals since the last print, per phase (cycles summed over threads, and shares); resets them.
void print(std::FILE* out);
#else
struct Lap {
  void charge(Phase) {}
};
inline void flush() {}
inline void print(std::FILE*) {}
#endif

}  // namespace flashmonoid::cpu::profile
