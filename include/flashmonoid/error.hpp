// Every invalid input is reported by throwing flashmonoid::Error, whose message names the
// argument and the rule it broke, e.g. "flashmonoid: k: dtype bf16 differs from q's fp16".
#pragma once

#include <stdexcept>
#include <string>

namespace flashmonoid {

class Error : public std::invalid_argument {
 public:
  Error(std::string argument, const std::string& rule)
      : std::invalid_argument("flashmonoid: " + argument + ": " + rule), argument_(std::move(argument)) {}
  // The name of the offending argument ("q", "cu_seqlens_k", "options.window_left", ...).
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

// Raised when the inputs are valid but no backend supports the combination
// (for example head dim 59 on the CUDA backend, or a GPU older than compute capability 8.0).
class NotSupported : public Error {
 public:
  using Error::Error;
};

// A CUDA runtime failure (out of memory, launch failure) with the call that failed.
class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace flashmonoid
