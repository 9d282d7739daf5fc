#include "sm90/tensor_map.hpp"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>

#include "common/check.cuh"
#include "flashmonoid/error.hpp"

namespace flashmonoid::cuda::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    FM_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || f == nullptr)
      throw DeviceError("flashmonoid: the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver 12.0+)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

CUtensorMap make_tensor_map(const void* base, int d, int heads, std::int64_t rows, int batch,
                            const detail::Strides& st, int box_rows) {
  constexpr std::uint64_t kElem = 2;
  // A dimension of extent 1 never steps; TMA still wants its stride a positive multiple of 16 bytes.
  auto stride = [](std::int64_t s, std::int64_t extent) -> cuuint64_t {
    return extent > 1 ? static_cast<cuuint64_t>(s) * kElem : 16;
  };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {stride(st.head, heads), stride(st.row, rows), stride(st.batch, batch)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  // The copy engine moves bytes: one 2-byte type serves fp16 and bf16 alike (zero fill is 0x0000).
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims, strides, box,
                               elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw DeviceError("flashmonoid: cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(r)) +
                      ") for a tensor of " + std::to_string(rows) + " rows; strides must be multiples of 8 elements");
  return map;
}

CUtensorMap make_row_terms_map(const float* lse, std::size_t dsum_offset, int heads, std::int64_t rows, int box_rows) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(heads), 2};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(rows) * sizeof(float), static_cast<cuuint64_t>(dsum_offset * sizeof(float))};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_rows), 1, 2};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(lse), dims, strides, box, elem_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw DeviceError("flashmonoid: cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(r)) +
                      ") for the backward's row terms (" + std::to_string(rows) + " rows)");
  return map;
}

}  // namespace flashmonoid::cuda::sm90
