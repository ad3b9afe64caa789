// The "mpi" backend's hot path: every operation of API.md posted as one nonblocking
// MPI call on a communicator owned by this backend, then driven to completion by the
// caller (blocking ops, with a deadline) or by the backend's lane thread (async ops).
//
// A blocking call (async_op=False) of a collective may instead run as the blocking MPI
// collective: MPICH's blocking small collectives take its shared-memory fast path and
// are several times faster than the nonblocking ones, which in turn win at some larger
// sizes. BlockingChoice holds, per op, which variant each size runs (set from Python:
// the tuning table, else mcrdl/tuning/mpi_blocking.json, MCRDL_MPI_BLOCKING overriding).
// Ordering: every op of a communicator, either variant, is issued in the order of the
// calls (under post_mu_, or by the communicator's Issuer thread while it has ops queued
// or a blocking call runs). Timeouts: the watchdog (watchdog.h).
//
// The CPython fast path over the hot ops (argument parsing, direct calls) is mpi_fast.cpp.
//
// Types MPI lacks (float16, bfloat16) move as 16-bit words and reduce in float32.
// bool reduces as uint8 0/1 with bitwise ops (SUM/MAX = or, PRODUCT/MIN = and).
#include <mpi.h>

#include <c10/core/GradMode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <chrono>
#include <climits>
#include <cstddef>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <unordered_map>
#include <utility>

#include <pybind11/stl.h>

#include "launch_work.h"
#include "mpi_util.h"
#include "pyargs.h"
#include "gil.h"
#include "issuer.h"
#include "mpi_fast.h"
#include "watchdog.h"

