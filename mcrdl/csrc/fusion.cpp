// The copies of tensor fusion (mcrdl/fusion/): the callers' tensors into
// one flat fused buffer, and consecutive slices of it back, one memcpy per tensor of any
// shape. torch.cat needs 1-D views first and torch.split_with_sizes_copy goes through
// the dispatcher at ~0.5 us per tensor; these take ~0.03 us.
#include <ATen/ops/empty.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstring>
#include <deque>
#include <optional>

#include "gil.h"
#include "pyargs.h"
#include "validate.h"

#include <structmember.h>

#include <pybind11/stl.h>

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
    if (!is_tensor(item.ptr()))
      throw_invalid(std::string(op) + ": the list holds a " + type_name(item) + ", not a tensor");
    const at::Tensor& t = unpack_tensor(item.ptr());
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

// Tensor fusion's buffer of calls (mcrdl/fusion/__init__.py and buffer.py have the design: issue
// order, agreement rounds, flushes). The Python FusionStream of a (backend, group) owns a
// FusionQueue; the per-call work (validate, record the call, return its handle) and the
// per-flush work over every call (cut by fusion key and B bytes, pack, copy back, mark
// posted) are here. The per-call types (_C.FusedCall, _C.FusionQueue) are written
// against the C API: a pybind11 method call costs ~0.2 us and creating a pybind11
// object ~0.4 us, several times a whole fused call's budget.
//
// Everything here runs with the GIL held and never releases it (but in the copies), so a
// call of these methods is atomic with respect to the stream's other Python threads.

// A call's kind is an index into the owning stream's `kind_names` (a Python tuple built
// from mcrdl.ops, the one place that names the operations). The fast path below posts
// all_reduce, whose index the Python side checks against kAllReduce at import.
constexpr int kAllReduce = 0;

double monotonic_s() {  // = Python's time.monotonic() (CLOCK_MONOTONIC)
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

PyObject* interned(const char* s) { return PyUnicode_InternFromString(s); }  // never freed

// -- _C.FusedCall: one buffered call, and the caller's Work for it -----------------------
// wait/is_completed return at once when the call's batch is done; otherwise the stream's
// Python slow path (FusionStream.wait_call / poll_call) runs.
struct FusedCallObject {
  PyObject_HEAD
  long long seq, param, nbytes;
  int kind, dtype;  // FusedKind, at::ScalarType
  double t;         // time.monotonic() at issue
  PyObject* args;   // the call's arguments (a tuple)
  PyObject* stream;
  PyObject* batch;  // None until posted
  PyObject* error;  // None, or what the call failed with
  char posted;
};

extern PyTypeObject FusedCallType;

FusedCallObject* as_call(PyObject* o) { return reinterpret_cast<FusedCallObject*>(o); }

// Is the call's batch done? (-1: a Python error is set)
int call_done(FusedCallObject* c) {
  if (c->batch == Py_None) return 0;
  static PyObject* done = interned("done");
  PyObject* v = PyObject_GetAttr(c->batch, done);
  if (!v) return -1;
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  return r;
}

PyObject* call_wait(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* timeout = nargs > 0 ? args[0] : Py_None;
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs > 1 || nargs + nkw > 1 ||
      (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout"))) {
    PyErr_SetString(PyExc_TypeError, "wait() takes one optional argument, 'timeout'");
    return nullptr;
  }
  if (nkw == 1) timeout = args[nargs];
  int done = call_done(as_call(self));
  if (done < 0) return nullptr;
  if (done) {
    if (timeout != Py_None) {  // the stream's wait_call checks it otherwise
      PyObject* rule = wait_timeout_rule();
      PyObject* ok = rule ? PyObject_CallOneArg(rule, timeout) : nullptr;
      if (!ok) return nullptr;
      Py_DECREF(ok);
    }
    Py_RETURN_TRUE;
  }
  static PyObject* name = interned("wait_call");
  return PyObject_CallMethodObjArgs(as_call(self)->stream, name, self, timeout, nullptr);
}

PyObject* call_is_completed(PyObject* self, PyObject*) {
  int done = call_done(as_call(self));
  if (done < 0) return nullptr;
  if (done) Py_RETURN_TRUE;
  static PyObject* name = interned("poll_call");
  return PyObject_CallMethodObjArgs(as_call(self)->stream, name, self, nullptr);
}

PyObject* call_backend(PyObject* self, void*) {
  return PyObject_GetAttrString(as_call(self)->stream, "backend");
}

PyObject* call_repr(PyObject* self) {
  FusedCallObject* c = as_call(self);
  int done = call_done(c);
  if (done < 0) return nullptr;
  PyObject* backend = call_backend(self, nullptr);
  if (!backend) return nullptr;
  PyObject* names = PyObject_GetAttrString(c->stream, "kind_names");
  PyObject* kind = names ? PySequence_GetItem(names, c->kind) : nullptr;
  Py_XDECREF(names);
  if (!kind) {
    Py_DECREF(backend);
    return nullptr;
  }
  PyObject* r = PyUnicode_FromFormat("<mcrdl fused %S #%lld on '%S' %s>", kind, c->seq,
                                     backend, done ? "done" : c->posted ? "posted" : "buffered");
  Py_DECREF(kind);
  Py_DECREF(backend);
  return r;
}

int call_traverse(PyObject* self, visitproc visit, void* arg) {
  FusedCallObject* c = as_call(self);
  Py_VISIT(c->args);
  Py_VISIT(c->stream);
  Py_VISIT(c->batch);
  Py_VISIT(c->error);
  return 0;
}

int call_clear(PyObject* self) {
  FusedCallObject* c = as_call(self);
  Py_CLEAR(c->args);
  Py_CLEAR(c->stream);
  Py_CLEAR(c->batch);
  Py_CLEAR(c->error);
  return 0;
}

void call_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  call_clear(self);
  Py_TYPE(self)->tp_free(self);
}

