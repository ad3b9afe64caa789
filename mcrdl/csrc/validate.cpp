#include "validate.h"

#include <algorithm>
#include <limits>
#include <sstream>

namespace mcrdl {

const char* reduce_name(int code) {
  switch (code) {
    case SUM: return "SUM";
    case PRODUCT: return "PRODUCT";
    case MIN: return "MIN";
    case MAX: return "MAX";
    case AVG: return "AVG";
    case BAND: return "BAND";
    case BOR: return "BOR";
    case BXOR: return "BXOR";
    default: return "?";
  }
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kShort: return "torch.int16";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    case at::kUInt16: return "torch.uint16";
    case at::kUInt32: return "torch.uint32";
    case at::kUInt64: return "torch.uint64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int64_t i = 0; i < t.dim(); ++i) s << (i ? ", " : "") << t.size(i);
  s << "]";
  return s.str();
}

namespace {

constexpr const char* kDtypes =
    "float16, bfloat16, float32, float64, int8, uint8, int32, int64 or bool";

std::string counts_str(const Counts& c) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < c.size(); ++i) s << (i ? ", " : "") << c[i];
  s << "]";
  return s.str();
}

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw_invalid(std::string(op) + ": " + what);
}

void check_same_dtype(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                      const at::Tensor& ref) {
  if (t.scalar_type() != ref.scalar_type())
    fail(op, std::string("'") + arg + "' has dtype " + dtype_name(t.scalar_type()) +
                 " but '" + ref_arg + "' has dtype " + dtype_name(ref.scalar_type()) +
                 "; both must have the same dtype");
  if (t.device() != ref.device())
    fail(op, std::string("'") + arg + "' is on " + t.device().str() + " but '" + ref_arg +
                 "' is on " + ref.device().str() + "; both must be on the same device");
}

// `arg` must hold `size` blocks shaped like `ref` (one tensor or a list).
void check_blocks(const char* op, const char* arg, const BlockArg& b, const at::Tensor& ref,
                  const char* ref_arg, int size) {
  if (b.is_list) {
    if ((int)b.list.size() != size)
      fail(op, std::string("'") + arg + "' is a list of " + std::to_string(b.list.size()) +
                   " tensors; expected one tensor per rank of the group (" +
                   std::to_string(size) + ")");
    for (size_t i = 0; i < b.list.size(); ++i) {
      std::string name = std::string(arg) + "[" + std::to_string(i) + "]";
      check_tensor(op, name.c_str(), b.list[i]);
      check_same_dtype(op, name.c_str(), b.list[i], ref_arg, ref);
      // the shape, not only the size: a block of another shape would be filled as a
      // reshaped copy (torch's backends refuse it too)
      if (!b.list[i].sizes().equals(ref.sizes()))
        fail(op, "'" + name + "' has shape " + shape_str(b.list[i]) + " (" +
                     std::to_string(b.list[i].numel()) + " elements); expected the shape of '" +
                     ref_arg + "', " + shape_str(ref) + " (" + std::to_string(ref.numel()) +
                     " elements)");
    }
    return;
  }
  check_tensor(op, arg, b.tensor());
  check_same_dtype(op, arg, b.tensor(), ref_arg, ref);
  if (b.tensor().numel() != ref.numel() * size)
    fail(op, std::string("'") + arg + "' has " + std::to_string(b.tensor().numel()) +
                 " elements (shape " + shape_str(b.tensor()) + "); expected group size (" +
                 std::to_string(size) + ") x " + std::to_string(ref.numel()) + " = " +
                 std::to_string(ref.numel() * size) + " elements: one block of '" + ref_arg +
                 "' (shape " + shape_str(ref) + ") per rank, concatenated along dim 0");
}