namespace mcrdl {

namespace {

struct ReducePlan {
  MPI_Op op;
  MPI_Datatype type;
  bool upcast;  // reduce a float32 copy (float16/bfloat16)
  bool average;
};

C10_ALWAYS_INLINE ReducePlan reduce_plan(at::ScalarType t, int code) {
  if (t == at::kBool) {
    switch (code) {
      case SUM: case MAX: case BOR: return {MPI_BOR, MPI_UINT8_T, false, false};
      case PRODUCT: case MIN: case BAND: return {MPI_BAND, MPI_UINT8_T, false, false};
      default: return {MPI_BXOR, MPI_UINT8_T, false, false};
    }
  }
  bool half = t == at::kHalf || t == at::kBFloat16;
  MPI_Datatype type = half ? MPI_FLOAT : move_type(t);
  MPI_Op op = MPI_SUM;
  switch (code) {
    case SUM: case AVG: op = MPI_SUM; break;
    case PRODUCT: op = MPI_PROD; break;
    case MIN: op = minmax_op(false, type); break;
    case MAX: op = minmax_op(true, type); break;
    case BAND: op = MPI_BAND; break;
    case BOR: op = MPI_BOR; break;
    case BXOR: op = MPI_BXOR; break;
  }
  return {op, type, half, code == AVG};
}

// The bytes of a validated tensor (strided, contiguous): numel x item size, without
// TensorBase::nbytes()'s layout check (a small call's path: ~25 instructions).
inline int64_t dense_nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// Whether the byte ranges [a, a + an) and [b, b + bn) share a byte (never when one is
// empty).
inline bool ranges_overlap(const void* a, int64_t an, const void* b, int64_t bn) {
  auto a0 = static_cast<const char*>(a), b0 = static_cast<const char*>(b);
  return an > 0 && bn > 0 && a0 < b0 + bn && b0 < a0 + an;
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  return ranges_overlap(a.data_ptr(), a.nbytes(), b.data_ptr(), b.nbytes());
}

at::Tensor flat_cat(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> flat;
  flat.reserve(list.size());
  for (auto& t : list) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copy consecutive blocks of `src` back into the tensors of `dst`.
void scatter_into(const at::Tensor& src, const std::vector<at::Tensor>& dst) {
  int64_t off = 0;
  for (auto& t : dst) {
    t.view({-1}).copy_(src.narrow(0, off, t.numel()));
    off += t.numel();
  }
}

std::vector<mdisp> to_disps(const Counts& c, int64_t scale = 1) {
  std::vector<mdisp> d(c.size());
  for (size_t i = 0; i < c.size(); ++i) d[i] = static_cast<mdisp>(c[i] * scale);
  return d;
}

std::vector<mcount> to_mcounts(const Counts& c, const char* op, int64_t scale = 1) {
  std::vector<mcount> v(c.size());
  for (size_t i = 0; i < c.size(); ++i) v[i] = to_mcount(c[i] * scale, op);
  return v;
}

// The collectives that have a blocking variant (by their mcrdl.ops names: block_op).
enum BlockOp : int {
  kAllReduce, kReduce, kBcast, kAllGather, kGather, kScatter, kReduceScatter, kAllToAllSingle,
  kBarrier, kBlockOps
};

// The BlockOp of an operation name; -1 when it has no blocking variant.
int block_op_of(const std::string& op) {
  if (op == "all_reduce") return kAllReduce;
  if (op == "reduce") return kReduce;
  if (op == "bcast") return kBcast;
  if (op == "all_gather") return kAllGather;
  if (op == "gather") return kGather;
  if (op == "scatter") return kScatter;
  if (op == "reduce_scatter") return kReduceScatter;
  if (op == "all_to_all_single") return kAllToAllSingle;
  if (op == "barrier") return kBarrier;
  return -1;
}

// Per op, which variant a blocking call of each size runs (BlockingSteps). Sizes are the
// tuning table's (mcrdl.ops nbytes: all_gather and reduce_scatter count the whole
// gathered / reduced buffer, barrier 0).
struct BlockingChoice {
  BlockingSteps steps[kBlockOps];
  // The Variant of a call (kVarNonblocking is 0: `if (use(...))` means "a blocking call").
  int use(BlockOp op, int64_t nbytes) const { return variant_at(steps[op], nbytes); }
};

// The ops with the kVarAllReduce variant.
bool has_allreduce_variant(int op) { return op == kAllGather || op == kReduceScatter; }

// This thread's scratch buffer of the allreduce variant, at least `bytes` long and aligned
// for any type: grown as needed, given back after a call above 1 MiB (forced variants).
struct Scratch {
  std::unique_ptr<std::max_align_t[]> p;
  size_t n = 0;
  char* get(size_t bytes) {
    if (bytes > n) {
      n = (bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
      p.reset(new std::max_align_t[n]);
      n *= sizeof(std::max_align_t);
    }
    return reinterpret_cast<char*>(p.get());
  }
  void trim() {
    if (n > (1 << 20)) p.reset(), n = 0;
  }
};
thread_local Scratch scratch_;

// all_gather's kVarAllReduce: `rd` (`total` bytes) zeroed but for this rank's `per` bytes
// from `sd` at rank * per, then OR-reduced over the ranks in place: every byte is one
// rank's, so the OR is exact for any dtype. The word size follows from `total` alone, as
// every rank must pass the same datatype and count; an output not aligned for it (a view)
// is reduced in the scratch buffer and copied back.
int or_all_gather(const void* sd, void* rd, int64_t per, int rank, int64_t total, MPI_Comm c) {
  const int w = total % 8 == 0 ? 8 : total % 4 == 0 ? 4 : 1;
  const MPI_Datatype dt = w == 8 ? MPI_UINT64_T : w == 4 ? MPI_UINT32_T : MPI_BYTE;
  const bool aligned = reinterpret_cast<uintptr_t>(rd) % w == 0;
  char* buf = aligned ? static_cast<char*>(rd) : scratch_.get(static_cast<size_t>(total));
  std::memset(buf, 0, static_cast<size_t>(total));
  std::memcpy(buf + rank * per, sd, static_cast<size_t>(per));
  const int rc =
      MPIC(MPI_Allreduce)(MPI_IN_PLACE, buf, static_cast<mcount>(total / w), dt, MPI_BOR, c);
  if (!aligned) {
    if (rc == MPI_SUCCESS) std::memcpy(rd, buf, static_cast<size_t>(total));
    scratch_.trim();
  }
  return rc;
}

// reduce_scatter's kVarAllReduce: the whole input `sd` (size blocks of `n` elements of
// `type`, `per` bytes each) reduced into this thread's scratch buffer, this rank's block
// copied to `rd`.
int reduce_all_pick(const void* sd, void* rd, mcount n, int64_t per, int rank, int size,
                    MPI_Datatype type, MPI_Op op, MPI_Comm c) {
  Scratch& scratch = scratch_;  // one look-up of the thread-local (__tls_get_addr)
  char* buf = scratch.get(static_cast<size_t>(per) * size);
  const int rc = MPIC(MPI_Allreduce)(sd, buf, n * size, type, op, c);
  if (rc == MPI_SUCCESS) std::memcpy(rd, buf + rank * per, static_cast<size_t>(per));
  scratch.trim();
  return rc;
}

// How many nonblocking collectives a communicator keeps in MPI at once: the async ones
// posted beyond it wait in the communicator's issue queue and reach MPI, in issue order,
// as earlier ones complete. MPICH's progress engine visits every nonblocking collective
// in flight on each of its calls (one per test of any request), so with N in flight
// every op's progress cost O(N): 512 async all_reduces of 1 KiB posted, then waited, at
// 2 ranks (MPI initialized by mpi4py) cost 1.5-1.8x per op what 64 did, that loop 28-33%
// of each rank's CPU samples (perf) against 5-6% with a window of 32, which still covers
// the latency of a small op at the rate a caller posts them (benchmarks/async_burst.py).
std::atomic<int> g_nb_window{32};

// A communicator's count of nonblocking collectives in MPI, against g_nb_window. A slot
// is taken to post (by the caller, with the post lock held and nothing queued, or by the
// issue thread, which waits for room) and given back when a test sees the op complete.
struct Window {
  std::atomic<int> n{0};
  std::atomic<bool> waiting{false};
  std::mutex mu;
  std::condition_variable cv;

  // A caller posting with the post lock held and the issue queue idle (nothing else takes
  // slots meanwhile): a slot if there is room.
  bool try_take() {
    if (n.load() >= g_nb_window.load(std::memory_order_relaxed)) return false;
    n.fetch_add(1);
    return true;
  }
  // The issue thread: wait for room, then take a slot. Once full, it waits until half the
  // window has drained (one wake-up per half window, not per op). Gives up waiting when
  // `lane` fails or closes (its ops are abandoned then, and never give their slots back):
  // the op is then posted as it would be without the window.
  void take(const Lane& lane) {
    const int limit = g_nb_window.load(std::memory_order_relaxed);
    if (n.load() >= limit) {
      std::unique_lock<std::mutex> g(mu);
      waiting.store(true);
      while (n.load() > limit / 2 && lane.healthy())
        cv.wait_for(g, std::chrono::milliseconds(10));
      waiting.store(false);
    }
    n.fetch_add(1);
  }
  void give_back() {
    // seq_cst with take's store and load of `waiting` and `n`: no wake-up is lost
    if (n.fetch_sub(1) - 1 <= g_nb_window.load(std::memory_order_relaxed) / 2 &&
        waiting.load()) {
      { std::lock_guard<std::mutex> g(mu); }
      cv.notify_one();
    }
  }
};

// Everything a posted op needs until it completes: requests, count arrays, buffers.
struct InFlight {
  // The window slot the op holds while in MPI (Window): given back when a test sees it
  // complete, or when the op is dropped (failed to post, failed).
  std::shared_ptr<Window> window;
  ~InFlight() {
    if (window) window->give_back();
  }
  std::vector<MPI_Request> reqs;
  std::vector<mcount> c1, c2;
  std::vector<mdisp> d1, d2;
  std::vector<at::Tensor> keep;
  MPI_Request* req() {
    reqs.push_back(MPI_REQUEST_NULL);
    return &reqs.back();
  }
  // Whether every request has completed (MPI_Testall); an MPI error raises, naming `op`.
  bool completed(const char* op) {
    int flag = 0;
    check_mpi(MPI_Testall((int)reqs.size(), reqs.data(), &flag, MPI_STATUSES_IGNORE), op);
    if (flag && window) std::exchange(window, nullptr)->give_back();
    return flag != 0;
  }
};

}  // namespace

class MpiComm {
 public:
  MpiComm(uint64_t handle, int rank, int size, std::string group, std::shared_ptr<Lane> lane,
          double timeout_s, std::string backend)
      : rank_(rank), size_(size), group_(std::move(group)), backend_(std::move(backend)),
        lane_(std::move(lane)), timeout_s_(timeout_s),
        issuer_(std::make_shared<Issuer>()) {
    comm_ = comm_from_handle<MPI_Comm>(handle);
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }
  ~MpiComm() { issuer_->stop(); }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t seq() const { return seq_; }
  // Calls that ran the blocking MPI collective (either thread): what tests observe of the
  // variant choice.
  uint64_t blocking_calls() const { return blocking_calls_; }
  // Nonblocking collectives in MPI now that hold a window slot (async calls, and calls
  // the issue thread posted), not yet seen complete (Window).
  int in_mpi() const { return window_->n.load(); }
  void set_timeout(double t) {
    auto g = lock_post();  // posts read it under the post lock
    timeout_s_ = t;
  }

  // set_blocking(op, steps): which variant calls of `op` run, by size; `steps` are
  // (largest bytes, variant code) pairs in increasing size, -1 bytes meaning no limit.
  void set_blocking(const std::string& op, const BlockingSteps& steps) {
    int i = block_op(op);
    BlockingSteps v =
        checked_blocking_steps(op, steps, has_allreduce_variant(i) ? kVariants : kVarBlocking + 1);
    // as a post takes it (a thread holding it may be waiting for our GIL)
    auto g = lock_post();
    blocking_.steps[i] = std::move(v);
  }

  // Whether a call of `op` of `nbytes` runs the blocking MPI collective.
  bool uses_blocking(const std::string& op, int64_t nbytes) const {
    return variant(op, nbytes) != kVarNonblocking;
  }

  // The Variant a blocking call of `op` of `nbytes` runs.
  int variant(const std::string& op, int64_t nbytes) const {
    return blocking_.use(static_cast<BlockOp>(block_op(op)), nbytes);
  }

  // The hot ops (all_reduce, bcast, all_gather, reduce_scatter) borrow their arguments'
  // tensors and copy one only where something must own it past the call (a Work, a
  // queued blocking call, a finish step): see BlockArg. Each lists those once, as `held`
  // (what a Work or a queued blocking call holds).
  py::object all_reduce(py::handle tensor, int rop, bool async_op) {
    const at::Tensor& t = to_tensor(tensor, "all_reduce", "tensor");
    validate_all_reduce(t, rop);
    check_device("all_reduce", t);
    ReducePlan p = reduce_plan(t.scalar_type(), rop);
    auto buf = c10::MaybeOwned<at::Tensor>::borrowed(t);
    if (p.upcast) {
      c10::NoGradGuard ng;
      buf = c10::MaybeOwned<at::Tensor>::owned(t.to(at::kFloat));
    }
    const mcount n = to_mcount(buf->numel(), "all_reduce");
    std::function<void()> finish;
    if (p.average || p.upcast)
      finish = [t, buf = *buf, p, size = size_] {
        c10::NoGradGuard ng;
        if (p.average) buf.div_(size);
        if (p.upcast) t.copy_(buf);
      };
    void* d = buf->data_ptr();
    auto held = [&] { return std::vector<at::Tensor>{t, *buf}; };
    if (blocking_.use(kAllReduce, dense_nbytes(t)))
      return run_blocking("all_reduce", "MPI_Allreduce", async_op, std::move(finish),
                          [d, n, p, c = comm_] {
                            return MPIC(MPI_Allreduce)(MPI_IN_PLACE, d, n, p.type, p.op, c);
                          },
                          held);
    auto s = std::make_shared<InFlight>();
    return post("all_reduce", "MPI_Iallreduce", s, async_op, std::move(finish),
                [d, n, p, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Iallreduce)(MPI_IN_PLACE, d, n, p.type, p.op, c, r);
                },
                held);
  }

  py::object reduce(py::handle tensor, py::handle dst_, int rop, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor t = to_tensor(tensor, "reduce", "tensor");
    int64_t dst = to_int(dst_, "reduce", "dst");
    validate_reduce(t, dst, rop, size_);
    check_device("reduce", t);
    ReducePlan p = reduce_plan(t.scalar_type(), rop);
    at::Tensor buf = p.upcast ? t.to(at::kFloat) : t;
    const bool root = dst == rank_;
    const mcount n = to_mcount(buf.numel(), "reduce");
    std::function<void()> finish;
    if (root && (p.average || p.upcast))
      finish = [t, buf, p, size = size_] {
        c10::NoGradGuard ng;
        if (p.average) buf.div_(size);
        if (p.upcast) t.copy_(buf);
      };
    const int d = static_cast<int>(dst);
    if (blocking_.use(kReduce, t.nbytes()))
      return run_blocking("reduce", "MPI_Reduce", async_op, std::move(finish),
                          [buf, n, p, root, d, c = comm_] {
                            return MPIC(MPI_Reduce)(root ? MPI_IN_PLACE : buf.data_ptr(),
                                                    root ? buf.data_ptr() : nullptr, n, p.type,
                                                    p.op, d, c);
                          });
    auto s = std::make_shared<InFlight>();
    s->keep = {t, buf};
    return post("reduce", "MPI_Ireduce", s, async_op, std::move(finish),
                [buf, n, p, root, d, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Ireduce)(root ? MPI_IN_PLACE : buf.data_ptr(),
                                           root ? buf.data_ptr() : nullptr, n, p.type, p.op, d, c,
                                           r);
                });
  }

