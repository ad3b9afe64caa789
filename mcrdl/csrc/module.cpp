// mcrdl._C: the C++ core (Work, lanes, validation, the MPI hot path).
#include "lane.h"
#include "pyargs.h"

namespace mcrdl {

void bind_mpi(py::module_& m);
void bind_pccl(py::module_& m);
void bind_fusion(py::module_& m);

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

py::object validate_binding(const char* op, const py::args& a) {
  auto t = [&](int i, const char* name) { return to_tensor(a[i], op, name); };
  auto i64 = [&](int i, const char* name) { return to_int(a[i], op, name); };
  auto sz = [&](int i) { return static_cast<int>(to_int(a[i], op, "size")); };
  std::string o(op);
  if (o == "all_reduce") {
    validate_all_reduce(t(0, "tensor"), (int)i64(1, "op"));
  } else if (o == "reduce") {
    validate_reduce(t(0, "tensor"), i64(1, "dst"), (int)i64(2, "op"), sz(3));
  } else if (o == "bcast") {
    validate_bcast(t(0, "tensor"), i64(1, "src"), sz(2));
  } else if (o == "all_gather") {
    validate_all_gather(to_blocks(a[0], op, "output", false), t(1, "input"), sz(2));
  } else if (o == "gather") {
    validate_gather(to_blocks(a[0], op, "output", true), t(1, "input"), i64(2, "dst"),
                    (int)i64(3, "rank"), sz(4));
  } else if (o == "scatter") {
    validate_scatter(t(0, "output"), to_blocks(a[1], op, "input", true), i64(2, "src"),
                     (int)i64(3, "rank"), sz(4));
  } else if (o == "reduce_scatter") {
    validate_reduce_scatter(t(0, "output"), to_blocks(a[1], op, "input", false),
                            (int)i64(2, "op"), sz(3));
  } else if (o == "all_to_all_single") {
    auto r = validate_all_to_all_single(t(0, "output"), t(1, "input"),
                                        to_counts(a[2], op, "output_split_sizes", true),
                                        to_counts(a[3], op, "input_split_sizes", true), sz(4));
    return py::make_tuple(r.first, r.second);
  } else if (o == "all_to_all") {
    validate_all_to_all(to_tensor_list(a[0], op, "output_list"),
                        to_tensor_list(a[1], op, "input_list"), sz(2));
  } else if (o == "gatherv") {
    at::Tensor s;
    return py::cast(validate_gatherv(to_tensor_opt(a[0], op, "output", s), t(1, "input"),
                                     *to_counts(a[2], op, "counts", false),
                                     to_counts(a[3], op, "displs", true), i64(4, "dst"),
                                     (int)i64(5, "rank"), sz(6)));
  } else if (o == "scatterv") {
    at::Tensor s;
    return py::cast(validate_scatterv(t(0, "output"), to_tensor_opt(a[1], op, "input", s),
                                      *to_counts(a[2], op, "counts", false),
                                      to_counts(a[3], op, "displs", true), i64(4, "src"),
                                      (int)i64(5, "rank"), sz(6)));
  } else if (o == "all_gatherv") {
    return py::cast(validate_all_gatherv(t(0, "output"), t(1, "input"),
                                         *to_counts(a[2], op, "counts", false),
                                         to_counts(a[3], op, "displs", true), (int)i64(4, "rank"),
                                         sz(5)));
  } else if (o == "all_to_allv") {
    auto r = validate_all_to_allv(t(0, "output"), t(1, "input"),
                                  *to_counts(a[2], op, "send_counts", false),
                                  *to_counts(a[3], op, "recv_counts", false),
                                  to_counts(a[4], op, "send_displs", true),
                                  to_counts(a[5], op, "recv_displs", true), sz(6));
    return py::make_tuple(r.first, r.second);
  } else if (o == "send" || o == "recv") {
    validate_p2p(o == "send" ? "send" : "recv", t(0, "tensor"), i64(1, o == "send" ? "dst" : "src"),
                 i64(2, "tag"), (int)i64(3, "rank"), sz(4));
  } else {
    throw_invalid("validate: unknown operation '" + o + "'");
  }
  return py::none();
}

}  // namespace

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

  py::class_<Work, std::shared_ptr<Work>>(m, "Work",
                                          "Handle of an async operation (API.md 'Work').")
      .def("wait",
           [](Work& w, std::optional<double> timeout) {
             py::gil_scoped_release nogil;
             w.wait(timeout ? *timeout : -1.0);
             return true;
           },
           py::arg("timeout") = py::none(),
           "Block until the op completed; raise CommTimeoutError after `timeout` seconds "
           "(default: the init timeout). Returns True.")
      .def("is_completed", &Work::is_completed)
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
      .def_property_readonly("name", &Lane::name);

  m.def("set_idle_sleep", &set_idle_sleep, py::arg("on"),
        "Idle lane threads sleep in slices growing to 1 ms (not 50 us): for ranks outnumbering cores.");
  m.def("set_poll_spins", &set_poll_spins, py::arg("n"),
        "Polls a waiter makes before yielding the CPU between polls (0: yield at once).");
  m.def("validate", &validate_binding, py::arg("op"),
        "validate(op, *args): the local argument checks of operation `op` (see validate.h for "
        "the argument order); raises InvalidArgumentError. v variants return filled displs.");
  bind_mpi(m);
  bind_pccl(m);
  bind_fusion(m);
}
