// Which instruction set the CPU flash path runs: the one place that decides. cpuid (and the OS's
// xgetbv state) is read once per process, the FLASHMONOID_CPU_ISA environment variable once, and a
// call's Context::cpu_isa can only lower the choice.
#pragma once

#include <cstdint>

#include "flashmonoid/options.hpp"

namespace flashmonoid::cpu {

// Ordered: each needs what the ones before it need.
// avx2: AVX2 + FMA + F16C (x86-64-v3), the baseline the library is built for.
// avx512: AVX-512 F, BW, VL and DQ with the OS saving zmm state.
// avx512_bf16: avx512 plus AVX512_BF16 (VDPBF16PS): bf16 inputs' block products from bf16 pairs.
// amx_bf16: avx512_bf16 plus AMX-TILE and AMX-BF16 (TDPBF16PS), the OS saving the tile state and
//   granting it to this process (Linux: arch_prctl ARCH_REQ_XCOMP_PERM): the same products on tiles.
enum class Isa : std::uint8_t { avx2, avx512, avx512_bf16, amx_bf16 };

const char* to_string(Isa isa);

// Whether this CPU can run isa (cpuid once).
bool cpu_has(Isa isa);

// Whether the default includes avx512_bf16 where the CPU has it: on AMD CPUs, where the bf16-pair
// products measured faster than the fp32 products, not on Intel ones, where they measured slower
// (isa.cpp has the numbers).
bool bf16_products_by_default();

// The ISA calls run by default: the best this CPU has (amx_bf16 where it has AMX), short of
// avx512_bf16 on a CPU without AMX unless bf16_products_by_default(); or as FLASHMONOID_CPU_ISA says:
// avx2 forces the fallback, avx512 the AVX-512 kernels without bf16 products (where the CPU has
// AVX-512), avx512_bf16 the VDPBF16PS products (where the CPU has them), amx_bf16 the AMX ones (where
// the CPU has them), best the default. Any other value throws flashmonoid::Error on first use.
Isa default_isa();

// The ISA a call with this Context::cpu_isa runs.
Isa isa_for(CpuIsa requested);

// This CPU's data cache of level 1 or 2, per core, in bytes (as the OS reports it, read once per
// level), or `fallback` where the OS does not say: the CPU loops' blockings that depend on it.
std::int64_t cache_bytes(int level, std::int64_t fallback);

}  // namespace flashmonoid::cpu
