// Shared definitions of the mcrdl C++ core: error kinds, reduce-op codes, dtype helpers.
#pragma once

#include <ATen/core/Tensor.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace mcrdl {

// Mirrors the Python classes of mcrdl.errors; translated at the module boundary.
enum class ErrorKind { InvalidArgument, Unsupported, Timeout, BackendUnavailable, Runtime };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] inline void throw_invalid(const std::string& msg) {
  throw Error(ErrorKind::InvalidArgument, msg);
}

// Values of mcrdl.ReduceOp (mcrdl/ops.py); keep in sync.
enum ReduceCode : int { SUM = 0, PRODUCT = 1, MIN = 2, MAX = 3, AVG = 4, BAND = 5, BOR = 6, BXOR = 7 };

const char* reduce_name(int code);
std::string dtype_name(at::ScalarType t);
std::string shape_str(const at::Tensor& t);
// Inline: they run on every call, and a call into another function is another cache line
// of code that a large call's data has evicted since the last call.
inline bool is_floating(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}
inline bool is_supported_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: case at::kBFloat16: case at::kFloat: case at::kDouble: case at::kChar:
    case at::kByte: case at::kInt: case at::kLong: case at::kBool:
      return true;
    default:
      return false;
  }
}

}  // namespace mcrdl