// batch and error are assignable but never NULL (None when unset).
int call_set_object(PyObject* self, PyObject* value, void* field) {
  if (!value) {
    PyErr_SetString(PyExc_AttributeError, "cannot delete this attribute");
    return -1;
  }
  PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) +
                                                 reinterpret_cast<size_t>(field));
  Py_INCREF(value);
  Py_SETREF(*slot, value);
  return 0;
}

PyObject* call_get_object(PyObject* self, void* field) {
  PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) +
                                             reinterpret_cast<size_t>(field));
  Py_INCREF(v);
  return v;
}

PyMethodDef call_methods[] = {
    {"wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_wait)),
     METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None): block until the call's result is in its tensors (raise "
     "CommTimeoutError after `timeout` seconds, default: the init timeout). Returns True."},
    {"is_completed", call_is_completed, METH_NOARGS, "True once the result is in the tensors."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef call_members[] = {
    {"seq", T_LONGLONG, offsetof(FusedCallObject, seq), READONLY, "issue order in the stream"},
    {"param", T_LONGLONG, offsetof(FusedCallObject, param), READONLY, "reduce op or root"},
    {"nbytes", T_LONGLONG, offsetof(FusedCallObject, nbytes), READONLY, "bytes it adds to B"},
    {"kind", T_INT, offsetof(FusedCallObject, kind), READONLY, "index into the stream's kind_names"},
    {"t", T_DOUBLE, offsetof(FusedCallObject, t), READONLY, "time.monotonic() at issue"},
    {"args", T_OBJECT, offsetof(FusedCallObject, args), READONLY, "the call's arguments"},
    {"posted", T_BOOL, offsetof(FusedCallObject, posted), 0, "handed to the backend"},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef call_getset[] = {
    {"backend", call_backend, nullptr, "the backend that runs it", nullptr},
    {"batch", call_get_object, call_set_object, "the fused call it went out in (None before)",
     reinterpret_cast<void*>(offsetof(FusedCallObject, batch))},
    {"error", call_get_object, call_set_object, "what it failed with, or None",
     reinterpret_cast<void*>(offsetof(FusedCallObject, error))},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject FusedCallType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "mcrdl._C.FusedCall";
  t.tp_doc = "A call buffered by tensor fusion, and its Work.";
  t.tp_basicsize = sizeof(FusedCallObject);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  t.tp_dealloc = call_dealloc;
  t.tp_traverse = call_traverse;
  t.tp_clear = call_clear;
  t.tp_repr = call_repr;
  t.tp_methods = call_methods;
  t.tp_members = call_members;
  t.tp_getset = call_getset;
  return t;
}();

// A new FusedCall, not yet posted (args and stream: new references are taken).
py::object new_call(int64_t seq, int kind, int64_t param, at::ScalarType dtype, int64_t nbytes,
                    double t, PyObject* args, PyObject* stream) {
  FusedCallObject* c = PyObject_GC_New(FusedCallObject, &FusedCallType);
  if (!c) throw py::error_already_set();
  c->seq = seq;
  c->param = param;
  c->nbytes = nbytes;
  c->kind = kind;
  c->dtype = static_cast<int>(dtype);
  c->t = t;
  c->posted = 0;
  for (auto [field, value] : {std::pair{&c->args, args}, std::pair{&c->stream, stream},
                              std::pair{&c->batch, Py_None}, std::pair{&c->error, Py_None}}) {
    Py_INCREF(value);
    *field = value;
  }
  PyObject_GC_Track(c);
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(c));
}

// -- runs and chunks (per flush: pybind11) ---------------------------------------------

// The calls issued between two unfusable calls of a stream: one item of the stream's
// queue, in place of its calls. `seq` and `t` are those of its oldest remaining call.
struct FusedRun {
  std::deque<py::object> calls;  // FusedCallObject
  FusedCallObject* front() const { return as_call(calls.front().ptr()); }
};
using RunPtr = std::shared_ptr<FusedRun>;

// Every call gets the error (unless it has one) and counts as posted.
template <typename Calls>
void fail_calls(const Calls& calls, const py::object& exc) {
  for (const auto& o : calls) {
    FusedCallObject* c = as_call(o.ptr());
    if (c->error == Py_None) call_set_object(o.ptr(), exc.ptr(), reinterpret_cast<void*>(offsetof(FusedCallObject, error)));
    c->posted = 1;
  }
}

// Copies of fewer bytes keep the GIL: taking it back can wait for another thread's turn.
constexpr size_t kReleaseGil = 4 << 20;

// Fused buffers for reuse: a fresh one of a few hundred KiB costs a page fault per 4 KiB
// on first touch (as long as the copy into it). One spare: the buffer of the latest
// completed fused call; unpack() returns a buffer once its call completed.
struct BufferPool {
  at::Tensor spare;  // flat uint8

  at::Tensor get(size_t nbytes, at::ScalarType dtype) {
    const int64_t esize = c10::elementSize(dtype);
    at::Tensor bytes;
    if (spare.defined() && (size_t)spare.numel() >= nbytes) {
      bytes = std::move(spare);
      spare = at::Tensor();
    } else {
      bytes = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte));
    }
    return bytes.narrow(0, 0, static_cast<int64_t>(nbytes)).view(dtype).view({(int64_t)nbytes / esize});
  }
  void put(const at::Tensor& buf) {
    if (!buf.is_cpu() || buf.storage_offset() != 0 || !buf.is_contiguous()) return;
    const auto& st = buf.storage();
    if (st.use_count() > 2) return;  // someone else still holds it
    if (!spare.defined() || (size_t)spare.numel() < st.nbytes())
      spare = at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(st, 0, {(int64_t)st.nbytes()}, {1});
  }
};

