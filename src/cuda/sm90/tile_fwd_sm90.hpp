// Tile shapes of the sm90 forward, shared by the kernel (template arguments) and the host planning
// code (grid, shared memory), so both always agree.
#pragma once

#include <cstddef>
#include <initializer_list>

#include "api/params.hpp"
#include "sm90/setmaxnreg.hpp"

namespace flashmonoid::cuda {

// The sm90 forward's head-dim buckets: a head dim runs in the smallest of 64, 96, 128, 192, 256 that
// holds it, its products over the bucket's columns (TMA zero-fills those past the head dim). 96 and
// 192 have buckets of their own here (the sm80 kernels and the backward pad them to 128 and 256),
// because padding costs the products a third of their work: 128 / 96 and 256 / 192.
constexpr int fwd_head_dim_bucket_sm90(int d) {
  return d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : d <= 192 ? 192 : 256;
}
// Columns of a tile's shared-memory layout: whole 64-column panels (the 128-byte swizzle's rows), so
// hdim 96's tiles are laid out as 128 columns whose last 32 no product reads.
constexpr int fwd_panel_cols_sm90(int head_dim_bucket) { return (head_dim_bucket + 63) / 64 * 64; }

// How a consumer writes its finished O (64, kHeadDim) (kernel_fwd_sm90.cuh's epilogue); either way
// its Q buffer goes back to the producer right after the tile's last S product.
// - tma: normalised into an O buffer of its own (128-byte-swizzled panels) and written by one TMA
//   tile store per panel; varlen calls store from registers instead (a box's rows past a sequence's
//   end belong to the next sequence). H200, bf16, against staging O in the Q buffer and storing it
//   with 16-byte stores: hdim 128 +9% / +4% / +2% at 512 / 1k / 2k keys (500 vs 458 TFLOP/s at 512),
//   causal +11% / +7% at 512 / 1k; hdim 64 +1-3% over `regs` below 16k.
// - regs: straight from the accumulators (common/epilogue.cuh: store_output_regs), where shared
//   memory has no room for an O buffer (hdim 256: Q 64 KB + K/V 160 KB).
enum class FwdStore { regs, tma };

// The kernel variants of a head-dim bucket: the plain one; one with softcap, ALiBi and dropout
// compiled in (the plain one carries none of their registers); one for causal-like masks up to
// short_band_rows query rows, and at hdim 96 for any call up to kShortRowsHdim96 rows (short_band:
// 128-row tiles where the plain kernel's are 192 (hdim 64, 96), the narrow diagonal step from hdim
// 96 on); at hdim 128, one of 160-key steps for long unmasked key ranges (fwd_long_keys).
// run_fwd_sm90 chooses.
enum class FwdVariantSm90 { plain, score_mods, short_band, long_keys };

struct FwdTileSm90 {
  int consumers;  // consumer warpgroups, 64 query rows each (one wgmma M)
  int block_n;    // keys per mainloop step (wgmma N of S = QKᵀ, K of O = PV)
  int stages;     // K/V ring depth
  int consumer_regs, producer_regs;  // setmaxnreg targets (registers_fit)
  int q_stages;  // Q buffers: with 2 the next work tile's Q loads while this one's epilogue runs
  bool pingpong;  // consumers take turns issuing their products (kernel_fwd_sm90.cuh: Turns)
  FwdStore store;
  // The causal mask's bit form (score_mod.cuh: mask_rows) rather than a compare per element: the
  // short_band kernel, whose tiles are 1-16 steps of which the first is the masked diagonal (H100,
  // hdim 64 causal, against the compare form: 512 / 1k / 2k keys 215.5 -> 220.9 / 304.8 -> 309.4 /
  // 368.4 -> 372.3 TFLOP/s). Elsewhere it cost the mainloop 1.7-3.9% at 16k.
  bool mask_bits = false;
  // The narrow diagonal step (0: off): a consumer whose rows see no key at or past key0 + diag_keys
  // of its first (diagonal) key tile computes only those diag_keys columns of S and of P·V there
  // (kernel_fwd_sm90.cuh). With 128-row tiles and 128-key steps that is the upper consumer of every
  // causal tile: its diagonal step costs half; at hdim 256 (80-key steps) the upper consumer sees at
  // most 17 columns of its first tile. The result is the same bits: the columns left out are masked
  // (P = 0) for these rows. H100, causal, against the same kernels without it: hdim 128 1k / 2k
  // +2.2% / +1.5%, hdim 256 1k / 2k +2.1% / +1.0%, nothing at 512. Only in the short_band kernels,
  // so the long mainloops keep their SASS; not at hdim 64, where the extra code paths (the kernel
  // grew from 2896 to 4264 instructions, and its two consumers run different ones) missed the
  // instruction cache: causal 512 230 -> 207 TFLOP/s, ncu's no-instruction stalls 9x.
  int diag_keys = 0;
  // The consumers share one 64-row block and split O's columns (hdim 256 with score modifiers, where
  // O (64, 256) would be 128 of a consumer's 240 registers beside the modifiers' state): each computes
  // the whole of S and the softmax for the block's rows, and P·V into its half of the head dim.
  bool head_split = false;