Counts check_counts(const char* op, const char* counts_arg, const Counts& counts,
                    const char* displs_arg, const std::optional<Counts>& displs, int size,
                    const char* buf_arg, int64_t buf_numel, bool receiving) {
  if ((int)counts.size() != size)
    fail(op, std::string("'") + counts_arg + "' has " + std::to_string(counts.size()) +
                 " entries " + counts_str(counts) + "; expected one per rank of the group (" +
                 std::to_string(size) + ")");
  for (int i = 0; i < size; ++i)
    if (counts[i] < 0)
      fail(op, std::string("'") + counts_arg + "'[" + std::to_string(i) + "] is " +
                   std::to_string(counts[i]) + "; counts must be >= 0");
  Counts d(size);
  if (displs) {
    if ((int)displs->size() != size)
      fail(op, std::string("'") + displs_arg + "' has " + std::to_string(displs->size()) +
                   " entries " + counts_str(*displs) + "; expected one per rank (" +
                   std::to_string(size) + ") or None for packed blocks");
    d = *displs;
  } else {
    int64_t off = 0;
    for (int i = 0; i < size; ++i) {
      d[i] = off;
      off += counts[i];
    }
  }
  for (int i = 0; i < size; ++i) {
    if (d[i] < 0)
      fail(op, std::string("'") + displs_arg + "'[" + std::to_string(i) + "] is " +
                   std::to_string(d[i]) + "; displacements must be >= 0");
    if (d[i] > buf_numel || counts[i] > buf_numel - d[i])  // no overflow of d + count
      fail(op, std::string("block ") + std::to_string(i) + " of '" + buf_arg +
                   "' (displacement " + std::to_string(d[i]) + " + count " +
                   std::to_string(counts[i]) + " elements) ends past its " +
                   std::to_string(buf_numel) + " elements; enlarge '" + buf_arg +
                   "' or fix '" + counts_arg + "'/'" + displs_arg + "'");
  }
  if (receiving && displs) {
    std::vector<std::pair<int64_t, int>> iv;
    for (int i = 0; i < size; ++i)
      if (counts[i] > 0) iv.emplace_back(d[i], i);
    std::sort(iv.begin(), iv.end());
    for (size_t k = 1; k < iv.size(); ++k) {
      int a = iv[k - 1].second, b = iv[k].second;
      if (d[a] + counts[a] > d[b])
        fail(op, std::string("receive blocks ") + std::to_string(a) + " and " +
                     std::to_string(b) + " of '" + buf_arg + "' overlap (" + displs_arg +
                     " " + counts_str(d) + ", " + counts_arg + " " + counts_str(counts) +
                     "); received blocks must not overlap");
    }
  }
  return d;
}

}  // namespace

void check_tensor_failed(const char* op, const char* arg, const at::Tensor& t) {
  if (!t.defined()) fail(op, std::string("'") + arg + "' is undefined; expected a tensor");
  if (!is_supported_dtype(t.scalar_type()))
    fail(op, std::string("'") + arg + "' has dtype " + dtype_name(t.scalar_type()) +
                 "; supported dtypes are " + kDtypes);
  if (t.layout() != at::kStrided)
    fail(op, std::string("'") + arg + "' has a non-strided (e.g. sparse) layout; expected a "
                 "dense tensor (call .to_dense())");
  if (!t.is_contiguous())
    fail(op, std::string("'") + arg + "' is not contiguous (shape " + shape_str(t) +
                 "); pass tensor.contiguous() and copy the result back if needed");
  fail(op, std::string("'") + arg + "' failed the inline tensor check only (a bug of mcrdl)");
}

void check_reduce_op_failed(const char* op, int64_t code, at::ScalarType dtype) {
  if (code < SUM || code > BXOR)
    fail(op, "'op' has unknown value " + std::to_string(code) +
                 "; expected a mcrdl.ReduceOp (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR)");
  if (code == AVG && !is_floating(dtype))
    fail(op, "ReduceOp.AVG needs a floating tensor but got " + dtype_name(dtype) +
                 "; use SUM and divide, or convert the tensor to a floating type");
  if ((code == BAND || code == BOR || code == BXOR) && is_floating(dtype))
    fail(op, std::string("ReduceOp.") + reduce_name(static_cast<int>(code)) +
                 " applies to integer and bool tensors only, but got " + dtype_name(dtype));
  fail(op, "'op' failed the inline reduce-op check only (a bug of mcrdl)");
}