// The calls of one fused backend call: one fusion key, at most B bytes (unless a single
// call), in issue order.
struct FusedChunk {
  std::vector<py::object> calls;
  int64_t nbytes = 0;
  std::shared_ptr<BufferPool> pool;

  FusedCallObject* at(size_t i) const { return as_call(calls[i].ptr()); }

  // (data, bytes) of the first argument of every call (the tensors of all_reduce / bcast,
  // the outputs of reduce_scatter); the calls' argument tuples keep the tensors alive.
  std::vector<std::pair<char*, size_t>> firsts(size_t& total) const {
    std::vector<std::pair<char*, size_t>> v;
    v.reserve(calls.size());
    total = 0;
    for (size_t i = 0; i < calls.size(); ++i) {
      const at::Tensor& t = unpack_tensor(PyTuple_GET_ITEM(at(i)->args, 0));
      const size_t n = t.nbytes();
      v.emplace_back(n ? static_cast<char*>(t.data_ptr()) : nullptr, n);
      total += n;
    }
    return v;
  }
  at::Tensor pack() const {
    size_t total = 0;
    auto parts = firsts(total);
    const at::Tensor& first = unpack_tensor(PyTuple_GET_ITEM(at(0)->args, 0));
    at::Tensor buf = pool->get(total, first.scalar_type());
    char* dst = static_cast<char*>(buf.data_ptr());
    std::optional<py::gil_scoped_release> nogil;
    if (total >= kReleaseGil) nogil.emplace();
    for (const auto& [p, n] : parts) {
      if (n) std::memcpy(dst, p, n);
      dst += n;
    }
    return buf;
  }
  // Copies back, then hands `buf` to the pool: call it once the fused call completed.
  void unpack(const at::Tensor& buf) const {
    size_t total = 0;
    auto parts = firsts(total);
    if (total > buf.nbytes())
      throw_invalid("unpack: the calls hold " + std::to_string(total) + " bytes, the buffer " +
                    std::to_string(buf.nbytes()));
    const char* src = static_cast<const char*>(buf.data_ptr());
    {
      std::optional<py::gil_scoped_release> nogil;
      if (total >= kReleaseGil) nogil.emplace();
      for (const auto& [p, n] : parts) {
        if (n) std::memcpy(p, src, n);
        src += n;
      }
    }
    pool->put(buf);
  }
};

