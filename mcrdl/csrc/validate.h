// Local argument validation shared by every backend (API.md "Errors": always on, before
// anything is sent). Each op has one validate_<op> function; the MPI backend calls it
// from C++, other backends call it through the mcrdl._C binding.
#pragma once

#include "common.h"

#include <optional>

namespace mcrdl {

// An argument given either as one tensor holding `size` blocks along dim 0 or as a
// list of `size` tensors shaped like the per-rank tensor (API.md "Shapes").
struct BlockArg {
  bool is_list = false;
  // The tensor, when one was given: borrowed from the caller's argument, which outlives
  // the call (copying a tensor Python holds increfs its PyObject, and dropping the copy
  // decrefs it under the GIL: tens of ns on the hot path). Read it with tensor().
  const at::Tensor* borrowed = nullptr;
  std::vector<at::Tensor> list;
  bool present() const { return is_list || (borrowed && borrowed->defined()); }
  const at::Tensor& tensor() const { return *borrowed; }
};

using Counts = std::vector<int64_t>;

// The checks every call makes: inline conditions (a small call's path stays in its
// caller's code lines), each with an out-of-line, cold function that builds the message
// and throws.
[[noreturn, gnu::cold]] void check_tensor_failed(const char* op, const char* arg,
                                                 const at::Tensor& t);
[[noreturn, gnu::cold]] void check_reduce_op_failed(const char* op, int64_t code,
                                                    at::ScalarType dtype);
[[noreturn, gnu::cold]] void check_rank_failed(const char* op, const char* arg, int64_t rank,
                                               int size);

inline void check_tensor(const char* op, const char* arg, const at::Tensor& t) {
  if (C10_UNLIKELY(!t.defined() || !is_supported_dtype(t.scalar_type()) ||
                   t.layout() != at::kStrided || !t.is_contiguous()))
    check_tensor_failed(op, arg, t);
}

inline void check_reduce_op(const char* op, int code, at::ScalarType dtype) {
  const bool ok = code >= SUM && code <= BXOR &&
                  (code == AVG ? is_floating(dtype)
                   : code >= BAND ? !is_floating(dtype) : true);
  if (C10_UNLIKELY(!ok)) check_reduce_op_failed(op, code, dtype);
}

inline void check_rank(const char* op, const char* arg, int64_t rank, int size) {
  if (C10_UNLIKELY(rank < 0 || rank >= size)) check_rank_failed(op, arg, rank, size);
}

inline void validate_all_reduce(const at::Tensor& t, int rop) {
  check_tensor("all_reduce", "tensor", t);
  check_reduce_op("all_reduce", rop, t.scalar_type());
}
void validate_reduce(const at::Tensor& t, int64_t dst, int rop, int size);
inline void validate_bcast(const at::Tensor& t, int64_t src, int size) {
  check_tensor("bcast", "tensor", t);
  check_rank("bcast", "src", src, size);
}
void validate_all_gather(const BlockArg& out, const at::Tensor& in, int size);
[[noreturn, gnu::cold]] void validate_all_gather_failed(const at::Tensor& out,
                                                       const at::Tensor& in, int size);
// An output given as one tensor: the same checks, inline (a small call's path); the
// message of a failure is the BlockArg form's, made out of line.
inline void validate_all_gather(const at::Tensor& out, const at::Tensor& in, int size) {
  check_tensor("all_gather", "input", in);
  if (C10_LIKELY(out.defined())) {
    check_tensor("all_gather", "output", out);
    if (C10_LIKELY(out.scalar_type() == in.scalar_type() && out.device() == in.device() &&
                   out.numel() == in.numel() * size))
      return;
  }
  validate_all_gather_failed(out, in, size);
}
void validate_gather(const BlockArg& out, const at::Tensor& in, int64_t dst, int rank, int size);
void validate_scatter(const at::Tensor& out, const BlockArg& in, int64_t src, int rank, int size);
void validate_reduce_scatter(const at::Tensor& out, const BlockArg& in, int rop, int size);
[[noreturn, gnu::cold]] void validate_reduce_scatter_failed(const at::Tensor& out,
                                                           const at::Tensor& in, int rop,
                                                           int size);
// An input given as one tensor: as validate_all_gather's tensor form above.
inline void validate_reduce_scatter(const at::Tensor& out, const at::Tensor& in, int rop,
                                    int size) {
  check_tensor("reduce_scatter", "output", out);
  check_reduce_op("reduce_scatter", rop, out.scalar_type());
  if (C10_LIKELY(in.defined())) {
    check_tensor("reduce_scatter", "input", in);
    if (C10_LIKELY(in.scalar_type() == out.scalar_type() && in.device() == out.device() &&
                   in.numel() == out.numel() * size))
      return;
  }
  validate_reduce_scatter_failed(out, in, rop, size);
}
// Returns the (input, output) split sizes in rows, filled in when not given.
std::pair<Counts, Counts> validate_all_to_all_single(const at::Tensor& out, const at::Tensor& in,
                                                     const std::optional<Counts>& out_splits,
                                                     const std::optional<Counts>& in_splits,
                                                     int rank, int size);
void validate_all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                         int rank, int size);
// The v variants return the displacements, filled in (packed) when not given.
Counts validate_gatherv(const at::Tensor* out, const at::Tensor& in, const Counts& counts,
                        const std::optional<Counts>& displs, int64_t dst, int rank, int size);
Counts validate_scatterv(const at::Tensor& out, const at::Tensor* in, const Counts& counts,
                         const std::optional<Counts>& displs, int64_t src, int rank, int size);
Counts validate_all_gatherv(const at::Tensor& out, const at::Tensor& in, const Counts& counts,
                            const std::optional<Counts>& displs, int rank, int size);
std::pair<Counts, Counts> validate_all_to_allv(const at::Tensor& out, const at::Tensor& in,
                                               const Counts& send_counts, const Counts& recv_counts,
                                               const std::optional<Counts>& send_displs,
                                               const std::optional<Counts>& recv_displs, int rank,
                                               int size);
void validate_p2p(const char* op, const at::Tensor& t, int64_t peer, int64_t tag, int rank,
                  int size);

}  // namespace mcrdl
