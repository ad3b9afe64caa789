// The "pccl" backend's algorithms: hierarchical (two-level) all-gather and reduce-scatter
// after the PCCL paper, with the inter-node phase over MPI point-to-point.
//
// A PcclComm owns two communicators of one group: `inter` (the ranks with the same local
// index on every node, ordered by node) and `intra` (the ranks of this node, ordered by
// local index). With N nodes x L ranks per node:
//   all_gather:     inter-node all-gather (N blocks) -> intra-node all-gather of those
//                   (L x N blocks, [local][node]) -> local shuffle into rank order.
//   reduce_scatter: local pre-shuffle into [local][node] order -> intra-node
//                   reduce-scatter (N blocks each) -> inter-node reduce-scatter (1 block).
//   all_reduce:     the reduce_scatter's steps, then the all_gather's, in one op (one
//                   sequence number, tag and Work, named all_reduce).
// A flat PcclComm (N = group size, L = 1) runs the inter algorithm over the whole group.
//
// Algorithms of a phase, each correct for any process count p:
//   "ring": p - 1 steps, one block per step.
//   "rd":   recursive doubling (all-gather) / recursive halving (reduce-scatter) over the
//           largest power of two p2 <= p; the first 2 (p - p2) ranks fold in pairs before
//           (the odd rank hands its data to the even one) and unfold after.
//   "mpi":  the MPI library's own collective (what the vendor library is on CPU).
// Each op is a schedule of steps (nonblocking sends/receives, then a local reduction or
// copy) driven by Work::progress: by the caller for blocking ops (GIL released, under the
// deadline) or by the backend's lane thread for async ops. Ops of one PcclComm run in
// issue order (each starts when the previous one finished), so the intra-node MPI
// collectives match across ranks; every message is tagged with the op's sequence number.
// Once an op fails, the ops behind it on that PcclComm fail at once with its error.
//
// Reductions run on the tensors' own device with ATen ops (never copied to the host).
// The Python layer (mcrdl/backends/pccl.py) validates arguments, maps bool to uint8,
// averages, and reduces float16/bfloat16 in float32.
#include <c10/core/GradMode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <type_traits>

#include <pybind11/stl.h>

#include "issuer.h"
#include "launch_work.h"
#include "mpi_util.h"
#include "pyargs.h"
#include "watchdog.h"

namespace mcrdl {

namespace {

constexpr int kTagSpace = 1 << 15;  // MPI guarantees tags up to 32767

enum class Algo { Ring, RD, Mpi };

Algo parse_algo(const std::string& a, const char* op, const char* arg) {
  if (a == "ring") return Algo::Ring;
  if (a == "rd") return Algo::RD;
  if (a == "mpi") return Algo::Mpi;
  throw_invalid(std::string(op) + ": '" + arg + "' must be 'ring', 'rd' or 'mpi', got '" + a + "'");
}

// MPI's op of `code` over elements of `type` (MPI_DATATYPE_NULL: only check the code).
MPI_Op mpi_op(int code, MPI_Datatype type = MPI_DATATYPE_NULL) {
  switch (code) {
    case SUM: return MPI_SUM;
    case PRODUCT: return MPI_PROD;
    case MIN: return type == MPI_DATATYPE_NULL ? MPI_MIN : minmax_op(false, type);
    case MAX: return type == MPI_DATATYPE_NULL ? MPI_MAX : minmax_op(true, type);
    case BAND: return MPI_BAND;
    case BOR: return MPI_BOR;
    case BXOR: return MPI_BXOR;
    default: throw_invalid(std::string("pccl: reduce op ") + reduce_name(code) +
                           " must be mapped by the Python layer");
  }
}

// A flat contiguous tensor addressed by element offsets. MPI moves its raw memory; local
// copies and reductions are memcpy and plain loops on CPU tensors up to kLoopMax
// elements (an ATen op costs ~1 us of dispatch, as much as a small message's transfer),
// ATen ops on the tensor's own device otherwise (GPU tensors are never copied to the host).
struct Flat {
  at::Tensor t;
  char* base = nullptr;  // element 0 (element `first` of t)
  int64_t esize = 1, first = 0;
  bool cpu = true;
  Flat() = default;
  explicit Flat(at::Tensor x)
      : t(std::move(x)), base(static_cast<char*>(t.data_ptr())), esize(t.element_size()),
        cpu(t.is_cpu()) {}
  char* at(int64_t off) const { return base + off * esize; }
  int64_t bytes(int64_t count) const { return count * esize; }
  at::Tensor view(int64_t off, int64_t count) const {
    return t.view({-1}).narrow(0, first + off, count);
  }
  Flat from(int64_t off) const {  // the same memory from element `off` on
    Flat f = *this;
    f.base = at(off);
    f.first += off;
    return f;
  }
  static Flat empty(int64_t numel, const at::Tensor& like) {
    return Flat(at::empty({numel}, like.options()));
  }
};

constexpr int64_t kLoopMax = 1 << 16;  // elements; above, ATen's vectorized parallel kernels

template <typename T, typename F>
void apply(T* __restrict__ a, const T* __restrict__ b, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) a[i] = f(a[i], b[i]);
}

// a = a (op) b on CPU, elementwise, with ATen's semantics: integers wrap. MIN/MAX of
// floats are mpi_util.h's ordered ones (as the phases the MPI library runs): NaN
// propagates and the result never depends on the operand order, which differs by rank.
template <typename T>
void reduce_loop(T* a, const T* b, int64_t n, int code) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<decltype(T() + T())>;  // wrap without signed overflow
    switch (code) {
      case SUM: return apply(a, b, n, [](T x, T y) { return T(U(x) + U(y)); });
      case PRODUCT: return apply(a, b, n, [](T x, T y) { return T(U(x) * U(y)); });
      case MIN: return apply(a, b, n, [](T x, T y) { return y < x ? y : x; });
      case MAX: return apply(a, b, n, [](T x, T y) { return x < y ? y : x; });
      case BAND: return apply(a, b, n, [](T x, T y) { return T(x & y); });
      case BOR: return apply(a, b, n, [](T x, T y) { return T(x | y); });
      case BXOR: return apply(a, b, n, [](T x, T y) { return T(x ^ y); });
    }
  } else {
    switch (code) {
      case SUM: return apply(a, b, n, [](T x, T y) { return x + y; });
      case PRODUCT: return apply(a, b, n, [](T x, T y) { return x * y; });
      case MIN: return apply(a, b, n, [](T x, T y) { return ordered_minmax<T, false>(x, y); });
      case MAX: return apply(a, b, n, [](T x, T y) { return ordered_minmax<T, true>(x, y); });
    }
  }
  throw_invalid(std::string("pccl: reduce op ") + reduce_name(code) + " is not defined for this dtype");
}