// The cutting rule of a flush: the calls of each fusion key (kind, dtype, param) in order
// of the key's first call, each key's calls cut into runs of at most `limit` bytes by
// their sizes alone (the same on every rank).
std::vector<FusedChunk> cut(const std::vector<py::object>& calls, int64_t limit) {
  auto same_key = [](const FusedCallObject* a, const FusedCallObject* b) {
    return a->kind == b->kind && a->dtype == b->dtype && a->param == b->param;
  };
  std::vector<std::vector<py::object>> keys;  // in order of each key's first call
  for (const auto& c : calls) {
    auto it = std::find_if(keys.begin(), keys.end(), [&](const auto& k) {
      return same_key(as_call(k.front().ptr()), as_call(c.ptr()));
    });
    if (it == keys.end())
      keys.push_back({c});
    else
      it->push_back(c);
  }
  std::vector<FusedChunk> out;
  for (const auto& k : keys) {
    FusedChunk chunk;
    for (const auto& c : k) {
      const int64_t n = as_call(c.ptr())->nbytes;
      if (!chunk.calls.empty() && chunk.nbytes + n > limit) {
        out.push_back(std::move(chunk));
        chunk = FusedChunk();
      }
      chunk.calls.push_back(c);
      chunk.nbytes += n;
    }
    out.push_back(std::move(chunk));
  }
  return out;
}

// The T-timer of a stream: fires once the oldest buffered call is T old and was not
// taken by then, and only then takes the GIL to have the stream flush. A Python thread
// would need the GIL just to start waiting, taking it from the thread issuing the calls
// each time a stream goes from idle to busy (measured: +0.1-0.4 ms per round of 512
// calls at 2 ranks).
std::atomic<bool> g_python_alive{true};  // false from atexit on: never take the GIL again

class FusionTimer {
 public:
  explicit FusionTimer(py::object stream) : stream_(std::move(stream)) {}
  ~FusionTimer() { stop(); }

  // Fire at `due` (monotonic seconds) unless the call `seq` was taken by then. An armed
  // call still buffered keeps the timer (it is older).
  void arm(int64_t seq, double due) {
    bool wake;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stopped_) return;
      if (armed_ != 0 && taken_.load() < armed_) return;
      armed_ = seq;
      due_ = due;
      if (!thread_.joinable()) {
        user_ = std::make_unique<GilUser>();  // fire() takes the GIL
        thread_ = std::thread([this] { loop(); });
      }
      // A thread waiting for an earlier due time finds the new one when it wakes: only
      // an idle thread needs a wake-up (each is a context switch on a busy core).
      wake = idle_;
    }
    if (wake) cv_.notify_one();
  }
  void taken_upto(int64_t seq) {
    if (seq > taken_.load()) taken_.store(seq);
  }
  // Stop and join (releases the GIL while joining: the thread may be waiting for it).
  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopped_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      if (PyGILState_Check()) {
        py::gil_scoped_release nogil;
        thread_.join();
      } else {
        thread_.join();
      }
      user_.reset();
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!stopped_) {
      if (armed_ == 0) {
        idle_ = true;
        cv_.wait(lk);
        idle_ = false;
        continue;
      }
      const auto due = Clock::time_point(std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(due_)));
      if (Clock::now() < due) {
        cv_.wait_until(lk, due);
        continue;
      }
      const int64_t seq = armed_;
      armed_ = 0;
      if (taken_.load() >= seq || !g_python_alive.load()) continue;
      lk.unlock();
      fire();
      lk.lock();
    }
  }
  void fire() {
    py::gil_scoped_acquire gil;
    if (!g_python_alive.load()) return;
    try {
      PyObject* s = PyWeakref_GetObject(stream_.ptr());
      if (s != Py_None) py::handle(s).attr("_on_timer")();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("mcrdl fusion timer");
    }
  }

  py::object stream_;  // weak reference to the FusionStream
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
  std::unique_ptr<GilUser> user_;  // while the thread lives
  bool stopped_ = false;
  bool idle_ = true;   // waiting with no due time (or not started)
  int64_t armed_ = 0;  // 0: not armed
  double due_ = 0;
  std::atomic<int64_t> taken_{0};
};