void check_rank_failed(const char* op, const char* arg, int64_t rank, int size) {
  fail(op, std::string("'") + arg + "' is " + std::to_string(rank) +
                 "; expected a rank of the group in [0, " + std::to_string(size - 1) +
                 "] (ranks are group-local)");
}

void validate_reduce(const at::Tensor& t, int64_t dst, int rop, int size) {
  check_tensor("reduce", "tensor", t);
  check_reduce_op("reduce", rop, t.scalar_type());
  check_rank("reduce", "dst", dst, size);
}

void validate_all_gather(const BlockArg& out, const at::Tensor& in, int size) {
  check_tensor("all_gather", "input", in);
  if (!out.present()) fail("all_gather", "'output' is None; expected a tensor or a list");
  check_blocks("all_gather", "output", out, in, "input", size);
}

void validate_all_gather_failed(const at::Tensor& out, const at::Tensor& in, int size) {
  BlockArg b;
  b.borrowed = &out;
  validate_all_gather(b, in, size);  // the same checks, one of which throws
  fail("all_gather", "internal error: an inline check failed where the full ones passed");
}

void validate_gather(const BlockArg& out, const at::Tensor& in, int64_t dst, int rank, int size) {
  check_tensor("gather", "input", in);
  check_rank("gather", "dst", dst, size);
  if (rank == dst) {
    if (!out.present())
      fail("gather", "'output' is None on the destination rank " + std::to_string(dst) +
                         "; the destination needs a tensor or a list of tensors");
    check_blocks("gather", "output", out, in, "input", size);
  } else if (out.present()) {
    check_blocks("gather", "output", out, in, "input", size);
  }
}

void validate_scatter(const at::Tensor& out, const BlockArg& in, int64_t src, int rank, int size) {
  check_tensor("scatter", "output", out);
  check_rank("scatter", "src", src, size);
  if (rank == src) {
    if (!in.present())
      fail("scatter", "'input' is None on the source rank " + std::to_string(src) +
                          "; the source needs a tensor or a list of tensors");
    check_blocks("scatter", "input", in, out, "output", size);
  } else if (in.present()) {
    check_blocks("scatter", "input", in, out, "output", size);
  }
}

void validate_reduce_scatter(const at::Tensor& out, const BlockArg& in, int rop, int size) {
  check_tensor("reduce_scatter", "output", out);
  check_reduce_op("reduce_scatter", rop, out.scalar_type());
  if (!in.present()) fail("reduce_scatter", "'input' is None; expected a tensor or a list");
  check_blocks("reduce_scatter", "input", in, out, "output", size);
}

void validate_reduce_scatter_failed(const at::Tensor& out, const at::Tensor& in, int rop,
                                    int size) {
  BlockArg b;
  b.borrowed = &in;
  validate_reduce_scatter(out, b, rop, size);  // the same checks, one of which throws
  fail("reduce_scatter", "internal error: an inline check failed where the full ones passed");
}

// The all-to-all block a rank sends itself is the one it receives from itself: the one
// size mismatch of an all-to-all a rank can see alone (the others need MCRDL_DEBUG=1).
static std::string own_block(const char* unit, const char* send_arg, int64_t sent,
                             const char* recv_arg, int64_t received, int rank) {
  const std::string r = "[" + std::to_string(rank) + "]";
  return std::string("this rank (") + std::to_string(rank) + ") sends itself " +
         std::to_string(sent) + " " + unit + " ('" + send_arg + "'" + r + ") but expects " +
         std::to_string(received) + " from itself ('" + recv_arg + "'" + r + "); they must " +
         "be equal, as must every rank's block for a peer and that peer's block from it";
}

