// The copies of tensor fusion (mcrdl/fusion/tensor_fusion.py): the callers' tensors into
// one flat fused buffer, and consecutive slices of it back, one memcpy per tensor of any
// shape. torch.cat needs 1-D views first and torch.split_with_sizes_copy goes through
// the dispatcher at ~0.5 us per tensor; these take ~0.03 us.
#include <ATen/ops/empty.h>

#include <cstring>
#include <optional>

#include "pyargs.h"

namespace mcrdl {

namespace {

// The tensors of `list` (a list or tuple of contiguous CPU tensors of one dtype, the
// first one's unless `dtype` is given), with their total bytes.
std::vector<at::Tensor> flat_parts(const char* op, py::handle list,
                                   std::optional<at::ScalarType> dtype, size_t& total) {
  if (!PyList_Check(list.ptr()) && !PyTuple_Check(list.ptr()))
    throw_invalid(std::string(op) + ": expected a list of tensors, got " + type_name(list));
  py::sequence seq = py::reinterpret_borrow<py::sequence>(list);
  std::vector<at::Tensor> parts;  // keeps them alive while the GIL is released
  parts.reserve(seq.size());
  total = 0;
  for (auto item : seq) {
    if (!THPVariable_Check(item.ptr()))
      throw_invalid(std::string(op) + ": the list holds a " + type_name(item) + ", not a tensor");
    const at::Tensor& t = THPVariable_Unpack(item.ptr());
    if (!dtype) dtype = t.scalar_type();
    if (!t.is_cpu() || !t.is_contiguous() || t.scalar_type() != *dtype)
      throw_invalid(std::string(op) + ": every tensor must be a contiguous CPU tensor of " +
                    dtype_name(*dtype) + ", got " + dtype_name(t.scalar_type()) + " " +
                    shape_str(t));
    total += t.nbytes();
    parts.push_back(t);
  }
  if (parts.empty()) throw_invalid(std::string(op) + ": the list of tensors is empty");
  return parts;
}

at::Tensor pack_flat(py::handle srcs_obj) {
  size_t total = 0;
  auto srcs = flat_parts("pack_flat", srcs_obj, std::nullopt, total);
  at::Tensor buf = at::empty({static_cast<int64_t>(total / srcs[0].element_size())},
                             at::TensorOptions().dtype(srcs[0].scalar_type()));
  py::gil_scoped_release nogil;
  char* dst = static_cast<char*>(buf.data_ptr());
  for (const auto& t : srcs) {
    const size_t n = t.nbytes();
    if (n) std::memcpy(dst, t.data_ptr(), n);
    dst += n;
  }
  return buf;
}

void unpack_flat(const at::Tensor& buf, py::handle dsts_obj) {
  const char* op = "unpack_flat";
  if (!buf.is_cpu() || !buf.is_contiguous())
    throw_invalid(std::string(op) + ": 'buf' must be a contiguous CPU tensor");
  size_t total = 0;
  auto dsts = flat_parts(op, dsts_obj, buf.scalar_type(), total);
  if (total > buf.nbytes())
    throw_invalid(std::string(op) + ": the destinations hold " + std::to_string(total) +
                  " bytes, the buffer " + std::to_string(buf.nbytes()));
  py::gil_scoped_release nogil;
  const char* src = static_cast<const char*>(buf.data_ptr());
  for (const auto& t : dsts) {
    const size_t n = t.nbytes();
    if (n) std::memcpy(t.data_ptr(), src, n);
    src += n;
  }
}

}  // namespace

void bind_fusion(py::module_& m) {
  m.def("pack_flat", &pack_flat, py::arg("srcs"),
        "A new flat tensor holding the contiguous CPU tensors `srcs` (one dtype, any shapes) "
        "one after the other: the buffer of a fused call.");
  m.def("unpack_flat", &unpack_flat, py::arg("buf"), py::arg("dsts"),
        "Copy consecutive slices of the flat contiguous CPU tensor `buf` into the contiguous "
        "CPU tensors `dsts` (same dtype), in order: the copy-back of a fused call.");
}

}  // namespace mcrdl