  py::object bcast(py::handle tensor, py::handle src_, bool async_op) {
    const at::Tensor& t = to_tensor(tensor, "bcast", "tensor");
    int64_t src = to_int(src_, "bcast", "src");
    validate_bcast(t, src, size_);
    check_device("bcast", t);
    const mcount n = to_mcount(t.numel(), "bcast");
    const MPI_Datatype dt = move_type(t.scalar_type());
    const int root = static_cast<int>(src);
    void* d = t.data_ptr();
    auto held = [&] { return std::vector<at::Tensor>{t}; };
    if (blocking_.use(kBcast, dense_nbytes(t)))
      return run_blocking("bcast", "MPI_Bcast", async_op, {},
                          [d, n, dt, root, c = comm_] {
                            return MPIC(MPI_Bcast)(d, n, dt, root, c);
                          },
                          held);
    auto s = std::make_shared<InFlight>();
    return post("bcast", "MPI_Ibcast", s, async_op, {},
                [d, n, dt, root, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Ibcast)(d, n, dt, root, c, r);
                },
                held);
  }

  py::object all_gather(py::handle output, py::handle input, bool async_op) {
    const at::Tensor& input_t = to_tensor(input, "all_gather", "input");
    if (is_tensor(output.ptr())) {  // one tensor of `size` blocks: a small call's path
      const at::Tensor& out = unpack_tensor(output.ptr());
      validate_all_gather(out, input_t, size_);
      check_device("all_gather", input_t);
      return all_gather_into(out, input_t, {}, async_op);
    }
    BlockArg out = to_blocks(output, "all_gather", "output", false);
    validate_all_gather(out, input_t, size_);
    check_device("all_gather", input_t);
    at::Tensor recv = at::empty({input_t.numel() * size_}, input_t.options());
    return all_gather_into(
        recv, input_t,
        [recv, list = std::move(out.list)] { c10::NoGradGuard ng; scatter_into(recv, list); },
        async_op);
  }