std::pair<Counts, Counts> validate_all_to_all_single(const at::Tensor& out, const at::Tensor& in,
                                                     const std::optional<Counts>& out_splits,
                                                     const std::optional<Counts>& in_splits,
                                                     int rank, int size) {
  const char* op = "all_to_all_single";
  check_tensor(op, "output", out);
  check_tensor(op, "input", in);
  check_same_dtype(op, "output", out, "input", in);
  if (in.dim() == 0 || out.dim() == 0)
    fail(op, "'input' and 'output' must have at least one dimension (split along dim 0)");
  int64_t in_row = in.size(0) ? in.numel() / in.size(0) : 1;
  int64_t out_row = out.size(0) ? out.numel() / out.size(0) : 1;
  if (in.numel() && out.numel() && in_row != out_row)
    fail(op, "rows of 'input' (shape " + shape_str(in) + ") and 'output' (shape " +
                 shape_str(out) + ") differ in size; all dims but dim 0 must match");
  auto splits = [&](const std::optional<Counts>& s, const at::Tensor& t, const char* arg,
                    const char* targ) {
    Counts c;
    if (s) {
      c = *s;
      if ((int)c.size() != size)
        fail(op, std::string("'") + arg + "' has " + std::to_string(c.size()) + " entries " +
                     counts_str(c) + "; expected one per rank (" + std::to_string(size) + ")");
      int64_t sum = 0;
      for (int i = 0; i < size; ++i) {
        if (c[i] < 0)
          fail(op, std::string("'") + arg + "'[" + std::to_string(i) + "] is " +
                       std::to_string(c[i]) + "; split sizes must be >= 0");
        sum += c[i];
      }
      if (sum != t.size(0))
        fail(op, std::string("'") + arg + "' " + counts_str(c) + " sums to " +
                     std::to_string(sum) + " rows but '" + targ + "' has " +
                     std::to_string(t.size(0)) + " rows along dim 0");
    } else {
      if (t.size(0) % size)
        fail(op, std::string("'") + targ + "' has " + std::to_string(t.size(0)) +
                     " rows along dim 0, not divisible by the group size " +
                     std::to_string(size) + "; pass '" + arg + "'");
      c.assign(size, t.size(0) / size);
    }
    return c;
  };
  Counts is = splits(in_splits, in, "input_split_sizes", "input");
  Counts os = splits(out_splits, out, "output_split_sizes", "output");
  if (is[rank] != os[rank])
    fail(op, own_block("rows", "input_split_sizes", is[rank], "output_split_sizes", os[rank],
                       rank));
  return {is, os};
}

void validate_all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                         int rank, int size) {
  const char* op = "all_to_all";
  if ((int)in.size() != size || (int)out.size() != size)
    fail(op, "'input_list' has " + std::to_string(in.size()) + " and 'output_list' has " +
                 std::to_string(out.size()) + " tensors; both need one per rank (" +
                 std::to_string(size) + ")");
  for (int i = 0; i < size; ++i) {
    std::string a = "input_list[" + std::to_string(i) + "]";
    std::string b = "output_list[" + std::to_string(i) + "]";
    check_tensor(op, a.c_str(), in[i]);
    check_tensor(op, b.c_str(), out[i]);
    check_same_dtype(op, a.c_str(), in[i], "input_list[0]", in[0]);
    check_same_dtype(op, b.c_str(), out[i], "input_list[0]", in[0]);
  }
  if (in[rank].numel() != out[rank].numel())
    fail(op, own_block("elements", "input_list", in[rank].numel(), "output_list",
                       out[rank].numel(), rank));
}

Counts validate_gatherv(const at::Tensor* out, const at::Tensor& in, const Counts& counts,
                        const std::optional<Counts>& displs, int64_t dst, int rank, int size) {
  const char* op = "gatherv";
  check_tensor(op, "input", in);
  check_rank(op, "dst", dst, size);
  Counts d;
  if (rank == dst) {
    if (!out) fail(op, "'output' is None on the destination rank; it needs a tensor");
    check_tensor(op, "output", *out);
    check_same_dtype(op, "output", *out, "input", in);
    d = check_counts(op, "counts", counts, "displs", displs, size, "output", out->numel(), true);
  } else {
    d = check_counts(op, "counts", counts, "displs", displs, size, "output",
                     std::numeric_limits<int64_t>::max() / 2, false);
  }
  if (counts[rank] != in.numel())
    fail(op, "'counts'[" + std::to_string(rank) + "] is " + std::to_string(counts[rank]) +
                 " but this rank's 'input' has " + std::to_string(in.numel()) + " elements");
  return d;
}