  constexpr int block_m() const { return head_split ? 64 : 64 * consumers; }
  // Columns of O per consumer.
  constexpr int o_cols(int head_dim_bucket) const { return head_split ? head_dim_bucket / consumers : head_dim_bucket; }
  constexpr int threads() const { return 128 * (consumers + 1); }
  constexpr bool registers_fit() const { return setmaxnreg_fits(threads(), producer_regs, consumers, consumer_regs); }
  constexpr int o_rows() const { return store == FwdStore::tma ? block_m() : 0; }
  // q_stages Q tiles, then `stages` K tiles and `stages` V tiles, then the O tile of a TMA store,
  // each (rows, head_dim) of 2-byte elements, plus the barriers and the 1024-byte alignment of the
  // swizzled panels.
  constexpr std::size_t smem_bytes(int head_dim_bucket) const {
    return static_cast<std::size_t>(q_stages * block_m() + 2 * stages * block_n + o_rows()) *
               fwd_panel_cols_sm90(head_dim_bucket) * 2 +
           2048;
  }
};

// Consumer warpgroups of 64 rows, 240 registers each with 2 consumers, 160 with 3; 128 keys per step
// at hdim 64 and 128 (160 over long unmasked key ranges at hdim 128: kLongKeys), 80 at hdim 256 (O is
// 128 fp32 registers per thread; with score modifiers, head_split). Two Q buffers where they fit (not
// at hdim 256: Q 64 KB + K/V 160 KB).
// hdim 64 takes 3 consumers (192 rows, FlashAttention-3's block height): +13-35% over 2 at 1k-16k
// non-causal on H100 (16k: 523 vs 387 TFLOP/s), where the exponentials of 2 warpgroups left the
// tensor cores idle; 192 keys with 2 consumers measured equal to 128 (within 2%). With score
// modifiers 3 consumers spilled 208 bytes at 160 registers, so that variant keeps 2. Under a causal
// mask a 192-row tile computes more masked scores than a 128-row one (s = 1k: 1.5x the visible ones
// against 1.12x), which outweighs the third consumer up to 2k rows (short_band, H200: 195 / 275 / 345
// against 167 / 240 / 333 TFLOP/s at 512 / 1k / 2k; 390 against 411 at 4k).
// hdim 64 has shared memory to spare: a 4-deep K/V ring keeps more bytes in flight where a work tile
// is a few steps long (H100 against 2: causal 512 217 -> 223 TFLOP/s, 512 378 -> 383, causal 1k
// +1.5%; equal from 2k on; 3 stages the same at 512, -1.6% at causal 2k).
// Ping-pong pays where the exponentials are the bottleneck: hdim 64 +5-9% non-causal, +0-10% causal
// (16k: 548 vs 505, 506 vs 460 TFLOP/s); at hdim 128 where a work tile is short (512-1k keys: +2-7%,
// 8k within 1%), one warpgroup's first softmax and epilogue running under the other's products.
// hdim 96 (its shared-memory layout 128 columns wide, the products over 96): hdim 128's tiles, except
// that the plain kernel takes 3 consumers of 96-key steps (192-row tiles, one Q buffer: the ring and O
// buffer leave no room for a second; 112 keys spilled 40 bytes at 160 registers), against 2 consumers of
// 128 keys (H100, 16k tokens): 16k 620 vs 565 TFLOP/s (and 565 with 160-key steps), causal 16k 617 vs
// 508, 2k 613 vs 559, but 512 392 vs 438 (kShortRowsHdim96). hdim 192 (O 96 registers per thread):
// FlashAttention-3's 112 keys per step, K/V 2 x 2 x 112 x 192 x 2 bytes = 168 KB beside Q's 48 KB, so
// O is stored from registers as at 256; its narrow diagonal step 48 keys (an upper consumer of a 128-row causal tile sees at most 48
// columns of its first 112-key tile), ping-pong in that kernel only (causal 2k 591 vs 571 TFLOP/s,
// 512 +1%; the plain kernel's 16k within the rounds' spread, causal 16k 739 vs 755).
constexpr FwdTileSm90 fwd_tile_sm90(int head_dim_bucket, FwdVariantSm90 variant) {
  const bool mods = variant == FwdVariantSm90::score_mods;
  if (head_dim_bucket <= 64 && variant == FwdVariantSm90::plain) return {3, 128, 4, 160, 24, 2, true, FwdStore::tma};
  if (head_dim_bucket <= 64 && variant == FwdVariantSm90::short_band) return {2, 128, 4, 240, 24, 2, true, FwdStore::tma, true};
  if (head_dim_bucket == 96 && variant == FwdVariantSm90::plain) return {3, 96, 2, 160, 24, 1, true, FwdStore::tma};
  if (head_dim_bucket == 128 && variant == FwdVariantSm90::long_keys) return {2, 160, 2, 240, 24, 1, true, FwdStore::tma};
  const bool band = variant == FwdVariantSm90::short_band;
  if (head_dim_bucket <= 128) return {2, 128, 2, 240, 24, 2, !mods, FwdStore::tma, false, band ? 64 : 0};
  if (head_dim_bucket <= 192) return {2, 112, 2, 240, 24, 1, band, FwdStore::regs, false, band ? 48 : 0};
  // hdim 256 with modifiers: 64-row blocks of split O columns (head_split), two Q buffers (32 KB each).
  if (mods) return {2, 80, 2, 240, 24, 2, false, FwdStore::regs, false, 0, true};
  return {2, 80, 2, 240, 24, 1, false, FwdStore::regs, false, band ? 32 : 0};
}

// Every bucket's every variant fits the H100's 227 KB of shared memory per block and its setmaxnreg
// targets (checked here, where a tile is chosen, rather than by a failed launch).
constexpr bool fwd_tiles_fit_sm90() {
  for (int bucket : {64, 96, 128, 192, 256})
    for (FwdVariantSm90 v : {FwdVariantSm90::plain, FwdVariantSm90::score_mods, FwdVariantSm90::short_band,
                             FwdVariantSm90::long_keys}) {
      const FwdTileSm90 t = fwd_tile_sm90(bucket, v);
      if (t.smem_bytes(bucket) > kSmemPerBlockSm90 || !t.registers_fit()) return false;
    }
  return true;
}
static_assert(fwd_tiles_fit_sm90(), "an sm90 forward tile exceeds 227 KB of shared memory or its register budget");

// Query rows up to which causal-like masks take the short_band kernel. hdim 64: its 128-row tiles
// against the plain kernel's 192 rows (above). hdim 128: the narrow diagonal step pays up to 8k rows
// (H100, causal, five alternated rounds against 2048: 4k 623 -> 633 TFLOP/s, 8k 655 -> 671; 16k
// equal). hdim 256: 4k -0.7%, 8k +1.4%, so 2048. hdim 96: 2048, as at hdim 64 (the plain kernel's
// 192-row tiles); hdim 192 follows 256.
constexpr int short_band_rows(int head_dim_bucket) { return head_dim_bucket == 128 ? 8192 : 2048; }
// hdim 96 takes the short_band kernel (128-row tiles) without a mask too, up to this many query rows:
// the plain kernel's 192-row tiles pad 512 rows to 576 (H100: 438 vs 392 TFLOP/s at 512, 508 vs 500
// at 1k).
inline constexpr int kShortRowsHdim96 = 1024;

// hdim 128 without a window (no causal mask) over at least kLongKeys keys: 160 keys per step
// amortise the per-step costs (the O rescale, the row reductions, the ping-pong turns) over 1.25x the
// scores. The K/V ring (160 KB) leaves room for one Q buffer and the O buffer of the TMA store. H100,
// bf16, 16k tokens, against 128 keys in the same call: 645 / 676 / 647 / 658 TFLOP/s at 2k / 4k / 8k /
// 16k keys against 637 / 645 / 627 / 630 (+1-5%); FlashAttention-3's 176 keys fit only with O stored
// from registers (609 / 641 / 630 / 649), 144 keys with the TMA store 623 / 658 / 645 / 650. Below 2k
// keys a 160-key step wastes up to 25% on its last step (512: 640 computed), and the second Q buffer
// pays.
inline constexpr int kLongKeys = 2048;
constexpr bool fwd_long_keys(bool windowed, long long seqlen_k) { return !windowed && seqlen_k >= kLongKeys; }

// How the persistent grid meets a partial last round (block_range.cuh), by measurement (H100, bf16,
// 16k tokens, one build, alternated rounds; bench/NOTES.md):
// - hdim 64, the plain kernel: the split tail, +0.1-2.6% at 1k-16k keys (causal 4k 449 -> 459
//   TFLOP/s, 16k 500 -> 513; against a build without its code, causal 16k 495 -> 526); the
//   score-modifier kernel takes it too (tested, its speed with and without it not measured);
// - hdim 64, the short_band kernel (causal up to 2k rows): the balanced grid and none of the split
//   tail's code, which cost it 3% at causal 512 (232 -> 225 TFLOP/s, ~1070 more instructions in a
//   kernel whose tiles are 1-4 steps) and 1% at 1k, equal at 2k;
// - hdim 128 and 256: the split tail lost 1-19% (at hdim 256 also with the exchange turned off: the
//   extra piece boundaries, where each tile's Q load and pipeline fill are exposed, and the pieces'
//   spread over more heads' K/V, cost more than the idle half round). Up to kBalancedGridKeys keys,
//   the balanced grid instead (128 blocks of 16 full rounds for 132 of 15.5): +0.6-7% at 512-2k
//   (hdim 128 causal 512 287-298 -> 306-309 TFLOP/s in four runs), -0.5 to -3.6% at 4k.
constexpr bool fwd_split_tail(int head_dim_bucket, FwdVariantSm90 variant) {
  return head_dim_bucket <= 64 && variant != FwdVariantSm90::short_band;
}
inline constexpr int kBalancedGridKeys = 2048;

// The one choice among a head-dim bucket's variants (run_fwd_sm90 launches it; the workspace size
// query asks it too).
inline FwdVariantSm90 fwd_variant_sm90(const detail::FwdParams& p, int head_dim_bucket) {
  if (p.score_mods()) return FwdVariantSm90::score_mods;
  if (p.window_right >= 0 && p.seqlen_q <= short_band_rows(head_dim_bucket)) return FwdVariantSm90::short_band;
  if (head_dim_bucket == 96 && p.seqlen_q <= kShortRowsHdim96) return FwdVariantSm90::short_band;
  if (head_dim_bucket == 128 && fwd_long_keys(p.window_left >= 0 || p.window_right >= 0, p.seqlen_k))
    return FwdVariantSm90::long_keys;
  return FwdVariantSm90::plain;
}

// Workspace bytes of the split tail (kernel_fwd_sm90.cuh: FwdTailSm90) for a grid of `grid` blocks:
// per block and consumer, O (64, head_dim) and lse (128 · 2) fp32 and a flag, each region
// 256-byte aligned.
struct FwdTailLayoutSm90 {
  std::size_t o = 0, lse = 0, flag = 0, total = 0;  // byte offsets of the regions, and the size
};
constexpr FwdTailLayoutSm90 fwd_tail_layout_sm90(const FwdTileSm90& tile, int head_dim_bucket, int grid) {
  auto align = [](std::size_t n) { return (n + 255) / 256 * 256; };
  const std::size_t pieces = static_cast<std::size_t>(grid) * tile.consumers;
  FwdTailLayoutSm90 l;
  l.lse = align(pieces * 64 * head_dim_bucket * 4);
  l.flag = l.lse + align(pieces * 256 * 4);
  l.total = l.flag + align(pieces * 8);
  return l;
}

}  // namespace flashmonoid::cuda