// acc[aoff:aoff+n] = acc[...] (op) x[xoff:xoff+n], on the tensors' device.
void reduce_into(const Flat& acc, int64_t aoff, const Flat& x, int64_t xoff, int64_t n, int code) {
  if (n == 0) return;
  // MIN/MAX in these loops at any size: ATen's depend on the operand order over -0, +0
  if (acc.cpu && x.cpu && (n <= kLoopMax || code == MIN || code == MAX)) {
    switch (acc.t.scalar_type()) {
      case at::kFloat: return reduce_loop((float*)acc.at(aoff), (const float*)x.at(xoff), n, code);
      case at::kDouble: return reduce_loop((double*)acc.at(aoff), (const double*)x.at(xoff), n, code);
      case at::kChar: return reduce_loop((int8_t*)acc.at(aoff), (const int8_t*)x.at(xoff), n, code);
      case at::kByte: return reduce_loop((uint8_t*)acc.at(aoff), (const uint8_t*)x.at(xoff), n, code);
      case at::kInt: return reduce_loop((int32_t*)acc.at(aoff), (const int32_t*)x.at(xoff), n, code);
      case at::kLong: return reduce_loop((int64_t*)acc.at(aoff), (const int64_t*)x.at(xoff), n, code);
      default: break;  // other dtypes: ATen below
    }
  }
  at::Tensor a = acc.view(aoff, n), b = x.view(xoff, n);
  switch (code) {
    case SUM: a.add_(b); break;
    case PRODUCT: a.mul_(b); break;
    case MIN: at::minimum_out(a, a, b); break;
    case MAX: at::maximum_out(a, a, b); break;
    case BAND: a.bitwise_and_(b); break;
    case BOR: a.bitwise_or_(b); break;
    case BXOR: a.bitwise_xor_(b); break;
    default: throw_invalid(std::string("pccl: reduce op ") + reduce_name(code) + " unsupported");
  }
}

// dst[doff:doff+n] = src[soff:soff+n]
void copy_into(const Flat& dst, int64_t doff, const Flat& src, int64_t soff, int64_t n) {
  if (n == 0) return;
  if (dst.cpu && src.cpu)
    std::memcpy(dst.at(doff), src.at(soff), dst.bytes(n));
  else
    dst.view(doff, n).copy_(src.view(soff, n));
}

// One step: post requests, wait for all of them, then run `after` (may be empty). A step
// of the MPI library's blocking collective has `block` (returning its MPI error code)
// instead of `post`.
struct Step {
  std::function<void(std::vector<MPI_Request>&)> post;
  std::function<void()> after;
  std::function<int()> block = nullptr;
  const char* block_name = "";
};

// Where a schedule's blocking steps run: on the thread of a blocking call (`caller`),
// under the watchdog, else on the communicator's issue thread (an async op's steps are
// driven by the lane, which must never block: the variant of a step depends only on its
// size, never on async_op, as MPI does not match a blocking collective with a
// nonblocking one).
struct BlockingRun {
  const char* op = "";     // the Work's op name (the watchdog's message)
  std::thread::id caller;  // default: none (async)
  std::shared_ptr<Issuer> issuer;
  const std::string* group = nullptr;
  uint64_t seq = 0;
  double timeout_s = 0;
  std::chrono::steady_clock::time_point start;  // a blocking op's: when its wait began
  std::weak_ptr<Lane> lane;  // its communicator's: failed once an op timed out
  std::shared_ptr<std::atomic<uint64_t>> count;  // the communicator's blocking steps run
};