// -- _C.FusionQueue ----------------------------------------------------------------------
struct FusionQueueState {
  py::object stream;  // a weak reference to the Python FusionStream (it owns this queue)
  py::object items;   // its queue (collections.deque): runs beside deferred tasks
  py::object fallback = py::none();  // all_reduce(tensor, op, group, async_op) of the rest
  std::shared_ptr<BufferPool> pool = std::make_shared<BufferPool>();
  std::unique_ptr<FusionTimer> timer;
  int64_t limit = 0, seq = 0, buffered = 0;
  double wait_s = 0;  // T
  bool failed = false;
  RunPtr open;  // the run new calls join (the queue's tail), if any

  py::object owner() const {
    PyObject* s = PyWeakref_GetObject(stream.ptr());
    if (s == Py_None) throw Error(ErrorKind::BackendUnavailable, "fusion: the stream is gone");
    return py::reinterpret_borrow<py::object>(s);
  }

  // Buffer a call (validated by the caller); `wake`: start the worker's timer when the
  // stream was idle (False: the caller flushes the call itself).
  py::object add(int kind, int64_t param, at::ScalarType dtype, int64_t nbytes,
                 PyObject* args, bool wake) {
    if (failed) owner().attr("_check")();  // raises
    py::object call = new_call(++seq, kind, param, dtype, nbytes, monotonic_s(), args,
                               owner().ptr());
    FusedCallObject* c = as_call(call.ptr());
    bool first = false;
    if (!open) {
      first = PyObject_Length(items.ptr()) == 0;
      open = std::make_shared<FusedRun>();
      items.attr("append")(py::cast(open));
    }
    open->calls.push_back(call);
    buffered += nbytes;
    if (buffered >= limit)
      owner().attr("_wake")(c->seq);  // flush soon
    else if (first && wake)
      timer->arm(c->seq, c->t + wait_s);  // the timer starts from the oldest buffered call
    return call;
  }

  // Take the `count` oldest calls of `run` (the head item), cut (see cut()). Returns
  // (chunks, run now empty: pop it).
  std::pair<std::vector<FusedChunk>, bool> take(const RunPtr& run, int64_t count) {
    if (count < 1 || count > (int64_t)run->calls.size())
      throw_invalid("fusion: cannot take " + std::to_string(count) + " of " +
                    std::to_string(run->calls.size()) + " buffered calls");
    std::vector<py::object> calls(run->calls.begin(), run->calls.begin() + count);
    run->calls.erase(run->calls.begin(), run->calls.begin() + count);
    const bool empty = run->calls.empty();
    if (empty && open == run) open.reset();
    timer->taken_upto(as_call(calls.back().ptr())->seq);
    if (!empty) timer->arm(run->front()->seq, run->front()->t + wait_s);
    for (const auto& c : calls) buffered -= as_call(c.ptr())->nbytes;
    auto chunks = cut(calls, limit);
    for (auto& ch : chunks) ch.pool = pool;
    return {std::move(chunks), empty};
  }
};

struct FusionQueueObject {
  PyObject_HEAD
  FusionQueueState* q;
};

FusionQueueState& state(PyObject* self) { return *reinterpret_cast<FusionQueueObject*>(self)->q; }

