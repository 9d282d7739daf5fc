// The CPU backend: the float64 reference (the oracle) and the tiled flash path.
#pragma once

#include "api/kvcache_params.hpp"
#include "api/params.hpp"
#include "cpu/kernels.hpp"

namespace flashmonoid::cpu {

// Precision of the reference. f64: every operation in double (the oracle). input: the same math
// with the products' inputs, S, P and O rounded to the input dtype (fp32 accumulation), i.e.
// "standard attention done in the input dtype", whose error sets the FlashAttention tolerance.
// f64_given_out (backward; the forward takes it as f64): float64, with D = rowsum(dO∘O) of the
// given output as FlashAttention's backward defines it instead of Σ P∘dP, i.e. the exact value of
// the backward on the inputs a kernel receives, O's storage rounding included.
enum class Precision { f64, f64_given_out, input };

void reference_forward(const detail::FwdParams& p, Precision prec = Precision::f64);
void reference_backward(const detail::BwdParams& p, Precision prec = Precision::f64);

// Tiled online-softmax forward/backward (src/cpu/flash_fwd.cpp, flash_bwd.cpp).
// num_threads <= 0 uses the OpenMP default; kn: the kernels of the ISA to run (kernels_for()).
// flash_forward runs flash_forward_decode where decode_path(p) (every sequence's s_q·group <= 32:
// the cache read a chunk of keys at a time, never packed whole), else flash_forward_tiled; tests
// and benchmarks call either directly (flash_forward_decode throws past decode_path).
void flash_forward(const detail::FwdParams& p, int num_threads, const Kernels& kn);
void flash_forward_tiled(const detail::FwdParams& p, int num_threads, const Kernels& kn);
void flash_forward_decode(const detail::FwdParams& p, int num_threads, const Kernels& kn);
bool decode_path(const detail::FwdParams& p);
// Whether flash_forward_decode, run by `threads` threads, walks p's 2-byte K/V as streams: more
// bytes than 32 MiB and than the threads' L2s together (flash_fwd.cpp, walk_heads_outer).
bool decode_streams(const detail::FwdParams& p, int threads);
void flash_backward(const detail::BwdParams& p, int num_threads, const Kernels& kn);

void merge(const detail::MergeParams& p);

// forward_kvcache (src/cpu/kvcache.cpp): the append and rotary, then reference or flash forward.
void forward_kvcache(const detail::KvCacheCall& c, bool reference, int num_threads, const Kernels& kn);

}  // namespace flashmonoid::cpu
