// Tile shapes of the sm90 forward, shared by the kernel (template arguments) and the host planning
// code (grid, shared memory), so both always agree.
#pragma once

#include <cstddef>



namespace flashmonoid::cuda {

struct FwdTileSm90 {
  int consumers;  // consumer warpgroups, 64 query rows each (one wgmma M)
  int block_n;    // keys per mainloop step (wgmma N of S = QKᵀ, K of O = PV)
  int stages;     // K/V ring depth
  int consumer_regs, producer_regs;  // setmaxnreg targets: 128·(producer + consumers·consumer) <= 64K
  int q_stages;  // Q buffers: with 2 the next work tile's Q loads while this one's epilogue runs
  bool pingpong;  // consumers take turns issuing their products (kernel_fwd_sm90.cuh: Turns)
  bool direct_store;  // O from registers (store_output_regs), Q released after the last S; else staged in Q

  constexpr int block_m() const { return 64 * consumers; }
  constexpr int threads() const { return 128 * (consumers + 1); }
  // q_stages Q tiles, then `stages` K tiles and `stages` V tiles, each (rows, head_dim) of 2-byte
  // elements, plus the barriers and the 1024-byte alignment of the swizzled panels.
  constexpr std::size_t smem_bytes(int head_dim) const {
    return static_cast<std::size_t>(q_stages * block_m() + 2 * stages * block_n) * head_dim * 2 + 2048;
  }
};

// Consumer warpgroups of 64 rows, 240 registers each with 2 consumers, 160 with 3; 128 keys per step
// at hdim 64 and 128, 80 at hdim 256 (O is 128 fp32 registers per thread; no score-modifier variant
// there, see fwd_sm90_eligible). Two Q buffers where they fit (hdim 256: Q 64 KB + K/V 160 KB).
// hdim 64 takes 3 consumers (192 rows, FlashAttention-3's block height): +13-35% over 2 at 1k-16k
// non-causal on H100 (16k: 523 vs 387 TFLOP/s), where the exponentials of 2 warpgroups left the
// tensor cores idle; 192 keys with 2 consumers measured equal to 128 (within 2%). With score
// modifiers 3 consumers spilled 208 bytes at 160 registers, so that variant keeps 2.
// Ping-pong pays where the exponentials are the bottleneck: hdim 64 +5-9% non-causal, +0-10% causal
// (16k: 548 vs 505, 506 vs 460 TFLOP/s); at hdim 128 where a work tile is short (512-1k keys: +2-7%,
// 8k within 1%), one warpgroup's first softmax and epilogue running under the other's products.
// Direct stores (store_output_regs) pay at hdim 64 and 256, not at hdim 128 (epilogue.cuh).
constexpr FwdTileSm90 fwd_tile_sm90(int head_dim_bucket, bool score_mods) {
  if (head_dim_bucket <= 64)
    return score_mods ? FwdTileSm90{2, 128, 2, 240, 24, 2, false, false} : FwdTileSm90{3, 128, 2, 160, 24, 2, true, true};
  if (head_dim_bucket <= 128)
    return score_mods ? FwdTileSm90{2, 128, 2, 240, 24, 2, false, false} : FwdTileSm90{2, 128, 2, 240, 24, 2, true, false};
  return {2, 80, 2, 240, 24, 1, false, true};
}

}  // namespace flashmonoid::cuda
