// The rule helpers of the validation layer, shared by validate.cpp and validate_kvcache.cpp: each
// throws Error naming the argument and the rule it broke.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "api/params.hpp"
#include "flashmonoid/options.hpp"
#include "flashmonoid/tensor.hpp"

namespace flashmonoid::detail {

std::string shape_str(const TensorView& t);
[[noreturn]] void fail(const std::string& arg, const std::string& rule);
bool is_float(DType t);
// ndim, non-negative strides, contiguous last dim, a data pointer whenever it has elements (unless
// need_data is false: the size and support queries validate shapes only).
void check_view(const TensorView& t, const std::string& name, int ndim, bool need_data = true);
void check_shape(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> dims,
                 const std::string& why);
void check_same_device(const TensorView& t, const std::string& name, Device dev);
void check_dtype(const TensorView& t, const std::string& name, DType want, const std::string& other);
// written must not share a byte with other.
void check_no_alias(const TensorView& written, const std::string& wname, const TensorView& other,
                    const std::string& oname);
void check_int_range(std::int64_t v, const std::string& name);
void fill_strides(Strides& s, const TensorView& t, bool varlen);

}  // namespace flashmonoid::detail
