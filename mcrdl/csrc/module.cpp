// mcrdl._C: the C++ core (Work, lanes, validation, the MPI hot path).
#include "gil.h"
#include "lane.h"
#include "pyargs.h"

#include <torch/csrc/autograd/python_variable.h>

#include <unordered_map>

namespace mcrdl {

void bind_mpi(py::module_& m);
void bind_pccl(py::module_& m);
void bind_fusion(py::module_& m);
void bind_front(py::module_& m);

namespace {

// Python classes of mcrdl.errors, looked up once at import.
PyObject* g_errors[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const Error& e) {
    PyErr_SetString(g_errors[static_cast<int>(e.kind())], e.what());
  }
}

// Parameter positions of every operation, by name, read from mcrdl.ops.OPS at import:
// the Python spec is the one place an operation's parameters are declared.
std::unordered_map<std::string, std::unordered_map<std::string, int>> g_params;

void load_op_specs() {
  py::dict ops = py::module_::import("mcrdl.ops").attr("OPS");
  for (auto item : ops) {
    auto& index = g_params[item.first.cast<std::string>()];
    for (auto p : item.second.attr("index").cast<py::dict>())
      index[p.first.cast<std::string>()] = p.second.cast<int>();
  }
}

// validate(op, *args, rank, size): `args` are the operation's parameters in spec order
// (as its Backend method takes them), then the caller's group rank and the group size.
// Returns None, or the values of the parameters validation fills in (split sizes,
// displacements), in spec order.
py::object validate_binding(const std::string& o, const py::args& a) {
  auto spec = g_params.find(o);
  if (spec == g_params.end()) throw_invalid("validate: unknown operation '" + o + "'");
  const char* op = spec->first.c_str();
  if (a.size() != spec->second.size() + 2)
    throw_invalid("validate: " + o + " takes " + std::to_string(spec->second.size()) +
                  " arguments plus rank and size, got " + std::to_string(a.size()));
  auto arg = [&](const char* name) { return a[spec->second.at(name)]; };
  auto t = [&](const char* name) { return to_tensor(arg(name), op, name); };
  auto i64 = [&](const char* name) { return to_int(arg(name), op, name); };
  auto counts = [&](const char* name, bool opt) { return to_counts(arg(name), op, name, opt); };
  const int rank = static_cast<int>(to_int(a[a.size() - 2], op, "rank"));
  const int size = static_cast<int>(to_int(a[a.size() - 1], op, "size"));
  if (o == "all_reduce") {
    validate_all_reduce(t("tensor"), (int)i64("op"));
  } else if (o == "reduce") {
    validate_reduce(t("tensor"), i64("dst"), (int)i64("op"), size);
  } else if (o == "bcast") {
    validate_bcast(t("tensor"), i64("src"), size);
  } else if (o == "all_gather") {
    validate_all_gather(to_blocks(arg("output"), op, "output", false), t("input"), size);
  } else if (o == "gather") {
    validate_gather(to_blocks(arg("output"), op, "output", true), t("input"), i64("dst"), rank,
                    size);
  } else if (o == "scatter") {
    validate_scatter(t("output"), to_blocks(arg("input"), op, "input", true), i64("src"), rank,
                     size);
  } else if (o == "reduce_scatter") {
    validate_reduce_scatter(t("output"), to_blocks(arg("input"), op, "input", false),
                            (int)i64("op"), size);
  } else if (o == "all_to_all_single") {
    auto r = validate_all_to_all_single(t("output"), t("input"),
                                        counts("output_split_sizes", true),
                                        counts("input_split_sizes", true), rank, size);
    return py::make_tuple(r.second, r.first);  // (output_split_sizes, input_split_sizes)
  } else if (o == "all_to_all") {
    validate_all_to_all(to_tensor_list(arg("output_list"), op, "output_list"),
                        to_tensor_list(arg("input_list"), op, "input_list"), rank, size);
  } else if (o == "gatherv") {
    at::Tensor s;
    return py::make_tuple(validate_gatherv(to_tensor_opt(arg("output"), op, "output", s),
                                           t("input"), *counts("counts", false),
                                           counts("displs", true), i64("dst"), rank, size));
  } else if (o == "scatterv") {
    at::Tensor s;
    return py::make_tuple(validate_scatterv(t("output"), to_tensor_opt(arg("input"), op, "input", s),
                                            *counts("counts", false), counts("displs", true),
                                            i64("src"), rank, size));
  } else if (o == "all_gatherv") {
    return py::make_tuple(validate_all_gatherv(t("output"), t("input"), *counts("counts", false),
                                               counts("displs", true), rank, size));
  } else if (o == "all_to_allv") {
    auto r = validate_all_to_allv(t("output"), t("input"), *counts("send_counts", false),
                                  *counts("recv_counts", false), counts("send_displs", true),
                                  counts("recv_displs", true), rank, size);
    return py::make_tuple(r.first, r.second);
  } else if (o == "send") {
    validate_p2p("send", t("tensor"), i64("dst"), i64("tag"), rank, size);
  } else if (o == "recv") {
    validate_p2p("recv", t("tensor"), i64("src"), i64("tag"), rank, size);
  } else if (o != "barrier") {
    throw_invalid("validate: operation '" + o + "' has no checks in csrc/module.cpp");
  }
  return py::none();
}

bool python_usable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// A thread that runs callbacks (a lane thread runs one per async op) keeps the Python
// thread state the first one made: gil_scoped_acquire would make and clear one per
// callback. Called with the GIL held; the state goes with the interpreter.
void keep_thread_state() {
  thread_local bool kept = false;
  if (!kept) {
    kept = true;
    ++PyThreadState_Get()->gilstate_counter;
    register_callback_thread_state(PyThreadState_Get());
  }
}

// Work.add_done_callback: `fn` is released with the GIL taken, wherever the Work drops it
// (never once the interpreter is going away: then it is leaked).
void add_done_callback(Work& w, py::function fn) {
  // Counted as a GIL user (gil.h) until released: the callback and the release take it.
  auto user = std::make_shared<GilUser>();
  std::shared_ptr<py::object> held(new py::object(std::move(fn)), [user](py::object* f) {
    if (!python_usable()) return;
    py::gil_scoped_acquire gil;
    delete f;
  });
  w.on_complete([held](bool failed, ErrorKind kind, const std::string& why) {
    if (!python_usable()) return;
    py::gil_scoped_acquire gil;
    keep_thread_state();
    try {
      (*held)(failed ? py::handle(g_errors[static_cast<int>(kind)])(why) : py::none());
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("mcrdl Work completion callback");
    }
  });
}

}  // namespace