  // all_gather of validated tensors into `recv`, then `finish` (a list output's copy).
  py::object all_gather_into(const at::Tensor& recv, const at::Tensor& input_t,
                             std::function<void()> finish, bool async_op) {
    auto in = c10::MaybeOwned<at::Tensor>::borrowed(input_t);
    // Each tensor's pointer and byte count read once: (both are contiguous and strided,
    // validated) the small call's path has no other use for the tensors' accessors.
    const mcount n = to_mcount(input_t.numel(), "all_gather");
    const int64_t per = dense_nbytes(input_t);
    const int64_t nbytes = per * size_;
    const void* sd = input_t.data_ptr();
    void* rd = recv.data_ptr();
    if (ranges_overlap(sd, per, rd, nbytes)) {
      c10::NoGradGuard ng;  // the input is part of the output: send a copy
      in = c10::MaybeOwned<at::Tensor>::owned(input_t.clone());
      sd = in->data_ptr();
    }
    const MPI_Datatype dt = move_type(input_t.scalar_type());
    auto held = [&] { return std::vector<at::Tensor>{*in, recv}; };
    const int var = blocking_.use(kAllGather, nbytes);
    if (var == kVarAllReduce) {
      to_mcount(nbytes, "all_gather");
      return run_blocking("all_gather", "MPI_Allreduce", async_op, std::move(finish),
                          [sd, rd, per, nbytes, r = rank_, c = comm_] {
                            return or_all_gather(sd, rd, per, r, nbytes, c);
                          },
                          held);
    }
    if (var)
      return run_blocking("all_gather", "MPI_Allgather", async_op, std::move(finish),
                          [sd, rd, n, dt, c = comm_] {
                            return MPIC(MPI_Allgather)(sd, n, dt, rd, n, dt, c);
                          },
                          held);
    auto s = std::make_shared<InFlight>();
    return post("all_gather", "MPI_Iallgather", s, async_op, std::move(finish),
                [sd, rd, n, dt, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Iallgather)(sd, n, dt, rd, n, dt, c, r);
                },
                held);
  }

  py::object gather(py::handle output, py::handle input, py::handle dst_, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor in = to_tensor(input, "gather", "input");
    int64_t dst = to_int(dst_, "gather", "dst");
    BlockArg out = to_blocks(output, "gather", "output", true);
    validate_gather(out, in, dst, rank_, size_);
    check_device("gather", in);
    const bool root = dst == rank_;
    at::Tensor recv;
    if (root) {
      recv = out.is_list ? at::empty({in.numel() * size_}, in.options()) : out.tensor();
      if (overlaps(in, recv)) in = in.clone();
    }
    const MPI_Datatype dt = move_type(in.scalar_type());
    const mcount n = to_mcount(in.numel(), "gather");
    const int d = static_cast<int>(dst);
    std::function<void()> finish;
    if (root && out.is_list)
      finish = [recv, list = out.list] { c10::NoGradGuard ng; scatter_into(recv, list); };
    const int64_t nbytes = in.nbytes() * size_;
    if (blocking_.use(kGather, nbytes))
      return run_blocking("gather", "MPI_Gather", async_op, std::move(finish),
                          [in, recv, n, dt, d, root, c = comm_] {
                            return MPIC(MPI_Gather)(in.data_ptr(), n, dt,
                                                    root ? recv.data_ptr() : nullptr, n, dt, d, c);
                          });
    auto s = std::make_shared<InFlight>();
    s->keep = {in, recv};
    return post("gather", "MPI_Igather", s, async_op, std::move(finish),
                [in, recv, n, dt, d, root, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Igather)(in.data_ptr(), n, dt, root ? recv.data_ptr() : nullptr,
                                           n, dt, d, c, r);
                });
  }

  py::object scatter(py::handle output, py::handle input, py::handle src_, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor out = to_tensor(output, "scatter", "output");
    int64_t src = to_int(src_, "scatter", "src");
    BlockArg in = to_blocks(input, "scatter", "input", true);
    validate_scatter(out, in, src, rank_, size_);
    check_device("scatter", out);
    const bool root = src == rank_;
    at::Tensor send;
    if (root) {
      send = in.is_list ? flat_cat(in.list) : in.tensor();
      if (overlaps(send, out)) send = send.clone();
    }
    const MPI_Datatype dt = move_type(out.scalar_type());
    const mcount n = to_mcount(out.numel(), "scatter");
    const int sr = static_cast<int>(src);
    const int64_t nbytes = dense_nbytes(out) * size_;
    if (blocking_.use(kScatter, nbytes))
      return run_blocking("scatter", "MPI_Scatter", async_op, {},
                          [out, send, n, dt, sr, root, c = comm_] {
                            return MPIC(MPI_Scatter)(root ? send.data_ptr() : nullptr, n, dt,
                                                     out.data_ptr(), n, dt, sr, c);
                          });
    auto s = std::make_shared<InFlight>();
    s->keep = {out, send};
    return post("scatter", "MPI_Iscatter", s, async_op, {},
                [out, send, n, dt, sr, root, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Iscatter)(root ? send.data_ptr() : nullptr, n, dt,
                                            out.data_ptr(), n, dt, sr, c, r);
                });
  }

  py::object reduce_scatter(py::handle output, py::handle input, int rop, bool async_op) {
    const at::Tensor& out = to_tensor(output, "reduce_scatter", "output");
    if (is_tensor(input.ptr())) {  // one tensor of `size` blocks: a small call's path
      const at::Tensor& in = unpack_tensor(input.ptr());
      validate_reduce_scatter(out, in, rop, size_);
      check_device("reduce_scatter", out);
      return reduce_scatter_from(out, in, rop, async_op);
    }
    BlockArg in = to_blocks(input, "reduce_scatter", "input", false);
    validate_reduce_scatter(out, in, rop, size_);
    check_device("reduce_scatter", out);
    at::Tensor send;
    {
      c10::NoGradGuard ng;
      send = flat_cat(in.list);
    }
    return reduce_scatter_from(out, send, rop, async_op);
  }

  // reduce_scatter of validated tensors: `input_t` (`size` blocks) into `out`.
  py::object reduce_scatter_from(const at::Tensor& out, const at::Tensor& input_t, int rop,
                                 bool async_op) {
    ReducePlan p = reduce_plan(out.scalar_type(), rop);
    auto send = c10::MaybeOwned<at::Tensor>::borrowed(input_t);
    auto recv = c10::MaybeOwned<at::Tensor>::borrowed(out);
    // Each tensor's pointer and byte count read once (both contiguous, validated).
    const int64_t per = dense_nbytes(out);
    const int64_t nbytes = per * size_;
    const void* sd = input_t.data_ptr();
    void* rd = out.data_ptr();
    if (C10_UNLIKELY(p.upcast)) {
      c10::NoGradGuard ng;
      send = c10::MaybeOwned<at::Tensor>::owned(input_t.to(at::kFloat));
      recv = c10::MaybeOwned<at::Tensor>::owned(
          at::empty({out.numel()}, out.options().dtype(at::kFloat)));
      sd = send->data_ptr();
      rd = recv->data_ptr();
    } else if (ranges_overlap(sd, nbytes, rd, per)) {
      c10::NoGradGuard ng;  // the output is part of the input: send a copy
      send = c10::MaybeOwned<at::Tensor>::owned(input_t.clone());
      sd = send->data_ptr();
    }
    const mcount n = to_mcount(out.numel(), "reduce_scatter");
    std::function<void()> finish;
    if (p.average || p.upcast)
      finish = [out, recv = *recv, p, size = size_] {
        c10::NoGradGuard ng;
        if (p.average) recv.div_(size);
        if (p.upcast) out.view({-1}).copy_(recv);
      };
    auto held = [&] { return std::vector<at::Tensor>{*send, *recv, out}; };
    const int var = blocking_.use(kReduceScatter, nbytes);
    if (var == kVarAllReduce) {
      to_mcount(n * static_cast<int64_t>(size_), "reduce_scatter");
      const int64_t rper = p.upcast ? dense_nbytes(*recv) : per;
      return run_blocking("reduce_scatter", "MPI_Allreduce", async_op, std::move(finish),
                          [sd, rd, n, rper, p, r = rank_, size = size_, c = comm_] {
                            return reduce_all_pick(sd, rd, n, rper, r, size, p.type, p.op, c);
                          },
                          held);
    }
    if (var)
      return run_blocking("reduce_scatter", "MPI_Reduce_scatter_block", async_op,
                          std::move(finish), [sd, rd, n, p, c = comm_] {
                            return MPIC(MPI_Reduce_scatter_block)(sd, rd, n, p.type, p.op, c);
                          },
                          held);
    auto s = std::make_shared<InFlight>();
    return post("reduce_scatter", "MPI_Ireduce_scatter_block", s, async_op, std::move(finish),
                [sd, rd, n, p, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Ireduce_scatter_block)(sd, rd, n, p.type, p.op, c, r);
                },
                held);
  }

  py::object all_to_all_single(py::handle output, py::handle input, py::handle out_splits_,
                               py::handle in_splits_, bool async_op) {
    const char* op = "all_to_all_single";
    at::Tensor out = to_tensor(output, op, "output");
    at::Tensor in = to_tensor(input, op, "input");
    auto out_splits = to_counts(out_splits_, op, "output_split_sizes", true);
    auto in_splits = to_counts(in_splits_, op, "input_split_sizes", true);
    auto [is, os] = validate_all_to_all_single(out, in, out_splits, in_splits, rank_, size_);
    check_device(op, in);
    if (overlaps(in, out)) in = in.clone();
    auto row = [](const at::Tensor& t) {
      int64_t r = 1;
      for (int64_t d = 1; d < t.dim(); ++d) r *= t.size(d);
      return r;
    };
    const MPI_Datatype dt = move_type(in.scalar_type());
    auto s = std::make_shared<InFlight>();
    s->keep = {in, out};
    if (!in_splits && !out_splits && in.numel() == out.numel()) {
      const mcount n = to_mcount(in.numel() / size_, op);
      if (blocking_.use(kAllToAllSingle, in.nbytes()))
        return run_blocking(op, "MPI_Alltoall", async_op, {},
                            [in, out, n, dt, c = comm_] {
                              return MPIC(MPI_Alltoall)(in.data_ptr(), n, dt, out.data_ptr(), n,
                                                        dt, c);
                            });
      return post(op, "MPI_Ialltoall", s, async_op, {},
                  [in, out, n, dt, c = comm_](MPI_Request* r) {
                    return MPIC(MPI_Ialltoall)(in.data_ptr(), n, dt, out.data_ptr(), n, dt, c, r);
                  });
    }
    s->c1 = to_mcounts(is, op, row(in));
    s->c2 = to_mcounts(os, op, row(out));
    s->d1 = packed_disps(s->c1);
    s->d2 = packed_disps(s->c2);
    return post(op, "MPI_Ialltoallv", s, async_op, {}, alltoallv(s, in, out, dt));
  }

  py::object all_to_all(py::handle output_list, py::handle input_list, bool async_op) {
    c10::NoGradGuard ng;
    const char* op = "all_to_all";
    auto outs = to_tensor_list(output_list, op, "output_list");
    auto ins = to_tensor_list(input_list, op, "input_list");
    validate_all_to_all(outs, ins, rank_, size_);
    check_device(op, ins[0]);
    auto s = std::make_shared<InFlight>();
    Counts sc, rc;
    for (auto& t : ins) sc.push_back(t.numel());
    for (auto& t : outs) rc.push_back(t.numel());
    at::Tensor send = flat_cat(ins);
    int64_t total = 0;
    for (auto c : rc) total += c;
    at::Tensor recv = at::empty({total}, ins[0].options());
    s->keep = {send, recv};
    s->c1 = to_mcounts(sc, op);
    s->c2 = to_mcounts(rc, op);
    s->d1 = packed_disps(s->c1);
    s->d2 = packed_disps(s->c2);
    const MPI_Datatype dt = move_type(send.scalar_type());
    return post(op, "MPI_Ialltoallv", s, async_op,
                [recv, outs] { c10::NoGradGuard ng; scatter_into(recv, outs); },
                alltoallv(s, send, recv, dt));
  }

  py::object gatherv(py::handle output, py::handle input, py::handle counts_, py::handle displs_,
                     py::handle dst_, bool async_op) {
    const char* op = "gatherv";
    at::Tensor in = to_tensor(input, op, "input");
    at::Tensor out_storage;
    const at::Tensor* out = to_tensor_opt(output, op, "output", out_storage);
    int64_t dst = to_int(dst_, op, "dst");
    Counts counts = *to_counts(counts_, op, "counts", false);
    auto displs = to_counts(displs_, op, "displs", true);
    Counts d = validate_gatherv(out, in, counts, displs, dst, rank_, size_);
    check_device(op, in);
    const bool root = dst == rank_;
    if (root && overlaps(in, *out)) in = in.clone();
    auto s = std::make_shared<InFlight>();
    s->keep = {in, out_storage};
    s->c1 = to_mcounts(counts, op);
    s->d1 = to_disps(d);
    const MPI_Datatype dt = move_type(in.scalar_type());
    const mcount n = to_mcount(in.numel(), op);
    void* rbuf = root ? out->data_ptr() : nullptr;
    return post(op, "MPI_Igatherv", s, async_op, {},
                [s, in, n, dt, rbuf, d = static_cast<int>(dst), c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Igatherv)(in.data_ptr(), n, dt, rbuf, s->c1.data(), s->d1.data(),
                                            dt, d, c, r);
                });
  }

  py::object scatterv(py::handle output, py::handle input, py::handle counts_, py::handle displs_,
                      py::handle src_, bool async_op) {
    const char* op = "scatterv";
    at::Tensor out = to_tensor(output, op, "output");
    at::Tensor in_storage;
    const at::Tensor* in = to_tensor_opt(input, op, "input", in_storage);
    int64_t src = to_int(src_, op, "src");
    Counts counts = *to_counts(counts_, op, "counts", false);
    auto displs = to_counts(displs_, op, "displs", true);
    Counts d = validate_scatterv(out, in, counts, displs, src, rank_, size_);
    check_device(op, out);
    const bool root = src == rank_;
    if (root && overlaps(*in, out)) in_storage = in->clone(), in = &in_storage;
    auto s = std::make_shared<InFlight>();
    s->keep = {out, in_storage};
    s->c1 = to_mcounts(counts, op);
    s->d1 = to_disps(d);
    const MPI_Datatype dt = move_type(out.scalar_type());
    const mcount n = to_mcount(out.numel(), op);
    void* sbuf = root ? in->data_ptr() : nullptr;
    return post(op, "MPI_Iscatterv", s, async_op, {},
                [s, out, n, dt, sbuf, sr = static_cast<int>(src), c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Iscatterv)(sbuf, s->c1.data(), s->d1.data(), dt, out.data_ptr(),
                                             n, dt, sr, c, r);
                });
  }

  py::object all_gatherv(py::handle output, py::handle input, py::handle counts_,
                         py::handle displs_, bool async_op) {
    const char* op = "all_gatherv";
    at::Tensor out = to_tensor(output, op, "output");
    at::Tensor in = to_tensor(input, op, "input");
    Counts counts = *to_counts(counts_, op, "counts", false);
    auto displs = to_counts(displs_, op, "displs", true);
    Counts d = validate_all_gatherv(out, in, counts, displs, rank_, size_);
    check_device(op, in);
    if (overlaps(in, out)) in = in.clone();
    auto s = std::make_shared<InFlight>();
    s->keep = {in, out};
    s->c1 = to_mcounts(counts, op);
    s->d1 = to_disps(d);
    const MPI_Datatype dt = move_type(in.scalar_type());
    const mcount n = to_mcount(in.numel(), op);
    return post(op, "MPI_Iallgatherv", s, async_op, {},
                [s, in, out, n, dt, c = comm_](MPI_Request* r) {
                  return MPIC(MPI_Iallgatherv)(in.data_ptr(), n, dt, out.data_ptr(), s->c1.data(),
                                               s->d1.data(), dt, c, r);
                });
  }

  py::object all_to_allv(py::handle output, py::handle input, py::handle scounts_,
                         py::handle rcounts_, py::handle sdispls_, py::handle rdispls_,
                         bool async_op) {
    const char* op = "all_to_allv";
    at::Tensor out = to_tensor(output, op, "output");
    at::Tensor in = to_tensor(input, op, "input");
    Counts sc = *to_counts(scounts_, op, "send_counts", false);
    Counts rc = *to_counts(rcounts_, op, "recv_counts", false);
    auto sd_ = to_counts(sdispls_, op, "send_displs", true);
    auto rd_ = to_counts(rdispls_, op, "recv_displs", true);
    auto [sd, rd] = validate_all_to_allv(out, in, sc, rc, sd_, rd_, rank_, size_);
    check_device(op, in);
    if (overlaps(in, out)) in = in.clone();
    auto s = std::make_shared<InFlight>();
    s->keep = {in, out};
    s->c1 = to_mcounts(sc, op);
    s->c2 = to_mcounts(rc, op);
    s->d1 = to_disps(sd);
    s->d2 = to_disps(rd);
    return post(op, "MPI_Ialltoallv", s, async_op, {},
                alltoallv(s, in, out, move_type(in.scalar_type())));
  }

  py::object send(py::handle tensor, py::handle dst, py::handle tag, bool async_op) {
    return p2p(true, tensor, dst, tag, async_op);
  }

  py::object recv(py::handle tensor, py::handle src, py::handle tag, bool async_op) {
    return p2p(false, tensor, src, tag, async_op);
  }

  py::object barrier(bool async_op) {
    if (blocking_.use(kBarrier, 0))
      return run_blocking("barrier", "MPI_Barrier", async_op, {},
                          [c = comm_] { return MPI_Barrier(c); });
    return post("barrier", "MPI_Ibarrier", std::make_shared<InFlight>(), async_op, {},
                [c = comm_](MPI_Request* r) { return MPI_Ibarrier(c, r); });
  }

 private:
  static std::vector<mdisp> packed_disps(const std::vector<mcount>& c) {
    std::vector<mdisp> d(c.size());
    mdisp off = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      d[i] = off;
      off += static_cast<mdisp>(c[i]);
    }
    return d;
  }

  // MPI_Ialltoallv of `in` into `out` with the counts and displacements in `s`.
  std::function<int(MPI_Request*)> alltoallv(std::shared_ptr<InFlight> s, const at::Tensor& in,
                                             const at::Tensor& out, MPI_Datatype dt) const {
    return [s, in, out, dt, c = comm_](MPI_Request* r) {
      return MPIC(MPI_Ialltoallv)(in.data_ptr(), s->c1.data(), s->d1.data(), dt, out.data_ptr(),
                                  s->c2.data(), s->d2.data(), dt, c, r);
    };
  }

  py::object p2p(bool sending, py::handle tensor, py::handle peer_, py::handle tag_,
                 bool async_op) {
    const char* op = sending ? "send" : "recv";
    at::Tensor t = to_tensor(tensor, op, "tensor");
    int64_t peer = to_int(peer_, op, sending ? "dst" : "src");
    int64_t tag = to_int(tag_, op, "tag");
    validate_p2p(op, t, peer, tag, rank_, size_);
    check_device(op, t);
    auto s = std::make_shared<InFlight>();
    s->keep = {t};
    const mcount n = to_mcount(t.numel(), op);
    const MPI_Datatype dt = move_type(t.scalar_type());
    const int pr = static_cast<int>(peer), tg = static_cast<int>(tag);
    if (sending)
      return post_p2p(op, "MPI_Isend", s, async_op,
                      [t, n, dt, pr, tg, c = comm_](MPI_Request* r) {
                        return MPIC(MPI_Isend)(t.data_ptr(), n, dt, pr, tg, c, r);
                      });
    return post_p2p(op, "MPI_Irecv", s, async_op, [t, n, dt, pr, tg, c = comm_](MPI_Request* r) {
      return MPIC(MPI_Irecv)(t.data_ptr(), n, dt, pr, tg, c, r);
    });
  }

  void check_device(const char* op, const at::Tensor& t) const {
    if (t.device().is_cpu()) return;
    std::string why = t.is_cuda() ? "this MPI library is not CUDA-aware for mcrdl; move the tensor "
                                    "to the CPU or use backend 'nccl'"
                                  : "the 'mpi' backend handles CPU tensors only";
    throw Error(ErrorKind::BackendUnavailable, std::string(op) + ": backend '" + backend_ +
                                                   "' cannot use a tensor on " + t.device().str() +
                                                   ": " + why);
  }

  static int block_op(const std::string& op) {
    const int i = block_op_of(op);
    if (i < 0) throw_invalid("set_blocking: '" + op + "' has no blocking variant");
    return i;
  }

  // The post lock, taken with the GIL held: when a blocking collective of another thread
  // holds it, wait without the GIL (that thread may need it, or a peer may need ours).
  std::unique_lock<PostLock> lock_post() {
    std::unique_lock<PostLock> g(post_mu_, std::try_to_lock);
    if (!g.owns_lock()) {
      py::gil_scoped_release nogil;
      g.lock();
    }
    return g;
  }

  // The next op's sequence number; refused once the lane failed or closed. With the
  // post lock held.
  uint64_t next_seq(const char* op) {
    if (!lane_->healthy()) lane_->throw_unhealthy(op);
    return ++seq_;
  }

  std::shared_ptr<Work> make_work(const char* op) {
    const uint64_t seq = next_seq(op);
    return std::make_shared<Work>(op, backend_, group_, seq, timeout_s_, lane_);
  }

  // f() with the GIL kept when `hold` (may_hold_gil), else released while it runs.
  template <typename F>
  static auto gil_kept_if(bool hold, F&& f) {
    if (hold) return f();
    py::gil_scoped_release nogil;
    return f();
  }

  // The nonblocking variant: `post_fn(request)` posts the op (returning its MPI error
  // code) from this thread, or from the issue thread when it has ops queued (issue
  // order); the lane (async) or the caller (blocking) then drives it.
  // `keep()` lists the tensors a Work must hold alive besides s->keep (the caller's
  // buffers, borrowed): asked only when the op gets a Work.
  // A blocking call with nothing queued posts and polls the requests on this thread with
  // no Work: after a large collective a Work's allocations, locks and callbacks ran on
  // cold lines, and cost such a call ~10 us outside MPI (benchmarks/call_gap.py). Only if
  // it reaches its deadline does it get a Work, handed to the lane as launch_work does,
  // which keeps its buffers (MPI may still write them).
  template <typename PostFn, typename Keep = std::vector<at::Tensor> (*)()>
  py::object post(const char* op, const char* mpi_name, std::shared_ptr<InFlight> s,
                  bool async_op, std::function<void()> finish, PostFn&& post_fn,
                  Keep&& keep = [] { return std::vector<at::Tensor>{}; }) {
    return post_in(false, op, mpi_name, std::move(s), async_op, std::move(finish),
                   std::forward<PostFn>(post_fn), std::forward<Keep>(keep));
  }

  // post() of a send or receive: always from this thread, never queued behind the issue
  // thread's collectives. Only collectives must reach MPI in issue order; a send held
  // behind a blocking collective that waits for the peer of that very send (w =
  // all_reduce(async_op=True); send(x, 1); w.wait() against recv(x, 0); all_reduce())
  // deadlocked. Sends and receives all posted from callers keep MPI's order among them.
  template <typename PostFn>
  py::object post_p2p(const char* op, const char* mpi_name, std::shared_ptr<InFlight> s,
                      bool async_op, PostFn&& post_fn) {
    return post_in(true, op, mpi_name, std::move(s), async_op, {},
                   std::forward<PostFn>(post_fn), [] { return std::vector<at::Tensor>{}; });
  }

  template <typename PostFn, typename Keep>
  py::object post_in(bool p2p, const char* op, const char* mpi_name, std::shared_ptr<InFlight> s,
                     bool async_op, std::function<void()> finish, PostFn&& post_fn, Keep&& keep) {
    auto g = lock_post();
    if (!async_op && (p2p || issuer_->idle())) {
      const uint64_t seq = next_seq(op);
      const double timeout_s = timeout_s_;  // as make_work: read under the post lock
      check_mpi(post_fn(s->req()), mpi_name);
      g.unlock();
      struct Polled {
        InFlight* s;
        const char* op;
      } polled{s.get(), op};
      bool (*test)(void*) = [](void* p) {
        auto* q = static_cast<Polled*>(p);
        return q->s->completed(q->op);
      };
      // as run_blocking: the GIL kept when nothing of this process can need it
      const bool done = gil_kept_if(may_hold_gil(),
                                    [&] { return wait_polling(test, &polled, timeout_s); });
      if (!done)
        return past_deadline(op, seq, timeout_s, std::move(s), std::move(finish), keep());
      if (finish) finish();
      return py::none();
    }
    auto w = make_work(op);
    w->finish = std::move(finish);
    append(s->keep, keep());
    auto test = testall(s, w->op());
    // A collective goes to MPI from here unless ops are queued on the issue thread, or,
    // async, the window is full (Window): then the issue thread posts it in turn.
    if (p2p || (issuer_->idle() && (!async_op || window_->try_take()))) {
      if (!p2p && async_op) {
        s->window = window_;  // given back by the InFlight should the post fail
        w->gate_queue = issuer_.get();  // the lane tests the oldest of them (Lane::loop)
      }
      check_mpi(post_fn(s->req()), mpi_name);
      g.unlock();
      w->test = std::move(test);
    } else {
      auto q = std::make_shared<Queued>(
          [s, win = window_, lane = lane_,
           post_fn = std::function<int(MPI_Request*)>(std::forward<PostFn>(post_fn))] {
            win->take(*lane);
            s->window = win;
            return post_fn(s->req());
          });
      issuer_->push(q->task());
      g.unlock();
      gate(*w, q);
      w->test = [q, mpi_name, test = std::move(test)] {
        return q->issued(mpi_name) && test();
      };
    }
    return launch_work(lane_, w, async_op);
  }

  static std::function<bool()> testall(std::shared_ptr<InFlight> s, std::string op) {
    return [s = std::move(s), op = std::move(op)] { return s->completed(op.c_str()); };
  }

  static void append(std::vector<at::Tensor>& to, std::vector<at::Tensor> more) {
    for (auto& t : more) to.push_back(std::move(t));
  }

  // A blocking call of post() past its deadline: as Work::wait there, it raises
  // CommTimeoutError (unless the op completed meanwhile) and the lane keeps the op.
  py::object past_deadline(const char* op, uint64_t seq, double timeout_s,
                           std::shared_ptr<InFlight> s, std::function<void()> finish,
                           std::vector<at::Tensor> keep) {
    append(s->keep, std::move(keep));
    auto w = std::make_shared<Work>(op, backend_, group_, seq, timeout_s, lane_);
    w->finish = std::move(finish);
    w->test = testall(std::move(s), op);
    py::gil_scoped_release nogil;
    try {
      w->time_out(timeout_s);
      w->wait(0);  // it completed meanwhile: raises what the op failed with, if it did
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Timeout) lane_->fail(e.what(), w);  // keeps buffers alive
      throw;
    }
    return py::none();
  }

  // The blocking variant: `call()` runs the blocking MPI collective (returning its MPI
  // error code) under the watchdog. A blocking call with nothing queued runs it on this
  // thread (ops issued meanwhile queue behind it: Issuer::begin_direct); otherwise the
  // issue thread runs it and a Work tracks it.
  // `keep()` lists the tensors a queued call must hold alive (the buffers `call` reads
  // and writes, borrowed from the caller): asked only when the call is queued.
  template <typename Call, typename Keep = std::vector<at::Tensor> (*)()>
  py::object run_blocking(const char* op, const char* mpi_name, bool async_op,
                          std::function<void()> finish, Call&& call,
                          Keep&& keep = [] { return std::vector<at::Tensor>{}; }) {
    auto g = lock_post();
    ++blocking_calls_;
    if (!async_op && issuer_->idle()) {
      const uint64_t seq = next_seq(op);
      const double timeout_s = timeout_s_;  // as make_work: read under the post lock
      issuer_->begin_direct();
      g.unlock();
      int rc;
      // Without the GIL unless nothing of this process can need it meanwhile (gil.h): a
      // thread that does may be what a peer waits for (tensor fusion's timer thread takes
      // it to flush a round).
      const bool hold = may_hold_gil();
      {
        // ended however the call leaves (an exception too): else the issuer never idles
        // again and every later op of this communicator queues behind nothing
        struct EndDirect {
          Issuer* issuer;
          ~EndDirect() { issuer->end_direct(); }
        } end{issuer_.get()};
        WatchGuard watch(slots_.get(), op, &backend_, &group_, seq, timeout_s, hold);
        rc = gil_kept_if(hold, call);
      }
      check_mpi(rc, mpi_name);
      if (finish) finish();
      return py::none();
    }
    auto w = make_work(op);
    w->finish = std::move(finish);
    auto q = std::make_shared<Queued>(
        [call = std::forward<Call>(call), held = keep()] { return call(); });
    // No watchdog here: the Work's bounded wait raises CommTimeoutError as for any async op.
    issuer_->push(q->task());
    g.unlock();
    gate(*w, q);
    w->test = [q, mpi_name] { return q->issued(mpi_name); };
    return launch_work(lane_, w, async_op);
  }

  // `w` waits for `q` on this communicator's issue thread (in issue order): the lane
  // looks at it only once it heads the thread's queue (Work::gate).
  void gate(Work& w, const std::shared_ptr<Queued>& q) const {
    w.gate = q->returned;
    w.gate_queue = issuer_.get();
  }

  MPI_Comm comm_;
  int rank_, size_;
  std::string group_, backend_;
  std::shared_ptr<Lane> lane_;
  double timeout_s_;                       // read and written with the post lock held
  uint64_t seq_ = 0, blocking_calls_ = 0;  // written with the post lock held
  PostLock post_mu_;
  BlockingChoice blocking_;
  std::shared_ptr<Issuer> issuer_;
  std::shared_ptr<Window> window_ = std::make_shared<Window>();
  SlotCache slots_;
};

