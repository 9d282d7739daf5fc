// TMA tensor maps (CUtensorMap) of the (b, s, h, d) attention tensors: built on the host per call,
// passed to the kernels as __grid_constant__ parameters. The driver's encoder is reached through
// the runtime's entry-point query, so the library does not link libcuda.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "api/params.hpp"

namespace flashmonoid::cuda::sm90 {

// A 2-byte-element tensor viewed as 4-d (d, heads, rows, batch), innermost first, with element
// strides st, read in boxes of (64, 1, box_rows, 1) into 128-byte-swizzled panels. Elements outside
// the tensor (head-dim padding, rows past the end) arrive as zeros. Varlen tensors are one batch entry
// of `rows` packed rows.
CUtensorMap make_tensor_map(const void* base, int d, int heads, std::int64_t rows, int batch,
                            const detail::Strides& st, int box_rows);

// The sm90 backward's per-row fp32 terms: lse (heads, rows) at `lse` and D (heads, rows)
// `dsum_offset` floats after it, as a 3-d (rows, heads, 2) tensor read in boxes of (box_rows, 1, 2):
// one load brings a query block's lse and then its D.
CUtensorMap make_row_terms_map(const float* lse, std::size_t dsum_offset, int heads, std::int64_t rows, int box_rows);

}  // namespace flashmonoid::cuda::sm90