bool is_tensor(PyObject* o) { return THPVariable_Check(o); }

const at::Tensor& unpack_tensor(PyObject* o) { return THPVariable_Unpack(o); }

void set_python_error(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    PyErr_SetString(g_errors[static_cast<int>(e.kind())], e.what());
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

}  // namespace mcrdl

PYBIND11_MODULE(_C, m) {
  using namespace mcrdl;
  namespace py = pybind11;
  m.doc() = "mcrdl C++ core: Work handles, host lanes, argument validation, MPI hot path";

  py::module_ errors = py::module_::import("mcrdl.errors");
  const char* names[5] = {"InvalidArgumentError", "UnsupportedOperationError", "CommTimeoutError",
                          "BackendUnavailableError", "MCRDLError"};
  for (int i = 0; i < 5; ++i) g_errors[i] = py::object(errors.attr(names[i])).release().ptr();
  py::register_exception_translator(&translate);
  load_op_specs();

  py::class_<Work, std::shared_ptr<Work>>(m, "Work",
                                          "Handle of an async operation (API.md 'Work').")
      .def("wait",
           [](Work& w, py::handle timeout) {
             double seconds = -1.0;  // None: the op's own timeout
             if (!timeout.is_none()) {  // one rule for every kind of Work
               PyObject* rule = wait_timeout_rule();
               if (!rule) throw py::error_already_set();
               seconds = py::handle(rule)(timeout).cast<double>();
             }
             py::gil_scoped_release nogil;
             w.wait(seconds);
             return true;
           },
           py::arg("timeout") = py::none(),
           "Block until the op completed; raise CommTimeoutError after `timeout` seconds "
           "(default: the init timeout). Returns True.")
      .def("is_completed", &Work::is_completed)
      .def("add_done_callback", &add_done_callback, py::arg("fn"),
           "Call fn(error) once the op has completed (error None) or failed (error: the "
           "exception wait() raises), with the GIL taken, on the thread that completes it "
           "(at once when it has); in registration order; what fn raises goes to "
           "sys.unraisablehook.")
      .def("time_out", &Work::time_out, py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>(),
           "The op was waited on for `timeout` s (default: its own timeout), timed by the "
           "caller: unless it completed since, raise the CommTimeoutError wait() raises then "
           "(failing the backend as wait() does under the default timeout).")
      .def_property_readonly("backend", &Work::backend)
      .def_property_readonly("op", &Work::op)
      .def_property_readonly("group", &Work::group)
      .def_property_readonly("seq", &Work::seq)
      .def("__repr__", [](const Work& w) {
        return "<mcrdl Work " + w.op() + " #" + std::to_string(w.seq()) + " on '" + w.backend() +
               "' group " + w.group() + (w.finished() ? " done>" : " pending>");
      });

  py::class_<Lane, std::shared_ptr<Lane>>(m, "Lane", "A backend's host progress thread.")
      .def(py::init<std::string>())
      .def("synchronize", &Lane::synchronize, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("in_flight", &Lane::in_flight)
      .def("fail", [](Lane& l, const std::string& why) { l.fail(why, nullptr); }, py::arg("why"),
           "Refuse new ops from now on (ranks no longer issue matching operations).")
      .def("shutdown", &Lane::shutdown, py::arg("why"), py::arg("drain_timeout") = 0.0,
           py::call_guard<py::gil_scoped_release>())
      .def("check_open",
           [](Lane& l, const std::string& what) {
             if (l.closed()) l.throw_unhealthy(what.c_str());
           },
           py::arg("what"),
           "Raise the lane's 'backend is closed' error for `what` once it was shut down (not "
           "after a timeout: a rank that refused alone would leave its peers waiting).")
      .def_property_readonly("name", &Lane::name);

  m.def("set_idle_sleep", &set_idle_sleep, py::arg("on"),
        "Waiters sleep after 100 us without progress and idle lane threads in slices growing to "
        "1 ms (not 50 us): for ranks outnumbering cores.");
  m.def("set_poll_spins", &set_poll_spins, py::arg("n"),
        "Polls a waiter makes before yielding the CPU between polls (0: yield at once).");
  m.def("set_hold_gil", &set_hold_gil, py::arg("mode"),
        "Whether blocking MPI calls may keep the GIL: 0 never, 1 auto (csrc/gil.h).");
  m.def("may_hold_gil", &may_hold_gil,
        "Whether a blocking MPI call made now by this thread would keep the GIL.");
  m.def("validate", &validate_binding, py::arg("op"),
        "validate(op, *args, rank, size): the local argument checks of operation `op`, its "
        "arguments in the order of mcrdl.ops.OPS[op]; raises InvalidArgumentError. Returns "
        "None or the filled-in split sizes / displacements in spec order.");
  bind_mpi(m);
  bind_pccl(m);
  bind_fusion(m);
  bind_front(m);
}
