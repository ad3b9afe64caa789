// The mpi backend's CPython fast path: its hot ops (all_reduce, bcast, all_gather,
// reduce_scatter, barrier) as METH_FASTCALL functions that parse their arguments and call
// the C++ communicator (mpi_comm.cpp) directly.
#include <Python.h>

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mpi_fast.h"
#include "pyargs.h"

namespace mcrdl {

namespace {

// The mpi backend's operations as METH_FASTCALL functions (MPIBackend installs them over
// its Python methods): a call goes from the front's generated function straight here,
// without a Python frame of the backend or pybind11's argument dispatch (~0.2 us each,
// the whole budget of a small blocking call). Calls with keywords, and calls on groups
// the table does not hold (non-members, foreign objects: errors to report), go to the
// backend's Python method.
struct FastOps {
  MpiComm* world = nullptr;  // comms' entry for None, read first
  std::vector<std::pair<py::object, MpiComm*>> comms;  // group (None: world) -> its comm
  std::unordered_map<std::string, py::object> slow;    // op -> the Python method
};

// The functions' `self`: an object that holds the table itself (a capsule's pointer is
// read through PyCapsule_GetPointer, a function of libpython with its checks: more code
// lines on every call).
struct FastSelf {
  PyObject_HEAD
  FastOps* ops;
};

void fast_self_dealloc(PyObject* o) {
  delete reinterpret_cast<FastSelf*>(o)->ops;
  PyTypeObject* tp = Py_TYPE(o);
  tp->tp_free(o);
  Py_DECREF(tp);  // instances of a heap type hold a reference to it
}

PyObject* new_fast_self(FastOps* ops) {
  static PyTypeObject* type = [] {
    static PyType_Slot slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(fast_self_dealloc)},
                                  {0, nullptr}};
    static PyType_Spec spec = {"mcrdl._C.MpiFastOps", sizeof(FastSelf), 0, Py_TPFLAGS_DEFAULT,
                               slots};
    return reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));  // kept for the process
  }();
  PyObject* o = type ? type->tp_alloc(type, 0) : nullptr;
  if (!o) {
    delete ops;
    throw py::error_already_set();
  }
  reinterpret_cast<FastSelf*>(o)->ops = ops;
  return o;
}

FastOps* fast_ops(PyObject* self) { return reinterpret_cast<FastSelf*>(self)->ops; }

// An async_op argument: True and False without a call (PyObject_IsTrue is a function of
// libpython); anything else by its truth value, an error raised as one.
[[gnu::cold, gnu::noinline]] bool truthy_slow(PyObject* o) {
  const int r = PyObject_IsTrue(o);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

C10_ALWAYS_INLINE bool truthy(PyObject* o) {
  if (o == Py_True) return true;
  if (o == Py_False) return false;
  return truthy_slow(o);
}

C10_ALWAYS_INLINE MpiComm* fast_comm(FastOps* f, PyObject* group) {
  if (group == Py_None && f->world) return f->world;
  for (auto& [g, c] : f->comms)
    if (g.ptr() == group) return c;
  return nullptr;
}

template <typename Call>
PyObject* fast_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames,
                    const char* op, Py_ssize_t want, Call&& call) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  FastOps* f = fast_ops(self);
  MpiComm* c = (nargs == want && !kwnames) ? fast_comm(f, args[want - 2]) : nullptr;
  if (!c) return PyObject_Vectorcall(f->slow.at(op).ptr(), args, nargsf, kwnames);
  try {
    return call(*c, args, truthy(args[want - 1])).release().ptr();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyObject* fast_all_reduce(PyObject* self, PyObject* const* a, size_t n, PyObject* kw) {
  return fast_call(self, a, n, kw, "all_reduce", 4, [](MpiComm& c, PyObject* const* a, bool as) {
    return mpi_all_reduce(c, a[0], to_reduce_code(a[1], "all_reduce"), as);
  });
}
PyObject* fast_bcast(PyObject* self, PyObject* const* a, size_t n, PyObject* kw) {
  return fast_call(self, a, n, kw, "bcast", 4, [](MpiComm& c, PyObject* const* a, bool as) {
    return mpi_bcast(c, a[0], a[1], as);
  });
}
PyObject* fast_all_gather(PyObject* self, PyObject* const* a, size_t n, PyObject* kw) {
  return fast_call(self, a, n, kw, "all_gather", 4, [](MpiComm& c, PyObject* const* a, bool as) {
    return mpi_all_gather(c, a[0], a[1], as);
  });
}
PyObject* fast_reduce_scatter(PyObject* self, PyObject* const* a, size_t n, PyObject* kw) {
  return fast_call(self, a, n, kw, "reduce_scatter", 5,
                   [](MpiComm& c, PyObject* const* a, bool as) {
                     return mpi_reduce_scatter(
                         c, a[0], a[1], to_reduce_code(a[2], "reduce_scatter"), as);
                   });
}
PyObject* fast_barrier(PyObject* self, PyObject* const* a, size_t n, PyObject* kw) {
  return fast_call(self, a, n, kw, "barrier", 2, [](MpiComm& c, PyObject* const*, bool as) {
    return mpi_barrier(c, as);
  });
}

PyMethodDef kFastDefs[] = {
    {"all_reduce", (PyCFunction)(void (*)())fast_all_reduce, METH_FASTCALL | METH_KEYWORDS, nullptr},
    {"bcast", (PyCFunction)(void (*)())fast_bcast, METH_FASTCALL | METH_KEYWORDS, nullptr},
    {"all_gather", (PyCFunction)(void (*)())fast_all_gather, METH_FASTCALL | METH_KEYWORDS, nullptr},
    {"reduce_scatter", (PyCFunction)(void (*)())fast_reduce_scatter, METH_FASTCALL | METH_KEYWORDS,
     nullptr},
    {"barrier", (PyCFunction)(void (*)())fast_barrier, METH_FASTCALL | METH_KEYWORDS, nullptr},
};

// mpi_fast_ops(slow): {op: fast function} for the ops of kFastDefs, each falling back to
// slow[op]; register communicators with the returned dict's "__add__"(group, comm), and
// forget them all with its "__clear__"().
py::dict mpi_fast_ops(py::dict slow) {
  auto* f = new FastOps();
  auto holder = py::reinterpret_steal<py::object>(new_fast_self(f));
  py::dict out;
  for (auto& def : kFastDefs) {
    f->slow[def.ml_name] = slow[def.ml_name];
    out[def.ml_name] = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, holder.ptr(), nullptr));
  }
  out["__add__"] = py::cpp_function([f, holder](py::object group, py::object comm) {
    (void)holder;
    f->comms.emplace_back(group, mpi_comm_of(comm));
    if (group.is_none() && !f->world) f->world = f->comms.back().second;
  });
  // At finalize, before the communicators go: from then on every call takes the Python
  // method, which refuses it (the table holds plain pointers, not the comm objects).
  out["__clear__"] = py::cpp_function([f, holder] {
    (void)holder;
    f->comms.clear();
    f->world = nullptr;
  });
  return out;
}

}  // namespace

void bind_mpi_fast(py::module_& m) {
  m.def("mpi_fast_ops", &mpi_fast_ops, py::arg("slow"),
        "{op: METH_FASTCALL function} of the mpi backend's hot ops, each falling back to "
        "slow[op]; '__add__'(group, comm) registers a communicator (group None: the world), "
        "'__clear__'() forgets them all.");
}

}  // namespace mcrdl