// Runs `f` (returning a py::object) and turns C++ exceptions into Python errors.
template <typename F>
PyObject* guarded(F&& f) {
  try {
    return f().release().ptr();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyObject* queue_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  static const char* kw[] = {"stream", "items", "limit", "wait_s", nullptr};
  PyObject *stream, *items;
  long long limit;
  double wait_s;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLd", const_cast<char**>(kw), &stream, &items,
                                   &limit, &wait_s))
    return nullptr;
  PyObject* ref = PyWeakref_NewRef(stream, nullptr);
  if (!ref) return nullptr;
  auto* self = reinterpret_cast<FusionQueueObject*>(type->tp_alloc(type, 0));
  if (!self) {
    Py_DECREF(ref);
    return nullptr;
  }
  self->q = new FusionQueueState();
  self->q->stream = py::reinterpret_steal<py::object>(ref);
  self->q->items = py::reinterpret_borrow<py::object>(items);
  self->q->limit = limit;
  self->q->wait_s = wait_s;
  self->q->timer = std::make_unique<FusionTimer>(self->q->stream);
  return reinterpret_cast<PyObject*>(self);
}

int queue_traverse(PyObject* self, visitproc visit, void* arg) {
  FusionQueueState* q = reinterpret_cast<FusionQueueObject*>(self)->q;
  if (q) {
    Py_VISIT(q->stream.ptr());
    Py_VISIT(q->items.ptr());
    Py_VISIT(q->fallback.ptr());
  }
  return 0;
}

int queue_clear(PyObject* self) {
  FusionQueueState* q = reinterpret_cast<FusionQueueObject*>(self)->q;
  if (q) {
    q->fallback = py::none();
    q->open.reset();
  }
  return 0;
}

void queue_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  delete reinterpret_cast<FusionQueueObject*>(self)->q;
  reinterpret_cast<FusionQueueObject*>(self)->q = nullptr;
  Py_TYPE(self)->tp_free(self);
}

// add_all_reduce(tensor, op, async_op): all_reduce's whole fast path, validate then
// buffer; None when the call is not fused (B bytes or more, or not a CPU tensor): the
// caller posts it in order instead.
PyObject* queue_add_all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> py::object {
    if (nargs != 3) throw_invalid("add_all_reduce(tensor, op, async_op)");
    const at::Tensor& t = to_tensor(args[0], "all_reduce", "tensor");
    const int code = to_reduce_code(args[1], "all_reduce");
    validate_all_reduce(t, code);
    FusionQueueState& q = state(self);
    const int64_t nbytes = static_cast<int64_t>(t.nbytes());
    if (nbytes >= q.limit || !t.is_cpu()) return py::none();
    py::object tup = py::reinterpret_steal<py::object>(PyTuple_Pack(1, args[0]));
    if (!tup) throw py::error_already_set();
    return q.add(kAllReduce, code, t.scalar_type(), nbytes, tup.ptr(),
                 PyObject_IsTrue(args[2]) == 1);
  });
}

// all_reduce(tensor, op, group, async_op): the fused all_reduce of this stream (the world
// group's): validate, buffer, return the Work (async) or wait for it (blocking). Calls of
// other groups and calls that are not fused go to the fallback.
PyObject* queue_all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> py::object {
    if (nargs != 4) throw_invalid("all_reduce(tensor, op, group, async_op)");
    FusionQueueState& q = state(self);
    auto fallback = [&] {
      return q.fallback(py::handle(args[0]), py::handle(args[1]), py::handle(args[2]),
                        py::handle(args[3]));
    };
    if (args[2] != Py_None || !is_tensor(args[0])) return fallback();
    const at::Tensor& t = unpack_tensor(args[0]);
    const int code = to_reduce_code(args[1], "all_reduce");
    validate_all_reduce(t, code);
    const int64_t nbytes = static_cast<int64_t>(t.nbytes());
    if (nbytes >= q.limit || !t.is_cpu()) return fallback();
    const bool async_op = PyObject_IsTrue(args[3]) == 1;
    py::object tup = py::reinterpret_steal<py::object>(PyTuple_Pack(1, args[0]));
    if (!tup) throw py::error_already_set();
    py::object call = q.add(kAllReduce, code, t.scalar_type(), nbytes, tup.ptr(), async_op);
    if (async_op) return call;
    py::object r = py::reinterpret_steal<py::object>(call_wait(call.ptr(), nullptr, 0, nullptr));
    if (!r) throw py::error_already_set();
    return py::none();
  });
}

