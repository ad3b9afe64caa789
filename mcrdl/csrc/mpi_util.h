// MPI helpers shared by the "mpi" and "pccl" backends: large-count types, error checks,
// communicator handles from mpi4py, and the MPI datatype of each tensor dtype.
#pragma once

#include <mpi.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace mcrdl {

#if MPI_VERSION >= 4
using mcount = MPI_Count;
using mdisp = MPI_Aint;
#define MPIC(fn) fn##_c
#else
using mcount = int;
using mdisp = int;
#define MPIC(fn) fn
#endif

inline mcount to_mcount(int64_t n, const char* op) {
  if (sizeof(mcount) < sizeof(int64_t) && n > INT_MAX)
    throw Error(ErrorKind::Unsupported,
                std::string(op) + ": " + std::to_string(n) +
                    " elements exceed this MPI's int counts (MPI < 4.0 has no large-count calls)");
  return static_cast<mcount>(n);
}

// MIN and MAX of floating types (MPI_FLOAT, MPI_DOUBLE; halves are reduced in float32)
// as user-defined commutative ops. MPI's built-in ones compare with <, so over a NaN, or
// -0 and +0, the result depends on the operand order, and the ranks of one collective
// combine in different orders: an all_reduce(MIN) with a NaN on rank 0 ended as 2.0 on
// one rank and NaN on the other. These give the same whatever the order: a quiet NaN if
// any operand is NaN (as torch.minimum), else the extreme, -0 below +0.
template <typename T, bool kMax>
inline T ordered_minmax(T a, T b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<T>::quiet_NaN();
  if (a == b) return std::signbit(a) != kMax ? a : b;
  return (a < b) != kMax ? a : b;
}

template <bool kMax, typename Len>
void minmax_fn(void* in, void* inout, Len* len, MPI_Datatype* dt) {
  auto run = [&](auto* a, const auto* b) {
    using T = std::remove_pointer_t<decltype(a)>;
    for (Len i = 0; i < *len; ++i) a[i] = ordered_minmax<T, kMax>(b[i], a[i]);
  };
  if (*dt == MPI_DOUBLE)
    run(static_cast<double*>(inout), static_cast<const double*>(in));
  else
    run(static_cast<float*>(inout), static_cast<const float*>(in));
}

template <bool kMax>
MPI_Op make_minmax_op() {
  MPI_Op op = MPI_OP_NULL;
#if MPI_VERSION >= 4
  MPI_Op_create_c(&minmax_fn<kMax, MPI_Count>, 1, &op);
#else
  MPI_Op_create(&minmax_fn<kMax, int>, 1, &op);
#endif
  return op;
}

// MPI's op for MIN (`max` false) or MAX over `type`: the ordered ones above for MPI_FLOAT
// and MPI_DOUBLE, MPI's own for integers. Made on first use (MPI is initialized by then).
inline MPI_Op minmax_op(bool max, MPI_Datatype type) {
  if (type != MPI_FLOAT && type != MPI_DOUBLE) return max ? MPI_MAX : MPI_MIN;
  static const MPI_Op ops[2] = {make_minmax_op<false>(), make_minmax_op<true>()};
  return ops[max];
}

inline void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  std::string msg = std::string(what) + " failed: " + std::string(buf, len);
  // A request's own error (the mpi backend's hot path passes MPI_STATUSES_IGNORE; pccl
  // keeps the statuses and passes request_error's code) or a truncated message: outside
  // debug mode nothing compared the ranks' calls, and this is how MPI reports that they
  // differ.
  int cls = MPI_ERR_OTHER;
  MPI_Error_class(rc, &cls);
  if (cls == MPI_ERR_IN_STATUS || cls == MPI_ERR_TRUNCATE)
    msg += ". The likeliest cause: the ranks' calls differ (a collective's counts, sizes, "
           "dtypes or roots, or a rank skipped a call: MCRDL_DEBUG=1 compares every rank's "
           "collectives; for send/recv, a receive smaller than its send)";
  throw Error(ErrorKind::Runtime, msg);
}

// The error of MPI_Testall's `rc`: MPI_ERR_IN_STATUS names no cause, the first failed
// request's status does (MPI_ERR_TRUNCATE, ...). For paths that keep the statuses.
inline int request_error(int rc, const std::vector<MPI_Status>& statuses) {
  int cls = MPI_ERR_OTHER;
  if (rc == MPI_SUCCESS || MPI_Error_class(rc, &cls) != MPI_SUCCESS || cls != MPI_ERR_IN_STATUS)
    return rc;
  for (const MPI_Status& st : statuses)
    if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) return st.MPI_ERROR;
  return rc;
}

// mpi4py's Comm.handle: an int for MPICH-ABI libraries, a pointer value for Open MPI.
template <typename C>
C comm_from_handle(uint64_t h) {
  if constexpr (std::is_pointer_v<C>)
    return reinterpret_cast<C>(static_cast<uintptr_t>(h));
  else
    return static_cast<C>(static_cast<int64_t>(h));  // keeps the low bits of the int handle
}

// How a blocking call runs, by size: (largest bytes, variant) steps in increasing size;
// sizes past the last step run nonblocking. Shared by the "mpi" backend's ops and pccl's
// "mpi" algorithm. The variants (mcrdl.tuning.schema.VARIANTS, by these codes):
enum Variant : int {
  kVarNonblocking = 0,  // post the nonblocking collective, wait on it (bounded)
  kVarBlocking = 1,     // the blocking MPI collective, under the watchdog
  // all_gather / reduce_scatter only: the blocking MPI_Allreduce of the whole buffer (a
  // bitwise OR of the zero-padded output / the reduction of the input), of which each
  // rank keeps its part. MPICH's shared-memory allreduce of a few hundred bytes takes half
  // the time of its allgather or reduce_scatter_block there (docs/performance.md).
  kVarAllReduce = 2,
  kVariants
};
using BlockingSteps = std::vector<std::pair<int64_t, int>>;

// `steps` as given from Python (-1 bytes: no limit), checked to grow in size and to name
// variants below `variants` (kVarAllReduce + 1 for the ops that have that one).
inline BlockingSteps checked_blocking_steps(const std::string& op, const BlockingSteps& steps,
                                            int variants = kVarBlocking + 1) {
  BlockingSteps v;
  int64_t last = -2;
  for (auto [hi, var] : steps) {
    if (hi < 0) hi = INT64_MAX;
    if (hi <= last) throw_invalid("set_blocking: the steps of " + op + " must grow in size");
    if (var < 0 || var >= variants)
      throw_invalid("set_blocking: " + op + " has no variant " + std::to_string(var));
    v.emplace_back(hi, var);
    last = hi;
  }
  return v;
}

inline int variant_at(const BlockingSteps& steps, int64_t nbytes) {
  for (const auto& [hi, var] : steps)
    if (nbytes <= hi) return var;
  return kVarNonblocking;
}

[[noreturn, gnu::cold, gnu::noinline]] inline void unsupported_move_type(at::ScalarType t) {
  throw_invalid("unsupported dtype " + dtype_name(t));
}

// Inline, its error out of line: a call's path stays in its caller's code.
C10_ALWAYS_INLINE MPI_Datatype move_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: case at::kBool: return MPI_UINT8_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kHalf: case at::kBFloat16: return MPI_UINT16_T;
    default: unsupported_move_type(t);
  }
}

}  // namespace mcrdl