// The entry points of the fast path (mpi_fast.h).
py::object mpi_all_reduce(MpiComm& c, py::handle tensor, int rop, bool async_op) {
  return c.all_reduce(tensor, rop, async_op);
}
py::object mpi_bcast(MpiComm& c, py::handle tensor, py::handle src, bool async_op) {
  return c.bcast(tensor, src, async_op);
}
py::object mpi_all_gather(MpiComm& c, py::handle output, py::handle input, bool async_op) {
  return c.all_gather(output, input, async_op);
}
py::object mpi_reduce_scatter(MpiComm& c, py::handle output, py::handle input, int rop,
                              bool async_op) {
  return c.reduce_scatter(output, input, rop, async_op);
}
py::object mpi_barrier(MpiComm& c, bool async_op) { return c.barrier(async_op); }
MpiComm* mpi_comm_of(py::handle comm) { return comm.cast<MpiComm*>(); }

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  return std::string(buf, len);
}

void bind_mpi(py::module_& m) {
  using py::arg;
  m.def("issuer_tasks_running",
        [] { return issuer_tasks_running().load(std::memory_order_acquire); },
        "Ops running on issue threads now (blocking MPI calls of async or queued calls): "
        "nonzero at exit means one never completed.");
  m.def("timeout_message", &timeout_message, arg("op"), arg("backend"), arg("group"), arg("seq"),
        arg("timeout"), arg("own_timeout") = -1.0,
        "The CommTimeoutError text of an op that did not complete within `timeout` seconds "
        "(what the blocking path's watchdog prints before MPI_Abort); `own_timeout`: the "
        "op's own timeout, where the wait had another (the op is still in flight).");
  m.def("set_mpi_window",
        [](int n) {
          if (n < 1) throw_invalid("set_mpi_window: n must be >= 1, got " + std::to_string(n));
          g_nb_window.store(n, std::memory_order_relaxed);
        },
        arg("n"),
        "How many nonblocking collectives each MPI communicator keeps in MPI at once (32); "
        "async ones posted beyond it are issued in order as earlier ones complete.");
  m.def("mpi_window", [] { return g_nb_window.load(std::memory_order_relaxed); },
        "set_mpi_window's value.");
  bind_mpi_fast(m);
  m.def("mpi_library_version", &mpi_library_version,
        "Version string of the MPI library this extension was linked against.");
  py::class_<MpiComm>(m, "MpiComm")
      .def(py::init<uint64_t, int, int, std::string, std::shared_ptr<Lane>, double, std::string>(),
           arg("handle"), arg("rank"), arg("size"), arg("group"), arg("lane"), arg("timeout"),
           arg("backend") = "mpi")
      .def_property_readonly("rank", &MpiComm::rank)
      .def_property_readonly("size", &MpiComm::size)
      .def_property_readonly("seq", &MpiComm::seq)
      .def_property_readonly("blocking_calls", &MpiComm::blocking_calls,
                             "How many calls ran the blocking MPI collective (set_blocking).")
      .def_property_readonly("in_mpi", &MpiComm::in_mpi,
                             "Nonblocking collectives of this communicator in MPI now, not "
                             "yet seen complete (at most mpi_window(); the rest queue).")
      .def("set_timeout", &MpiComm::set_timeout)
      .def_static("has_blocking", [](const std::string& op) { return block_op_of(op) >= 0; },
                  arg("op"), "Whether operation `op` has a blocking variant (set_blocking).")
      .def("set_blocking", &MpiComm::set_blocking, arg("op"), arg("steps"),
           "Which variant blocking calls of `op` run: (largest bytes, variant code) steps in "
           "increasing size, -1 bytes for no limit; larger sizes run nonblocking.")
      .def("uses_blocking", &MpiComm::uses_blocking, arg("op"), arg("nbytes"),
           "Whether a blocking call of `op` of `nbytes` runs a blocking MPI collective.")
      .def("variant", &MpiComm::variant, arg("op"), arg("nbytes"),
           "The variant code (0 nonblocking, 1 blocking, 2 allreduce) a blocking call of "
           "`op` of `nbytes` runs.")
      .def_static("has_allreduce_variant",
                  [](const std::string& op) { return has_allreduce_variant(block_op_of(op)); },
                  arg("op"), "Whether `op` has the allreduce variant (set_blocking code 2).")
      .def("all_reduce", &MpiComm::all_reduce)
      .def("reduce", &MpiComm::reduce)
      .def("bcast", &MpiComm::bcast)
      .def("all_gather", &MpiComm::all_gather)
      .def("gather", &MpiComm::gather)
      .def("scatter", &MpiComm::scatter)
      .def("reduce_scatter", &MpiComm::reduce_scatter)
      .def("all_to_all_single", &MpiComm::all_to_all_single)
      .def("all_to_all", &MpiComm::all_to_all)
      .def("gatherv", &MpiComm::gatherv)
      .def("scatterv", &MpiComm::scatterv)
      .def("all_gatherv", &MpiComm::all_gatherv)
      .def("all_to_allv", &MpiComm::all_to_allv)
      .def("send", &MpiComm::send)
      .def("recv", &MpiComm::recv)
      .def("barrier", &MpiComm::barrier);
}

}  // namespace mcrdl