PyObject* queue_set_fallback(PyObject* self, PyObject* fn) {
  state(self).fallback = py::reinterpret_borrow<py::object>(fn);
  Py_RETURN_NONE;
}

// add(kind, param, tensor, nbytes, args, wake): buffer a validated call; its fusion key
// is (kind, the dtype of `tensor`, param).
PyObject* queue_add(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> py::object {
    if (nargs != 6 || !PyTuple_Check(args[4]))
      throw_invalid("add(kind, param, tensor, nbytes, args: tuple, wake)");
    const at::Tensor& t = to_tensor(args[2], "fusion", "tensor");
    return state(self).add(static_cast<int>(to_int(args[0], "fusion", "kind")),
                           to_int(args[1], "fusion", "param"), t.scalar_type(),
                           to_int(args[3], "fusion", "nbytes"), args[4],
                           PyObject_IsTrue(args[5]) == 1);
  });
}

// push_task(task): queue a deferred unfusable task after every call issued so far.
PyObject* queue_push_task(PyObject* self, PyObject* task) {
  return guarded([&]() -> py::object {
    FusionQueueState& q = state(self);
    py::handle(task).attr("seq") = ++q.seq;
    q.open.reset();
    q.items.attr("append")(py::handle(task));
    return py::none();
  });
}

// take(run, count) -> (chunks, emptied)
PyObject* queue_take(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> py::object {
    if (nargs != 2) throw_invalid("take(run, count)");
    auto r = state(self).take(py::handle(args[0]).cast<RunPtr>(), to_int(args[1], "take", "count"));
    return py::make_tuple(py::cast(std::move(r.first)), r.second);
  });
}

PyObject* queue_set_failed(PyObject* self, PyObject*) {
  state(self).failed = true;
  state(self).open.reset();
  Py_RETURN_NONE;
}

PyObject* queue_close(PyObject* self, PyObject*) {
  state(self).timer->stop();
  Py_RETURN_NONE;
}

PyObject* queue_seq(PyObject* self, void*) { return PyLong_FromLongLong(state(self).seq); }
PyObject* queue_buffered(PyObject* self, void*) {
  return PyLong_FromLongLong(state(self).buffered);
}

#define MCRDL_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f))
PyMethodDef queue_methods[] = {
    {"add_all_reduce", MCRDL_FASTCALL(queue_add_all_reduce), METH_FASTCALL,
     "add_all_reduce(tensor, op, async_op) -> FusedCall, or None when not fusable"},
    {"add", MCRDL_FASTCALL(queue_add), METH_FASTCALL,
     "add(kind, param, tensor, nbytes, args, wake) -> FusedCall (fusion key: kind, "
     "tensor's dtype, param)"},
    {"all_reduce", MCRDL_FASTCALL(queue_all_reduce), METH_FASTCALL,
     "all_reduce(tensor, op, group, async_op): fused all_reduce on the world group (others "
     "and unfusable calls: the fallback)"},
    {"set_fallback", queue_set_fallback, METH_O,
     "set_fallback(fn): all_reduce(tensor, op, group, async_op) for the calls all_reduce "
     "does not fuse itself"},
    {"push_task", queue_push_task, METH_O, "Queue a deferred task after every call so far."},
    {"take", MCRDL_FASTCALL(queue_take), METH_FASTCALL,
     "take(run, count) -> (chunks, emptied): the run's `count` oldest calls, cut by fusion "
     "key and B bytes"},
    {"close", queue_close, METH_NOARGS, "Stop the timer thread."},
    {"set_failed", queue_set_failed, METH_NOARGS,
     "The stream failed: later calls raise its error (FusionStream._check)."},
    {nullptr, nullptr, 0, nullptr}};
#undef MCRDL_FASTCALL

PyGetSetDef queue_getset[] = {
    {"seq", queue_seq, nullptr, "sequence number of the latest item", nullptr},
    {"buffered", queue_buffered, nullptr, "bytes of buffered calls", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject FusionQueueType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "mcrdl._C.FusionQueue";
  t.tp_doc = "FusionQueue(stream, items, limit, wait_s): tensor fusion's buffer of one "
             "(backend, group), B = limit bytes, T = wait_s; see csrc/fusion.cpp.";
  t.tp_basicsize = sizeof(FusionQueueObject);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  t.tp_new = queue_new;
  t.tp_dealloc = queue_dealloc;
  t.tp_traverse = queue_traverse;
  t.tp_clear = queue_clear;
  t.tp_methods = queue_methods;
  t.tp_getset = queue_getset;
  return t;
}();

}  // namespace