Counts validate_scatterv(const at::Tensor& out, const at::Tensor* in, const Counts& counts,
                         const std::optional<Counts>& displs, int64_t src, int rank, int size) {
  const char* op = "scatterv";
  check_tensor(op, "output", out);
  check_rank(op, "src", src, size);
  Counts d;
  if (rank == src) {
    if (!in) fail(op, "'input' is None on the source rank; it needs a tensor");
    check_tensor(op, "input", *in);
    check_same_dtype(op, "input", *in, "output", out);
    d = check_counts(op, "counts", counts, "displs", displs, size, "input", in->numel(), false);
  } else {
    d = check_counts(op, "counts", counts, "displs", displs, size, "input",
                     std::numeric_limits<int64_t>::max() / 2, false);
  }
  if (counts[rank] != out.numel())
    fail(op, "'counts'[" + std::to_string(rank) + "] is " + std::to_string(counts[rank]) +
                 " but this rank's 'output' has " + std::to_string(out.numel()) + " elements");
  return d;
}

Counts validate_all_gatherv(const at::Tensor& out, const at::Tensor& in, const Counts& counts,
                            const std::optional<Counts>& displs, int rank, int size) {
  const char* op = "all_gatherv";
  check_tensor(op, "output", out);
  check_tensor(op, "input", in);
  check_same_dtype(op, "output", out, "input", in);
  Counts d = check_counts(op, "counts", counts, "displs", displs, size, "output", out.numel(), true);
  if (counts[rank] != in.numel())
    fail(op, "'counts'[" + std::to_string(rank) + "] is " + std::to_string(counts[rank]) +
                 " but this rank's 'input' has " + std::to_string(in.numel()) + " elements");
  return d;
}

std::pair<Counts, Counts> validate_all_to_allv(const at::Tensor& out, const at::Tensor& in,
                                               const Counts& send_counts, const Counts& recv_counts,
                                               const std::optional<Counts>& send_displs,
                                               const std::optional<Counts>& recv_displs, int rank,
                                               int size) {
  const char* op = "all_to_allv";
  check_tensor(op, "output", out);
  check_tensor(op, "input", in);
  check_same_dtype(op, "output", out, "input", in);
  Counts sd = check_counts(op, "send_counts", send_counts, "send_displs", send_displs, size,
                           "input", in.numel(), false);
  Counts rd = check_counts(op, "recv_counts", recv_counts, "recv_displs", recv_displs, size,
                           "output", out.numel(), true);
  if (send_counts[rank] != recv_counts[rank])
    fail(op, own_block("elements", "send_counts", send_counts[rank], "recv_counts",
                       recv_counts[rank], rank));
  return {sd, rd};
}

void validate_p2p(const char* op, const at::Tensor& t, int64_t peer, int64_t tag, int rank,
                  int size) {
  check_tensor(op, "tensor", t);
  const char* arg = op[0] == 's' ? "dst" : "src";
  check_rank(op, arg, peer, size);
  if (peer == rank)
    fail(op, std::string("'") + arg + "' is this process's own rank " + std::to_string(rank) +
                 "; a point-to-point message to self is not supported, copy locally instead");
  if (tag < 0 || tag > 32767)
    fail(op, "'tag' is " + std::to_string(tag) +
                 "; expected an integer in [0, 32767] (the MPI standard's guaranteed tag "
                 "range, on every backend): fold larger tags into it, keeping the tags of "
                 "concurrent messages between two ranks distinct");
}

}  // namespace mcrdl