// An op's outcome, which the next op of its communicator waits for before it starts.
// After a failure (a step's MPI call returned an error, e.g. MPI_ERR_TRUNCATE when ranks
// passed different counts) the ranks no longer issue matching messages, so the ops
// behind it fail at once with its error rather than wait out their timeout on it.
struct Outcome {
  enum : int { kRunning, kDone, kFailed };
  std::atomic<int> state{kRunning};
  std::string why;             // kFailed: the first failed op's error (written before state)
  std::shared_ptr<void> keep;  // the failed op's schedule: requests it left posted may
                               // still write into its buffers (never freed, as a timed-out
                               // op's are kept by its lane)
};

// The error of an op refused because an earlier op of its communicator failed.
[[noreturn]] void throw_after_failure(const char* op, const std::string& group,
                                      const std::string& why) {
  throw Error(ErrorKind::Runtime,
              std::string("pccl ") + op + " (group " + group + ") was not run: an earlier "
              "op of this communicator failed, and its ranks no longer issue matching "
              "messages; finalize and restart the job. The first error: " + why);
}

struct Schedule {
  std::vector<Step> steps;
  std::vector<at::Tensor> keep;  // buffers the requests use
  std::vector<MPI_Request> reqs;
  std::vector<MPI_Status> statuses;
  size_t i = 0;
  bool posted = false;
  std::shared_ptr<Outcome> done = std::make_shared<Outcome>();
  std::shared_ptr<Outcome> prev;  // the previous op of this communicator
  const char* op = "";
  BlockingRun run;
  std::shared_ptr<Issued> issued;  // the current blocking step, on the issue thread

  bool test() {
    if (prev) {
      const int state = prev->state.load(std::memory_order_acquire);
      if (state == Outcome::kRunning) {
        // behind an op that timed out (its lane failed then): that op never finishes here
        if (auto lane = run.lane.lock(); lane && !lane->healthy()) lane->throw_unhealthy(run.op);
        return false;
      }
      if (state == Outcome::kFailed) {
        done->why = prev->why;  // the ops behind this one report the first error too
        done->state.store(Outcome::kFailed, std::memory_order_release);
        throw_after_failure(run.op, *run.group, prev->why);
      }
      prev.reset();
    }
    while (i < steps.size()) {
      if (!posted) {
        reqs.clear();
        if (steps[i].block) {
          start_blocking(steps[i]);
        } else if (steps[i].post) {
          steps[i].post(reqs);
        }
        posted = true;
      }
      if (issued) {
        if (!issued->issued(steps[i].block_name)) return false;
        issued.reset();
      }
      if (!reqs.empty()) {
        int flag = 0;
        statuses.resize(reqs.size());  // a failed request's status names the cause
        const int rc = MPI_Testall((int)reqs.size(), reqs.data(), &flag, statuses.data());
        check_mpi(request_error(rc, statuses), op);
        if (!flag) return false;
      }
      if (steps[i].after) steps[i].after();
      ++i;
      posted = false;
    }
    done->state.store(Outcome::kDone, std::memory_order_release);
    return true;
  }

  // A step threw `e` (self: this schedule's owner): the ops behind it fail at once.
  void failed(const std::exception& e, std::shared_ptr<Schedule> self) {
    if (done->state.load(std::memory_order_relaxed) != Outcome::kRunning) return;  // refused
    done->why = e.what();
    if (posted || i > 0) done->keep = std::move(self);  // it posted requests
    done->state.store(Outcome::kFailed, std::memory_order_release);
  }

  // Runs a blocking step here (the caller of a blocking op) or queues it on the issue
  // thread (`issued` then tracks it).
  void start_blocking(const Step& st) {
    run.count->fetch_add(1, std::memory_order_relaxed);
    if (std::this_thread::get_id() == run.caller) {
      static const std::string backend = "pccl";
      int rc;
      {
        // The waiter of a blocking op holds no GIL here (launch_work released it). The
        // step may take what is left of the op's timeout.
        const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - run.start;
        if (spent.count() >= run.timeout_s)  // out of time already: fail as a wait would,
          throw Error(ErrorKind::Timeout,    // instead of a call only MPI_Abort can end
                      timeout_message(run.op, backend, *run.group, run.seq, run.timeout_s));
        WatchGuard watch(run.op, &backend, run.group, run.seq, run.timeout_s, spent.count());
        rc = st.block();
      }
      check_mpi(rc, st.block_name);
      return;
    }
    auto is = std::make_shared<Issued>();
    run.issuer->push([is, fn = st.block] { is->set(fn()); });
    issued = std::move(is);
  }
};

struct Peer {
  MPI_Comm comm;
  int rank, size, tag;
};

// Send / receive `count` elements of `f` from element offset `off`.
void isend(std::vector<MPI_Request>& r, const Flat& f, int64_t off, int64_t count, int dst,
           const Peer& c) {
  r.push_back(MPI_REQUEST_NULL);
  check_mpi(MPIC(MPI_Isend)(f.at(off), to_mcount(f.bytes(count), "pccl"), MPI_BYTE, dst, c.tag,
                            c.comm, &r.back()),
            "MPI_Isend");
}

void irecv(std::vector<MPI_Request>& r, const Flat& f, int64_t off, int64_t count, int src,
           const Peer& c) {
  r.push_back(MPI_REQUEST_NULL);
  check_mpi(MPIC(MPI_Irecv)(f.at(off), to_mcount(f.bytes(count), "pccl"), MPI_BYTE, src, c.tag,
                            c.comm, &r.back()),
            "MPI_Irecv");
}

