// The front's operation functions as C callables (mcrdl.api wraps each generated Python
// function in one). A small blocking call is a few tenths of a microsecond in all, and the
// generated function's Python frame was a third of it; this type does the same steps
// without a frame: bind the arguments (positional or keyword) to the spec's parameters,
// convert reduce ops, look the backend up in mcrdl.api._dispatch and call its method.
// Anything unusual (a missing or unknown argument, an unknown backend, an operation the
// backend lacks) goes to, or is finished by, the Python function, so errors read the same.
//
// Each FrontOp caches, per backend name object, the method it resolved (the dispatch table
// entry's attribute): the two dictionary lookups and the method lookup were half of its
// cost. The cache holds until the next front_invalidate(), which the runtime calls
// whenever it rebuilds or clears the dispatch table (the extensions likewise bind the
// methods below them when the table is built).
#include <Python.h>
#include <structmember.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "pyargs.h"

namespace mcrdl {

namespace {

// A METH_FASTCALL | METH_KEYWORDS C function (PyCFunctionFastWithKeywords from 3.13 on).
using FastFn = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*);

struct FrontOp {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* dict;        // __dict__: __name__, __doc__, __wrapped__ ...
  PyObject* slow;        // the generated Python function: the reference behaviour
  PyObject* method;      // the backend method's name (interned)
  PyObject* globals;     // mcrdl.api's namespace: _dispatch is rebound by init/finalize
  PyObject* names;       // tuple: parameter names after `backend` (spec params, group, async_op)
  PyObject* defaults;    // tuple, same length: default values, `required` where none
  PyObject* required;    // the marker of a parameter without default
  PyObject* reduce_type;     // mcrdl.ops.ReduceOp
  PyObject* to_reduce_op;    // mcrdl.ops.to_reduce_op
  PyObject* unsupported;     // mcrdl.errors.UnsupportedOperationError
  PyObject* alternatives;    // mcrdl.api._alternatives
  std::vector<Py_ssize_t>* reduce_at;  // indexes (in `names`) of reduce-op parameters
  // The cache: backend name objects (compared by identity) and their methods, emptied by
  // front_invalidate.
  static constexpr int kCache = 4;
  int next;  // the entry to replace next
  PyObject* keys[kCache];
  PyObject* methods[kCache];
  // A method that is a METH_FASTCALL | METH_KEYWORDS C function (the mpi backend's hot
  // ops): its C function and self, called directly (see finish_call).
  FastFn fns[kCache];
  PyObject* selves[kCache];  // borrowed from methods[i]
};

PyObject* k_dispatch = nullptr;  // "_dispatch", interned
std::vector<FrontOp*> g_fronts;   // every live FrontOp (touched with the GIL held)

void clear_cache(FrontOp* f) {
  for (int i = 0; i < FrontOp::kCache; ++i) {
    Py_CLEAR(f->keys[i]);
    Py_CLEAR(f->methods[i]);
    f->fns[i] = nullptr;
    f->selves[i] = nullptr;
  }
  f->next = 0;
}

// A resolved backend method: a new reference, and its C function and self when it is a
// fast C function.
struct Resolved {
  PyObject* method = nullptr;
  FastFn fn = nullptr;
  PyObject* self = nullptr;
};

// The method of backend `name`, or a null method without an error set when the Python
// function must handle the call (not initialized, unknown or unhashable name).
Resolved resolve(FrontOp* f, PyObject* name) {
  for (int i = 0; i < FrontOp::kCache; ++i)
    if (f->keys[i] == name) return {Py_NewRef(f->methods[i]), f->fns[i], f->selves[i]};
  PyObject* dispatch = PyDict_GetItemWithError(f->globals, k_dispatch);
  PyObject* target = dispatch && PyDict_CheckExact(dispatch)
                         ? PyDict_GetItemWithError(dispatch, name) : nullptr;
  if (!target) {
    PyErr_Clear();
    return {};
  }
  PyObject* method = PyObject_GetAttr(target, f->method);
  if (!method) {  // the target lacks the op: the Python function reports it
    PyErr_Clear();
    return {};
  }
  Resolved r{method};
  if (PyCFunction_Check(method) &&
      PyCFunction_GET_FLAGS(method) == (METH_FASTCALL | METH_KEYWORDS)) {
    r.fn = reinterpret_cast<FastFn>(
        reinterpret_cast<void (*)()>(PyCFunction_GET_FUNCTION(method)));
    r.self = PyCFunction_GET_SELF(method);
  }
  // The entry is whole before the old one's references go: dropping them can run
  // Python code (a finalizer) that calls this op again.
  const int i = f->next;
  f->next = (i + 1) % FrontOp::kCache;
  PyObject* old_key = f->keys[i];
  PyObject* old_method = f->methods[i];
  f->keys[i] = Py_NewRef(name);
  f->methods[i] = Py_NewRef(method);
  f->fns[i] = r.fn;
  f->selves[i] = r.self;
  Py_XDECREF(old_key);
  Py_XDECREF(old_method);
  return r;
}

PyObject* call_slow(FrontOp* f, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  return PyObject_Vectorcall(f->slow, args, nargsf, kwnames);
}

// Calls `m` with args[1:n] (args[0] is free: ARGUMENTS_OFFSET); an
// UnsupportedOperationError leaves naming the backends that have the operation
// (mcrdl.api._alternatives), as from the Python function. A fast C function is called
// directly, as CPython's own vectorcall of it would, less its recursion-depth check (the
// mpi backend's functions run no Python code but the fallback call, which checks) and
// its result check: the code of those calls was a tenth of a small call's cache lines.
PyObject* finish_call(FrontOp* f, const Resolved& m, PyObject** args, size_t n) {
  PyObject* res = m.fn ? m.fn(m.self, args + 1, static_cast<Py_ssize_t>(n - 1), nullptr)
                       : PyObject_Vectorcall(m.method, args + 1,
                                             (n - 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (res || !PyErr_ExceptionMatches(f->unsupported)) return res;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb) PyException_SetTraceback(value, tb);
  PyObject* better = PyObject_CallOneArg(f->alternatives, value);
  if (!better || better == value) {
    Py_XDECREF(better);
    if (better) PyErr_Restore(type, value, tb);
    else {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
    }
    return nullptr;
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyException_SetCause(better, nullptr);  // `raise better from None`
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(better)), better);
  Py_DECREF(better);
  return nullptr;
}

PyObject* front_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf,
                           PyObject* kwnames) {
  auto* f = reinterpret_cast<FrontOp*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t np = PyTuple_GET_SIZE(f->names);
  if (nargs < 1 || nargs > np + 1) return call_slow(f, args, nargsf, kwnames);
  // call[1 + i]: parameter i; call[0] is free for the callee (ARGUMENTS_OFFSET)
  constexpr Py_ssize_t kMax = 16;
  if (np + 1 > kMax) return call_slow(f, args, nargsf, kwnames);
  PyObject* call[kMax];
  call[0] = nullptr;
  for (Py_ssize_t i = 1; i <= np; ++i) call[i] = i < nargs ? args[i] : nullptr;
  if (kwnames) {
    const Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; ++k) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, k);
      Py_ssize_t at = -1;
      for (Py_ssize_t i = 0; i < np && at < 0; ++i)
        if (PyTuple_GET_ITEM(f->names, i) == key) at = i;
      for (Py_ssize_t i = 0; i < np && at < 0; ++i) {
        int eq = PyUnicode_Compare(PyTuple_GET_ITEM(f->names, i), key);
        if (eq == -1 && PyErr_Occurred()) PyErr_Clear();
        if (eq == 0) at = i;
      }
      // unknown keyword, `backend` by keyword, or a parameter given twice: Python's message
      if (at < 0 || call[at + 1]) return call_slow(f, args, nargsf, kwnames);
      call[at + 1] = args[nargs + k];
    }
  }
  for (Py_ssize_t i = 0; i < np; ++i)
    if (!call[i + 1]) {
      PyObject* d = PyTuple_GET_ITEM(f->defaults, i);
      if (d == f->required) return call_slow(f, args, nargsf, kwnames);  // TypeError there
      call[i + 1] = d;
    }
  // async_op (the last parameter) other than a bool: the Python function converts or
  // refuses it.
  if (call[np] != Py_True && call[np] != Py_False) return call_slow(f, args, nargsf, kwnames);
  // The backend first: an unknown one is reported before a bad reduce op, as in Python.
  const Resolved method = resolve(f, args[0]);
  if (!method.method) return call_slow(f, args, nargsf, kwnames);
  // Reduce ops arrive as ReduceOp, a name or a torch.distributed op: convert the others.
  PyObject* converted[kMax];
  int nconv = 0;
  PyObject* res = nullptr;
  for (Py_ssize_t i : *f->reduce_at) {
    PyObject* v = call[i + 1];
    if (Py_TYPE(v) == reinterpret_cast<PyTypeObject*>(f->reduce_type)) continue;
    PyObject* c = PyObject_CallOneArg(f->to_reduce_op, v);
    if (!c) goto done;
    converted[nconv++] = c;
    call[i + 1] = c;
  }
  res = finish_call(f, method, call, static_cast<size_t>(np + 1));
