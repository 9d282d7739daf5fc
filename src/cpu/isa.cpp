#include "cpu/isa.hpp"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "flashmonoid/error.hpp"

namespace flashmonoid::cpu {
namespace {

bool detect_avx512() {
  unsigned a, b, c, d;
  if (__get_cpuid_count(1, 0, &a, &b, &c, &d) == 0 || (c & bit_OSXSAVE) == 0) return false;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool features = (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL) && (b & bit_AVX512DQ);
  if (!features) return false;
  // XCR0 bits 1, 2 (SSE, AVX state), 5, 6, 7 (opmask, upper halves of zmm0-15, zmm16-31): the OS
  // must save all of them or zmm code corrupts other threads' registers.
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xE6u) == 0xE6u;
}

// AVX512_BF16: cpuid leaf 7, subleaf 1, EAX bit 5 (subleaf 1 exists where leaf 7 subleaf 0 reports
// a maximum subleaf of at least 1 in EAX).
bool detect_avx512_bf16() {
  unsigned a, b, c, d;
  if (!detect_avx512() || __get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || a < 1) return false;
  __cpuid_count(7, 1, a, b, c, d);
  return (a & (1u << 5)) != 0;
}

// AMX-TILE and AMX-BF16: cpuid leaf 7, subleaf 0, EDX bits 24 and 22; XCR0 bits 17 and 18 (tile
// configuration and data saved by the OS); and, on Linux, the process's permission to use the tile
// data (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; without it the first tile load faults).
bool detect_amx_bf16() {
  unsigned a, b, c, d;
  if (!detect_avx512_bf16() || __get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  if ((d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return false;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;
#ifdef SYS_arch_prctl
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

Isa detect_best() {
  if (detect_amx_bf16()) return Isa::amx_bf16;
  if (detect_avx512_bf16()) return Isa::avx512_bf16;
  return detect_avx512() ? Isa::avx512 : Isa::avx2;
}

bool detect_amd() {
  unsigned a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
  return b == 0x68747541u && d == 0x69746E65u && c == 0x444D4163u;  // "Auth" "enti" "cAMD"
}

Isa read_default() {
  const Isa best = detect_best();
  const char* env = std::getenv("FLASHMONOID_CPU_ISA");
  const std::string want = env ? env : "";
  if (want == "amx_bf16") return best;
  if (want == "avx512_bf16") return std::min(best, Isa::avx512_bf16);
  if (want.empty() || want == "best")
    return best == Isa::amx_bf16 || bf16_products_by_default() ? best : std::min(best, Isa::avx512);
  if (want == "avx512") return std::min(best, Isa::avx512);
  if (want == "avx2") return Isa::avx2;
  throw Error("FLASHMONOID_CPU_ISA", "'" + want + "' is not one of avx2, avx512, avx512_bf16, amx_bf16, best");
}

}  // namespace

std::int64_t cache_bytes(int level, std::int64_t fallback) {
  static const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // <= 0: unknown
  const long n = level == 1 ? l1 : l2;
  return n > 0 ? std::int64_t{n} : fallback;
}

// The bf16-pair products measured, 2 threads, bf16 forward, against torch's bf16 CPU SDPA: on an AMD
// EPYC (Zen 4) 1.66-2.09x against the fp32 products' 1.10-1.25x; on Intel Xeons 0.55-0.85x the fp32
// products (16 threads) and 0.94-1.03x against their 1.55-1.76x (2 threads) (bench/NOTES.md, issue 13).
// So they run by default on AMD CPUs and stay opt-in on Intel ones.
bool bf16_products_by_default() {
  static const bool amd = detect_amd();
  return amd;
}

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::amx_bf16: return "amx_bf16";
    default: return "avx2";
  }
}

bool cpu_has(Isa isa) {
  static const Isa best = detect_best();
  return isa <= best;
}

Isa default_isa() {
  static const Isa isa = read_default();
  return isa;
}

Isa isa_for(CpuIsa requested) { return requested == CpuIsa::avx2 ? Isa::avx2 : default_isa(); }

}  // namespace flashmonoid::cpu