// Pairs folded for recursive doubling/halving over p ranks.
struct Fold {
  int p2, rem;
  explicit Fold(int p) : p2(1) {
    while (p2 * 2 <= p) p2 *= 2;
    rem = p - p2;
  }
  int survivor(int r) const { return r < 2 * rem ? (r % 2 == 0 ? r / 2 : -1) : r - rem; }
  int rank_of(int s) const { return s < rem ? 2 * s : s + rem; }
  int lo(int s) const { return s < rem ? 2 * s : s + rem; }         // first block of survivor s
  int hi(int s) const { return s < rem ? 2 * s + 2 : s + rem + 1; }  // one past its last block
};

// All-gather of p blocks of n elements in `buf` (this rank's block already in place).
// `blocking`: Algo::Mpi runs the blocking MPI collective (Step::block).
void all_gather_steps(Schedule& s, const Flat& buf, int64_t n, const Peer& c, Algo algo,
                      bool blocking = false) {
  const int p = c.size, r = c.rank;
  if (p == 1) return;
  // blocks [lo, hi) of buf
  auto send = [buf, n, c](auto& q, int lo, int hi, int dst) { isend(q, buf, lo * n, (hi - lo) * n, dst, c); };
  auto recv = [buf, n, c](auto& q, int lo, int hi, int src) { irecv(q, buf, lo * n, (hi - lo) * n, src, c); };
  if (algo == Algo::Mpi) {
    const mcount bytes = to_mcount(buf.bytes(n), "pccl all_gather");
    if (blocking) {
      s.steps.push_back({nullptr, nullptr,
                         [buf, bytes, c] {
                           return MPIC(MPI_Allgather)(MPI_IN_PLACE, 0, MPI_BYTE, buf.base, bytes,
                                                      MPI_BYTE, c.comm);
                         },
                         "MPI_Allgather"});
      return;
    }
    s.steps.push_back({[buf, bytes, c](std::vector<MPI_Request>& q) {
                         q.push_back(MPI_REQUEST_NULL);
                         check_mpi(MPIC(MPI_Iallgather)(MPI_IN_PLACE, 0, MPI_BYTE, buf.base,
                                                        bytes, MPI_BYTE, c.comm, &q.back()),
                                   "MPI_Iallgather");
                       },
                       nullptr});
    return;
  }
  if (algo == Algo::Ring) {
    const int right = (r + 1) % p, left = (r - 1 + p) % p;
    for (int k = 0; k < p - 1; ++k) {
      int send_b = ((r - k) % p + p) % p, recv_b = ((r - k - 1) % p + p) % p;
      s.steps.push_back({[=](auto& q) {
                           recv(q, recv_b, recv_b + 1, left);
                           send(q, send_b, send_b + 1, right);
                         },
                         nullptr});
    }
    return;
  }
  Fold f(p);
  const int me = f.survivor(r);
  if (r < 2 * f.rem) {  // fold: the odd rank's block goes to its even partner
    if (r % 2)
      s.steps.push_back({[=](auto& q) { send(q, r, r + 1, r - 1); }, nullptr});
    else
      s.steps.push_back({[=](auto& q) { recv(q, r + 1, r + 2, r + 1); }, nullptr});
  }
  if (me >= 0) {
    for (int d = 1; d < f.p2; d *= 2) {
      int other = me ^ d, mine = me & ~(d - 1), theirs = other & ~(d - 1);
      int peer = f.rank_of(other);
      int olo = f.lo(mine), ohi = f.hi(mine + d - 1), ilo = f.lo(theirs), ihi = f.hi(theirs + d - 1);
      s.steps.push_back({[=](auto& q) {
                           recv(q, ilo, ihi, peer);
                           send(q, olo, ohi, peer);
                         },
                         nullptr});
    }
  }
  if (r < 2 * f.rem) {  // unfold: the even rank hands everything else to the odd one
    if (r % 2)
      s.steps.push_back({[=](auto& q) {
                           recv(q, 0, r, r - 1);
                           recv(q, r + 1, p, r - 1);
                         },
                         nullptr});
    else
      s.steps.push_back({[=](auto& q) {
                           send(q, 0, r + 1, r + 1);
                           send(q, r + 2, p, r + 1);
                         },
                         nullptr});
  }
}

