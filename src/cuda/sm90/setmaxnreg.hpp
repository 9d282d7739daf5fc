// The register and shared-memory budgets of a warp-specialised sm90 block, shared by the forward and
// backward tiles.
#pragma once

namespace flashmonoid::cuda {

// setmaxnreg moves registers between the warpgroups of a block; the targets must fit what the block
// was launched with (65536 / threads per thread, which ptxas rounds down to 8), or the consumers'
// increase waits forever (a backward with 32 producer registers hung on the H200).
constexpr bool setmaxnreg_fits(int threads, int producer_regs, int consumers, int consumer_regs) {
  return 128 * (producer_regs + consumers * consumer_regs) <= 65536 / threads / 8 * 8 * threads;
}

// Dynamic shared memory one block may opt into on sm90 (227 KB).
inline constexpr unsigned kSmemPerBlockSm90 = 232448;

}  // namespace flashmonoid::cuda