void bind_fusion(py::module_& m) {
  m.def("pack_flat", &pack_flat, py::arg("srcs"),
        "A new flat tensor holding the contiguous CPU tensors `srcs` (one dtype, any shapes) "
        "one after the other: the buffer of a fused call.");
  m.def("unpack_flat", &unpack_flat, py::arg("buf"), py::arg("dsts"),
        "Copy consecutive slices of the flat contiguous CPU tensor `buf` into the contiguous "
        "CPU tensors `dsts` (same dtype), in order: the copy-back of a fused call.");

  using py::arg;
  for (auto [type, name] : {std::pair{&FusedCallType, "FusedCall"},
                            std::pair{&FusionQueueType, "FusionQueue"}}) {
    if (PyType_Ready(type) < 0) throw py::error_already_set();
    Py_INCREF(type);
    m.add_object(name, py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(type)));
  }

  py::class_<FusedRun, RunPtr>(m, "FusedRun",
                               "Calls buffered between two unfusable calls: one queue item.")
      .def_property_readonly("seq", [](const FusedRun& r) { return r.front()->seq; })
      .def_property_readonly("t", [](const FusedRun& r) { return r.front()->t; })
      .def("__len__", [](const FusedRun& r) { return r.calls.size(); })
      .def("fail", [](FusedRun& r, py::object exc) { fail_calls(r.calls, exc); }, arg("exc"),
           "Every call gets the error (unless it has one) and counts as posted.");

  py::class_<FusedChunk>(m, "FusedChunk", "The calls of one fused backend call.")
      .def_property_readonly("kind", [](const FusedChunk& c) { return c.at(0)->kind; })
      .def_property_readonly("param", [](const FusedChunk& c) { return c.at(0)->param; })
      .def_readonly("nbytes", &FusedChunk::nbytes)
      .def_readonly("calls", &FusedChunk::calls)
      .def("__len__", [](const FusedChunk& c) { return c.calls.size(); })
      .def("pack", &FusedChunk::pack,
           "A new flat tensor holding the first argument of every call, in order.")
      .def("unpack", &FusedChunk::unpack, arg("buf"),
           "Copy consecutive slices of `buf` back into the first argument of every call.")
      .def("posted",
           [](FusedChunk& ch, py::object batch) {
             for (size_t i = 0; i < ch.calls.size(); ++i) {
               call_set_object(ch.calls[i].ptr(), batch.ptr(),
                               reinterpret_cast<void*>(offsetof(FusedCallObject, batch)));
               ch.at(i)->posted = 1;
             }
           },
           arg("batch"), "Every call was posted as part of `batch`.")
      .def("fail", [](FusedChunk& ch, py::object exc) { fail_calls(ch.calls, exc); }, arg("exc"),
           "Every call gets the error (unless it has one) and counts as posted.");

  m.def("_fusion_atexit", [] { g_python_alive.store(false); },
        "Registered with atexit: fusion timers never take the GIL again.");
  py::module_::import("atexit").attr("register")(m.attr("_fusion_atexit"));

  m.def("fusion_cut",
        [](const std::vector<std::tuple<int, int64_t, int64_t>>& calls, int64_t limit) {
          // (kind, param, nbytes) per call -> the calls' indices per chunk
          std::vector<py::object> v;
          for (size_t i = 0; i < calls.size(); ++i)
            v.push_back(new_call((int64_t)i, std::get<0>(calls[i]), std::get<1>(calls[i]),
                                 at::kFloat, std::get<2>(calls[i]), 0.0, Py_None, Py_None));
          std::vector<std::vector<int64_t>> out;
          for (const auto& ch : cut(v, limit)) {
            out.emplace_back();
            for (size_t i = 0; i < ch.calls.size(); ++i) out.back().push_back(ch.at(i)->seq);
          }
          return out;
        },
        arg("calls"), arg("limit"),
        "The cutting rule of a flush on calls given as (kind, param, nbytes) (one dtype): "
        "the indices of the calls of each fused call.");
}

}  // namespace mcrdl