// Reduce-scatter: `acc` holds p blocks of n elements (overwritten as the work buffer),
// `tmp` at least as many; this rank's reduced block ends in `out`.
void reduce_scatter_steps(Schedule& s, const Flat& acc, const Flat& tmp, const Flat& out,
                          int64_t n, int code, const Peer& c, Algo algo, bool blocking = false) {
  const int p = c.size, r = c.rank;
  if (p == 1) {
    s.steps.push_back({nullptr, [=] { copy_into(out, 0, acc, 0, n); }});
    return;
  }
  if (algo == Algo::Mpi) {
    const MPI_Datatype dt = move_type(acc.t.scalar_type());
    const MPI_Op op = mpi_op(code, dt);
    if (blocking) {
      s.steps.push_back({nullptr, nullptr,
                         [=] {
                           return MPIC(MPI_Reduce_scatter_block)(
                               acc.base, out.base, to_mcount(n, "pccl reduce_scatter"), dt, op,
                               c.comm);
                         },
                         "MPI_Reduce_scatter_block"});
      return;
    }
    s.steps.push_back({[=](std::vector<MPI_Request>& q) {
                         q.push_back(MPI_REQUEST_NULL);
                         check_mpi(MPIC(MPI_Ireduce_scatter_block)(
                                       acc.base, out.base, to_mcount(n, "pccl reduce_scatter"),
                                       dt, op, c.comm, &q.back()),
                                   "MPI_Ireduce_scatter_block");
                       },
                       nullptr});
    return;
  }
  if (algo == Algo::Ring) {
    const int right = (r + 1) % p, left = (r - 1 + p) % p;
    for (int k = 0; k < p - 1; ++k) {
      int send_b = ((r - k - 1) % p + p) % p, recv_b = ((r - k - 2) % p + p) % p;
      s.steps.push_back({[=](auto& q) {
                           irecv(q, tmp, 0, n, left, c);
                           isend(q, acc, send_b * n, n, right, c);
                         },
                         [=] { reduce_into(acc, recv_b * n, tmp, 0, n, code); }});
    }
    s.steps.push_back({nullptr, [=] { copy_into(out, 0, acc, r * n, n); }});
    return;
  }
  Fold f(p);
  const int me = f.survivor(r);
  if (r < 2 * f.rem) {  // fold: the odd rank's whole vector is reduced into the even one's
    if (r % 2)
      s.steps.push_back({[=](auto& q) { isend(q, acc, 0, p * n, r - 1, c); }, nullptr});
    else
      s.steps.push_back({[=](auto& q) { irecv(q, tmp, 0, p * n, r + 1, c); },
                         [=] { reduce_into(acc, 0, tmp, 0, p * n, code); }});
  }
  if (me >= 0) {
    int base = 0;
    for (int d = f.p2 / 2; d >= 1; d /= 2) {
      int other = me ^ d, peer = f.rank_of(other);
      bool lower = (me & d) == 0;
      int keep0 = lower ? base : base + d, send0 = lower ? base + d : base;
      int64_t klo = f.lo(keep0) * n, kn = (f.hi(keep0 + d - 1) - f.lo(keep0)) * n;
      int64_t slo = f.lo(send0) * n, sn = (f.hi(send0 + d - 1) - f.lo(send0)) * n;
      s.steps.push_back({[=](auto& q) {
                           irecv(q, tmp, klo, kn, peer, c);
                           isend(q, acc, slo, sn, peer, c);
                         },
                         [=] { reduce_into(acc, klo, tmp, klo, kn, code); }});
      base = keep0;
    }
    if (me < f.rem)  // this survivor also reduced its folded partner's block: hand it back
      s.steps.push_back({[=](auto& q) { isend(q, acc, (r + 1) * n, n, r + 1, c); }, nullptr});
    s.steps.push_back({nullptr, [=] { copy_into(out, 0, acc, r * n, n); }});
  } else {
    s.steps.push_back({[=](auto& q) { irecv(q, out, 0, n, r - 1, c); }, nullptr});
  }
}

// The [local][node] order of a hierarchical group: idx[l * N + j] = the group rank of
// (node j, local l).
struct Perm {
  std::vector<int64_t> idx;
  at::Tensor t;  // idx as a tensor, for ATen on other devices
  explicit Perm(std::vector<int64_t> v) : idx(std::move(v)) {
    t = at::empty({(int64_t)idx.size()}, at::TensorOptions().dtype(at::kLong));
    std::memcpy(t.data_ptr(), idx.data(), idx.size() * sizeof(int64_t));
  }
  // Between rank order (`ranked`) and [local][node] order (`grouped`), blocks of n:
  // scatter: ranked[idx[i]] = grouped[i]; else grouped[i] = ranked[idx[i]].
  void apply(const Flat& ranked, const Flat& grouped, int64_t n, bool scatter) const {
    const int64_t P = (int64_t)idx.size();
    if (ranked.cpu && grouped.cpu) {
      for (int64_t i = 0; i < P; ++i)
        scatter ? copy_into(ranked, idx[i] * n, grouped, i * n, n)
                : copy_into(grouped, i * n, ranked, idx[i] * n, n);
      return;
    }
    at::Tensor perm = t.to(ranked.t.device());
    at::Tensor r = ranked.view(0, P * n).view({P, n}), g = grouped.view(0, P * n).view({P, n});
    if (scatter)
      r.index_copy_(0, perm, g);
    else
      at::index_select_out(g, r, 0, perm);
  }
};

// A flat view of a contiguous tensor argument (no ATen op: the hot path of small calls).
Flat flat_contiguous(py::handle h, const char* op, const char* arg) {
  at::Tensor t = to_tensor(h, op, arg);
  if (!t.is_contiguous())
    throw_invalid(std::string(op) + ": pccl '" + arg + "' must be contiguous");
  return Flat(std::move(t));
}

}  // namespace