done:
  Py_DECREF(method.method);
  while (nconv > 0) Py_DECREF(converted[--nconv]);
  return res;
}

int front_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* f = reinterpret_cast<FrontOp*>(self);
  Py_VISIT(f->dict);
  Py_VISIT(f->slow);
  Py_VISIT(f->globals);
  Py_VISIT(f->defaults);
  Py_VISIT(f->required);
  Py_VISIT(f->reduce_type);
  Py_VISIT(f->to_reduce_op);
  Py_VISIT(f->unsupported);
  Py_VISIT(f->alternatives);
  for (int i = 0; i < FrontOp::kCache; ++i) {
    Py_VISIT(f->keys[i]);
    Py_VISIT(f->methods[i]);
  }
  return 0;
}

int front_clear(PyObject* self) {
  auto* f = reinterpret_cast<FrontOp*>(self);
  Py_CLEAR(f->dict);
  Py_CLEAR(f->slow);
  Py_CLEAR(f->method);
  Py_CLEAR(f->globals);
  Py_CLEAR(f->names);
  Py_CLEAR(f->defaults);
  Py_CLEAR(f->required);
  Py_CLEAR(f->reduce_type);
  Py_CLEAR(f->to_reduce_op);
  Py_CLEAR(f->unsupported);
  Py_CLEAR(f->alternatives);
  clear_cache(f);
  return 0;
}

