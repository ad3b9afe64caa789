// Conversion of Python arguments into C++ values, raising InvalidArgumentError (never a
// bare TypeError) with the op and argument named.
#pragma once

#include <climits>

#include <torch/csrc/utils/pybind.h>

#include "validate.h"

namespace mcrdl {

namespace py = pybind11;

// torch's THPVariable_Check and THPVariable_Unpack, defined once (module.cpp): their
// header, torch/csrc/autograd/python_variable.h, brings in autograd and the JIT's
// schemas, ~11 s of compile per file that includes it (of ~25 for front.cpp), and
// THPVariable's layout changes between torch versions, so it is not mirrored here. The
// call costs a few ns on a path of hundreds.
bool is_tensor(PyObject* o);
const at::Tensor& unpack_tensor(PyObject* o);

// Set the Python error of exception `p` (an mcrdl Error as its mcrdl.errors class, a
// Python error as itself), for functions written against the C API that return NULL.
void set_python_error(std::exception_ptr p);

inline std::string type_name(py::handle h) { return Py_TYPE(h.ptr())->tp_name; }

// The tensor object's at::Tensor, borrowed: valid while `h` lives (the call's arguments).
inline const at::Tensor& to_tensor(py::handle h, const char* op, const char* arg) {
  if (!is_tensor(h.ptr()))
    throw_invalid(std::string(op) + ": '" + arg + "' must be a torch.Tensor, got " +
                  (h.is_none() ? std::string("None") : type_name(h)));
  return unpack_tensor(h.ptr());
}

inline const at::Tensor* to_tensor_opt(py::handle h, const char* op, const char* arg,
                                       at::Tensor& storage) {
  if (h.is_none()) return nullptr;
  storage = to_tensor(h, op, arg);
  return &storage;
}

// An int of one digit (30 bits), read from the object: `false` for the others.
C10_ALWAYS_INLINE bool one_digit_int(PyObject* o, int64_t* v) {
#if PY_VERSION_HEX >= 0x030C0000
  auto* l = reinterpret_cast<PyLongObject*>(o);
  if (!PyUnstable_Long_IsCompact(l)) return false;
  *v = PyUnstable_Long_CompactValue(l);
#else
  const Py_ssize_t n = Py_SIZE(o);  // the digit count, negative for a negative int
  if (n < -1 || n > 1) return false;
  // (zero may have no digit before Python 3.11)
  *v = n == 0 ? 0 : n * static_cast<int64_t>(reinterpret_cast<PyLongObject*>(o)->ob_digit[0]);
#endif
  return true;
}

inline int64_t to_int(py::handle h, const char* op, const char* arg) {
  // An int (ReduceOp is an IntEnum) read in place: PyNumber_Index returns int subclasses
  // as a copy and never calls their __index__, so this is the same value, without the
  // copy's allocation and the calls into libpython on a small call's path.
  if (PyLong_Check(h.ptr()) && !PyBool_Check(h.ptr())) {
    int64_t small;
    if (one_digit_int(h.ptr(), &small)) return small;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (!overflow) return v;
  }
  if (PyBool_Check(h.ptr()) || !PyIndex_Check(h.ptr()))
    throw_invalid(std::string(op) + ": '" + arg + "' must be an int, got " + type_name(h));
  auto idx = py::reinterpret_steal<py::object>(PyNumber_Index(h.ptr()));
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
  if (overflow)
    throw_invalid(std::string(op) + ": '" + arg + "' is " + py::str(idx).cast<std::string>() +
                  ", outside the 64-bit integer range");
  return v;
}

// mcrdl.work.wait_timeout, looked up once: the one rule for a wait's `timeout` argument,
// which every kind of Work applies. A borrowed reference, or nullptr with the error set.
inline PyObject* wait_timeout_rule() {
  static PyObject* rule = nullptr;
  if (!rule) {
    PyObject* work = PyImport_ImportModule("mcrdl.work");
    if (!work) return nullptr;
    rule = PyObject_GetAttrString(work, "wait_timeout");
    Py_DECREF(work);
  }
  return rule;
}

// A reduce op's code (an int; one outside int's range is named as unknown, not cut).
inline int to_reduce_code(py::handle h, const char* op) {
  const int64_t v = to_int(h, op, "op");
  if (C10_UNLIKELY(v < INT_MIN || v > INT_MAX)) check_reduce_op_failed(op, v, at::kFloat);
  return static_cast<int>(v);
}

inline std::vector<at::Tensor> to_tensor_list(py::handle h, const char* op, const char* arg) {
  if (!PyList_Check(h.ptr()) && !PyTuple_Check(h.ptr()))
    throw_invalid(std::string(op) + ": '" + arg + "' must be a list of tensors, got " +
                  type_name(h));
  std::vector<at::Tensor> v;
  size_t i = 0;
  for (auto item : py::reinterpret_borrow<py::sequence>(h)) {
    std::string name = std::string(arg) + "[" + std::to_string(i++) + "]";
    v.push_back(to_tensor(item, op, name.c_str()));
  }
  return v;
}

// A tensor of `size` blocks, a list of tensors, or (allow_none) None.
inline BlockArg to_blocks(py::handle h, const char* op, const char* arg, bool allow_none) {
  BlockArg b;
  if (h.is_none()) {
    if (!allow_none)
      throw_invalid(std::string(op) + ": '" + arg + "' is None; expected a tensor or a list");
    return b;
  }
  if (is_tensor(h.ptr())) {
    b.borrowed = &unpack_tensor(h.ptr());
    return b;
  }
  b.is_list = true;
  b.list = to_tensor_list(h, op, arg);
  return b;
}

inline std::optional<Counts> to_counts(py::handle h, const char* op, const char* arg,
                                       bool allow_none) {
  if (h.is_none()) {
    if (!allow_none)
      throw_invalid(std::string(op) + ": '" + arg + "' is None; expected a sequence of ints");
    return std::nullopt;
  }
  if (is_tensor(h.ptr())) {
    at::Tensor t = unpack_tensor(h.ptr());
    if (t.dim() != 1 || at::isFloatingType(t.scalar_type()))
      throw_invalid(std::string(op) + ": '" + arg + "' must be a 1-D integer sequence");
    py::list l = py::reinterpret_steal<py::list>(PySequence_List(h.ptr()));
    return to_counts(l, op, arg, false);
  }
  if (!PySequence_Check(h.ptr()) || PyUnicode_Check(h.ptr()))
    throw_invalid(std::string(op) + ": '" + arg + "' must be a sequence of ints, got " +
                  type_name(h));
  Counts c;
  size_t i = 0;
  for (auto item : py::reinterpret_borrow<py::sequence>(h)) {
    std::string name = std::string(arg) + "[" + std::to_string(i++) + "]";
    c.push_back(to_int(item, op, name.c_str()));
  }
  return c;
}

}  // namespace mcrdl