class PcclComm {
 public:
  // inter/intra: mpi4py handles (intra may be 0 = none: a flat communicator). perm: for
  // each position l * N + j of the [local][node] order, the group rank of (node j, local l).
  PcclComm(uint64_t inter, int inter_rank, int inter_size, uint64_t intra, int intra_rank,
           int intra_size, std::vector<int64_t> perm, std::string group,
           std::shared_ptr<Lane> lane, double timeout_s)
      : inter_{comm_from_handle<MPI_Comm>(inter), inter_rank, inter_size, 0},
        intra_{intra ? comm_from_handle<MPI_Comm>(intra) : MPI_COMM_NULL, intra_rank,
               intra ? intra_size : 1, 0},
        group_(std::move(group)), lane_(std::move(lane)), timeout_s_(timeout_s) {
    check_mpi(MPI_Comm_set_errhandler(inter_.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    if (intra) check_mpi(MPI_Comm_set_errhandler(intra_.comm, MPI_ERRORS_RETURN),
                         "MPI_Comm_set_errhandler");
    size_ = inter_.size * intra_.size;
    bool identity = true;
    for (size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == (int64_t)i;
    if (!perm.empty() && (int)perm.size() != size_)
      throw_invalid("PcclComm: perm has " + std::to_string(perm.size()) + " entries for " +
                    std::to_string(size_) + " ranks");
    if (!identity) perm_ = std::make_shared<const Perm>(std::move(perm));
  }

  ~PcclComm() { issuer_->stop(); }
  PcclComm(const PcclComm&) = delete;
  PcclComm& operator=(const PcclComm&) = delete;

  int size() const { return size_; }
  // Blocking MPI collectives run by "mpi" phases: what tests observe of the variant choice.
  uint64_t blocking_steps() const { return blocking_steps_->load(); }

  // set_blocking(op, phase, steps): which variant the "mpi" algorithm of `op`
  // ("all_gather" or "reduce_scatter") runs in `phase` ("inter" or "intra"), by the bytes
  // of that phase's whole buffer (the tuning table's convention, as for the "mpi"
  // backend): (largest bytes, variant code 0/1) steps in increasing size, -1 bytes no limit;
  // sizes past the last step run nonblocking.
  void set_blocking(const std::string& op, const std::string& phase,
                    const BlockingSteps& steps) {
    const int o = op == "all_gather" ? 0 : op == "reduce_scatter" ? 1 : -1;
    const int p = phase == "inter" ? 0 : phase == "intra" ? 1 : -1;
    if (o < 0 || p < 0)
      throw_invalid("set_blocking: expected op all_gather or reduce_scatter and phase inter "
                    "or intra, got " + op + ", " + phase);
    BlockingSteps v = checked_blocking_steps(op, steps);
    std::lock_guard<std::mutex> g(post_mu_);
    choice_[o][p] = std::move(v);
  }

  int nodes() const { return inter_.size; }
  int ranks_per_node() const { return intra_.size; }
  void set_timeout(double t) {
    std::lock_guard<std::mutex> g(post_mu_);  // make_work reads it under the post lock
    timeout_s_ = t;
  }
  double timeout() {
    std::lock_guard<std::mutex> g(post_mu_);
    return timeout_s_;
  }

  // out: size * n elements (rank order), in: n elements; both contiguous.
  py::object all_gather(py::handle output, py::handle input, const std::string& inter_algo,
                        const std::string& intra_algo, bool async_op) {
    const char* op = "all_gather";
    c10::NoGradGuard ng;
    Flat out = flat_contiguous(output, op, "output");
    Flat in = flat_contiguous(input, op, "input");
    Gather g = gather_plan(out, in, inter_algo, intra_algo, op, "output", "the input");
    return post(op, "pccl all_gather", async_op, [&](Schedule& s) { add_gather(s, g); });
  }

  // in: size * n elements (rank order), out: n elements. code: SUM..BXOR (not AVG).
  py::object reduce_scatter(py::handle output, py::handle input, int code,
                            const std::string& inter_algo, const std::string& intra_algo,
                            bool async_op) {
    const char* op = "reduce_scatter";
    c10::NoGradGuard ng;
    Flat out = flat_contiguous(output, op, "output");
    Flat in = flat_contiguous(input, op, "input");
    Scatter r = scatter_plan(out, in, code, inter_algo, intra_algo, op, "the output", "input");
    return post(op, "pccl reduce_scatter", async_op, [&](Schedule& s) { add_scatter(s, r); });
  }

  // buffer: size * m elements (a zero-padded copy of the caller's tensor, which the
  // reduce-scatter overwrites as its work buffer), piece: m elements. The reduce-scatter
  // phases into piece, then the all-gather phases from piece back into buffer, as one op:
  // one Work, one sequence number and one tag, named all_reduce (its timeout and the
  // watchdog's message name the op the caller made). code: not AVG.
  py::object all_reduce(py::handle buffer, py::handle piece, int code,
                        const std::string& inter_algo, const std::string& intra_algo,
                        bool async_op) {
    const char* op = "all_reduce";
    c10::NoGradGuard ng;
    Flat buf = flat_contiguous(buffer, op, "buffer");
    Flat mine = flat_contiguous(piece, op, "piece");
    Scatter r = scatter_plan(mine, buf, code, inter_algo, intra_algo, op, "piece", "buffer", true);
    Gather g = gather_plan(buf, mine, inter_algo, intra_algo, op, "buffer", "piece");
    return post(op, "pccl all_reduce", async_op, [&](Schedule& s) {
      add_scatter(s, r);  // done with buffer before the all-gather writes it
      add_gather(s, g);
    });
  }

 private:
  // One op: its schedule, whose steps `add` appends under the post lock once the op has
  // its sequence number (the tags), then posted or run (blocking) by launch.
  template <typename Add>
  py::object post(const char* op, const char* schedule_name, bool async_op, Add&& add) {
    auto s = std::make_shared<Schedule>();
    s->op = schedule_name;
    std::unique_lock<std::mutex> posted(post_mu_);
    auto w = make_work(op, *s);
    try {
      add(*s);
    } catch (...) {
      --seq_;  // never posted: the tags of this rank's later ops stay the other ranks'
      throw;
    }
    s->prev = last_;  // linked once built: an op that failed to build is not waited for
    last_ = s->done;
    return launch(w, s, async_op, posted);
  }

  // An all-gather's arguments and buffers (allocated before the post lock is taken).
  struct Gather {
    Flat out, in, t1, t2;
    int64_t n;
    Algo ia, la;
    bool direct;  // [local][node] order is already rank order
  };

  // out_arg, in_arg: the arguments' names, for the error message.
  Gather gather_plan(const Flat& out, const Flat& in, const std::string& inter_algo,
                     const std::string& intra_algo, const char* op, const char* out_arg,
                     const char* in_arg) const {
    Algo ia = parse_algo(inter_algo, op, "inter_algo"), la = parse_algo(intra_algo, op, "intra_algo");
    const int64_t n = in.t.numel();
    if (out.t.numel() != n * size_ || out.t.scalar_type() != in.t.scalar_type())
      throw_invalid(std::string("pccl ") + op + ": " + out_arg + " must hold " +
                    std::to_string(size_) + " blocks of " + in_arg + " (dtype " +
                    dtype_name(in.t.scalar_type()) + ")");
    const bool direct = !perm_;
    // inter phase into t1 ([node] blocks), intra phase into t2 ([local][node]), shuffle.
    Flat t2 = direct ? out : Flat::empty(size_ * n, in.t);
    Flat t1 = intra_.size == 1 ? t2 : t2.from(intra_.rank * inter_.size * n);
    return {out, in, t1, t2, n, ia, la, direct};
  }

  // Called with the post lock held, after make_work: the all-gather's steps.
  void add_gather(Schedule& s, const Gather& g) {
    const int N = inter_.size, L = intra_.size;
    const int64_t n = g.n, esz = g.in.t.element_size();
    s.keep.insert(s.keep.end(), {g.out.t, g.in.t, g.t2.t});
    s.steps.push_back({nullptr, [t1 = g.t1, in = g.in, me = inter_.rank, n] {
                         copy_into(t1, me * n, in, 0, n);
                       }});
    all_gather_steps(s, g.t1, n, tagged(inter_), g.ia, blocking(0, 0, N * n * esz));
    if (L > 1)
      all_gather_steps(s, g.t2, N * n, tagged(intra_), g.la, blocking(0, 1, L * N * n * esz));
    if (!g.direct)  // out[perm[i]] = t2[i], blocks of n
      s.steps.push_back({nullptr, [perm = perm_, out = g.out, t2 = g.t2, n] {
                           perm->apply(out, t2, n, true);
                         }});
  }

  // A reduce-scatter's arguments and buffers (allocated before the post lock is taken).
  struct Scatter {
    Flat out, in, acc, tmp, mid;
    int64_t n;
    int code;
    Algo ia, la;
    bool in_place;  // acc is the input itself: no copy step
  };

  // out_arg, in_arg: the arguments' names, for the error message. scratch: `in` is the
  // op's own (all_reduce's padded copy), so in rank order it is the work buffer itself.
  Scatter scatter_plan(const Flat& out, const Flat& in, int code, const std::string& inter_algo,
                       const std::string& intra_algo, const char* op, const char* out_arg,
                       const char* in_arg, bool scratch = false) const {
    Algo ia = parse_algo(inter_algo, op, "inter_algo"), la = parse_algo(intra_algo, op, "intra_algo");
    const int64_t n = out.t.numel();
    if (in.t.numel() != n * size_ || out.t.scalar_type() != in.t.scalar_type())
      throw_invalid(std::string("pccl ") + op + ": " + in_arg + " must hold " +
                    std::to_string(size_) + " blocks of " + out_arg + " (dtype " +
                    dtype_name(out.t.scalar_type()) + ")");
    mpi_op(code);  // rejects AVG and unknown codes
    // acc: the input in [local][node] order (a copy: the algorithms overwrite it).
    const bool in_place = scratch && !perm_;
    Flat acc = in_place ? in : Flat::empty(size_ * n, in.t);
    Flat tmp = Flat::empty(size_ * n, in.t);
    Flat mid = intra_.size > 1 ? Flat::empty(inter_.size * n, in.t) : acc;
    return {out, in, acc, tmp, mid, n, code, ia, la, in_place};
  }

  // Called with the post lock held, after make_work: the reduce-scatter's steps.
  void add_scatter(Schedule& s, const Scatter& r) {
    const int N = inter_.size, L = intra_.size;
    const int64_t n = r.n, esz = r.out.t.element_size(), total = size_ * n;
    s.keep.insert(s.keep.end(), {r.out.t, r.in.t, r.acc.t, r.tmp.t, r.mid.t});
    if (r.in_place) {
      // the input is the work buffer
    } else if (!perm_) {
      s.steps.push_back({nullptr, [acc = r.acc, in = r.in, total] {
                           copy_into(acc, 0, in, 0, total);
                         }});
    } else {  // acc[i] = in[perm[i]], blocks of n
      s.steps.push_back({nullptr, [perm = perm_, acc = r.acc, in = r.in, n] {
                           perm->apply(in, acc, n, false);
                         }});
    }
    if (L > 1)
      reduce_scatter_steps(s, r.acc, r.tmp, r.mid, N * n, r.code, tagged(intra_), r.la,
                           blocking(1, 1, L * N * n * esz));
    reduce_scatter_steps(s, r.mid, r.tmp, r.out, n, r.code, tagged(inter_), r.ia,
                         blocking(1, 0, N * n * esz));
  }

  Peer tagged(Peer c) const {
    c.tag = (int)(seq_ % kTagSpace);
    return c;
  }

  // Called with the post lock held: the op's sequence number and its place in the order.
  std::shared_ptr<Work> make_work(const char* op, Schedule& s) {
    if (!lane_->healthy()) lane_->throw_unhealthy(op);
    if (last_ && last_->state.load(std::memory_order_acquire) == Outcome::kFailed)
      throw_after_failure(op, group_, last_->why);
    auto w = std::make_shared<Work>(op, "pccl", group_, ++seq_, timeout_s_, lane_);
    s.run.op = op;
    s.run.issuer = issuer_;
    s.run.group = &group_;
    s.run.seq = seq_;
    s.run.timeout_s = timeout_s_;
    s.run.count = blocking_steps_;
    s.run.lane = lane_;
    return w;
  }

  // Called with the post lock held: whether the "mpi" algorithm of op `o` in phase `p`
  // runs the blocking collective for a buffer of `nbytes`.
  bool blocking(int o, int p, int64_t nbytes) const {
    return variant_at(choice_[o][p], nbytes) != kVarNonblocking;
  }

  py::object launch(const std::shared_ptr<Work>& w, std::shared_ptr<Schedule> s, bool async_op,
                    std::unique_lock<std::mutex>& posted) {
    if (!async_op) {  // before anyone polls it
      s->run.caller = std::this_thread::get_id();
      s->run.start = std::chrono::steady_clock::now();
    }
    posted.unlock();
    w->test = [s, work = w.get()] {  // the Work owns this function: `work` outlives it
      const size_t step = s->i;
      bool done;
      try {
        done = s->test();
      } catch (const std::exception& e) {
        s->failed(e, s);
        throw;  // the Work fails with it
      }
      if (s->i != step) work->advanced();  // a step completed: the lane keeps polling
      return done;
    };
    return launch_work(lane_, w, async_op);
  }

  Peer inter_, intra_;
  int size_ = 1;
  std::shared_ptr<const Perm> perm_;  // null: the identity
  std::string group_;
  std::shared_ptr<Lane> lane_;
  double timeout_s_;
  uint64_t seq_ = 0;
  std::shared_ptr<Outcome> last_;
  std::mutex post_mu_;
  BlockingSteps choice_[2][2];  // [all_gather, reduce_scatter][inter, intra]
  std::shared_ptr<Issuer> issuer_ = std::make_shared<Issuer>();
  std::shared_ptr<std::atomic<uint64_t>> blocking_steps_ =
      std::make_shared<std::atomic<uint64_t>>(0);
};

void bind_pccl(py::module_& m) {
  using py::arg;
  py::class_<PcclComm>(m, "PcclComm",
                       "Hierarchical all-gather / reduce-scatter over an inter-node and an "
                       "intra-node MPI communicator (see mcrdl/csrc/pccl.cpp).")
      .def(py::init<uint64_t, int, int, uint64_t, int, int, std::vector<int64_t>, std::string,
                    std::shared_ptr<Lane>, double>(),
           arg("inter"), arg("inter_rank"), arg("inter_size"), arg("intra"), arg("intra_rank"),
           arg("intra_size"), arg("perm"), arg("group"), arg("lane"), arg("timeout"))
      .def_property_readonly("size", &PcclComm::size)
      .def_property_readonly("nodes", &PcclComm::nodes)
      .def_property_readonly("ranks_per_node", &PcclComm::ranks_per_node)
      .def("set_timeout", &PcclComm::set_timeout)
      .def_property_readonly("timeout", &PcclComm::timeout, "Seconds: the timeout of its ops.")
      .def("set_blocking", &PcclComm::set_blocking, arg("op"), arg("phase"), arg("steps"),
           "Which variant the \"mpi\" algorithm of op in phase runs, by size: (largest "
           "bytes, blocking) steps, -1 bytes meaning no limit.")
      .def_property_readonly("blocking_steps", &PcclComm::blocking_steps,
                             "Blocking MPI collectives its \"mpi\" phases ran so far.")
      .def("all_gather", &PcclComm::all_gather, arg("output"), arg("input"), arg("inter_algo"),
           arg("intra_algo"), arg("async_op"))
      .def("reduce_scatter", &PcclComm::reduce_scatter, arg("output"), arg("input"), arg("op"),
           arg("inter_algo"), arg("intra_algo"), arg("async_op"))
      .def("all_reduce", &PcclComm::all_reduce, arg("buffer"), arg("piece"), arg("op"),
           arg("inter_algo"), arg("intra_algo"), arg("async_op"),
           "all_reduce of buffer (size * len(piece) elements) through piece: the "
           "reduce-scatter then the all-gather, as one op.");
}

}  // namespace mcrdl