void front_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  auto& v = g_fronts;
  v.erase(std::remove(v.begin(), v.end(), reinterpret_cast<FrontOp*>(self)), v.end());
  front_clear(self);
  delete reinterpret_cast<FrontOp*>(self)->reduce_at;
  PyTypeObject* tp = Py_TYPE(self);
  tp->tp_free(self);
  Py_DECREF(tp);  // instances of a heap type hold a reference to it
}

PyObject* front_repr(PyObject* self) {
  return PyUnicode_FromFormat("<mcrdl operation %U>", reinterpret_cast<FrontOp*>(self)->method);
}

PyMemberDef front_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(FrontOp, dict), READONLY, nullptr},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(FrontOp, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyType_Slot front_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(front_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(front_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(front_clear)},
    {Py_tp_repr, reinterpret_cast<void*>(front_repr)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, front_members},
    {Py_tp_doc, const_cast<char*>("An mcrdl operation (see its __doc__ and __wrapped__).")},
    {0, nullptr},
};

PyType_Spec front_spec = {
    "mcrdl._C.FrontOp", sizeof(FrontOp), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, front_slots};

PyTypeObject* g_front_type = nullptr;

}  // namespace

// front_op(slow, method, globals, names, defaults, required, reduce_at, reduce_type,
// to_reduce_op, unsupported, alternatives): the C callable over `slow` (see the top).
py::object front_op(py::function slow, py::str method, py::dict globals, py::tuple names,
                    py::tuple defaults, py::object required, std::vector<Py_ssize_t> reduce_at,
                    py::object reduce_type, py::object to_reduce_op, py::object unsupported,
                    py::object alternatives) {
  if (names.size() != defaults.size() || names.size() + 1 > 16)
    throw_invalid("front_op: names and defaults must have the same length, at most 15");
  for (auto i : reduce_at)
    if (i < 0 || i >= static_cast<Py_ssize_t>(names.size()))
      throw_invalid("front_op: reduce_at index out of range");
  if (!k_dispatch) k_dispatch = PyUnicode_InternFromString("_dispatch");
  auto* f = PyObject_GC_New(FrontOp, g_front_type);
  if (!f) throw py::error_already_set();
  f->vectorcall = front_vectorcall;
  f->dict = PyDict_New();
  auto own = [](const py::handle& h) { return Py_NewRef(h.ptr()); };
  f->slow = own(slow);
  PyObject* m = own(method);
  PyUnicode_InternInPlace(&m);
  f->method = m;
  f->globals = own(globals);
  py::list interned;
  for (auto n : names) {
    PyObject* s = own(n);
    PyUnicode_InternInPlace(&s);
    interned.append(py::reinterpret_steal<py::object>(s));
  }
  f->names = own(py::tuple(interned));
  f->defaults = own(defaults);
  f->required = own(required);
  f->reduce_type = own(reduce_type);
  f->to_reduce_op = own(to_reduce_op);
  f->unsupported = own(unsupported);
  f->alternatives = own(alternatives);
  f->reduce_at = new std::vector<Py_ssize_t>(std::move(reduce_at));
  f->next = 0;
  for (int i = 0; i < FrontOp::kCache; ++i) {
    f->keys[i] = f->methods[i] = f->selves[i] = nullptr;
    f->fns[i] = nullptr;
  }
  g_fronts.push_back(f);
  PyObject_GC_Track(reinterpret_cast<PyObject*>(f));
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(f));
}

// Called with the GIL held (from Python).
void front_invalidate() {
  const std::vector<FrontOp*> fronts = g_fronts;  // a release may run code that frees one
  for (FrontOp* f : fronts)
    if (std::find(g_fronts.begin(), g_fronts.end(), f) != g_fronts.end()) clear_cache(f);
}

void bind_front(py::module_& m) {
  g_front_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&front_spec));
  if (!g_front_type) throw py::error_already_set();
  m.attr("FrontOp") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_front_type));
  m.def("front_op", &front_op, py::arg("slow"), py::arg("method"), py::arg("globals"),
        py::arg("names"), py::arg("defaults"), py::arg("required"), py::arg("reduce_at"),
        py::arg("reduce_type"), py::arg("to_reduce_op"), py::arg("unsupported"),
        py::arg("alternatives"),
        "The C callable of one front operation (mcrdl.api): the generated function `slow`'s "
        "behaviour without its Python frame.");
  m.def("front_invalidate", &front_invalidate,
        "Drop the methods the front operations cached: call after every change of the "
        "dispatch table (mcrdl.runtime) or of the methods of what it holds.");
}

}  // namespace mcrdl
