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

#include "launch_work.h"
#include "mpi_util.h"
#include "pyargs.h"

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

MPI_Op mpi_op(int code) {
  switch (code) {
    case SUM: return MPI_SUM;
    case PRODUCT: return MPI_PROD;
    case MIN: return MPI_MIN;
    case MAX: return MPI_MAX;
    case BAND: return MPI_BAND;
    case BOR: return MPI_BOR;
    case BXOR: return MPI_BXOR;
    default: throw_invalid(std::string("pccl: reduce op ") + reduce_name(code) +
                           " must be mapped by the Python layer");
  }
}

// acc = acc (op) x, elementwise, on the tensors' device.
void reduce_into(at::Tensor& acc, const at::Tensor& x, int code) {
  switch (code) {
    case SUM: acc.add_(x); break;
    case PRODUCT: acc.mul_(x); break;
    case MIN: at::minimum_out(acc, acc, x); break;
    case MAX: at::maximum_out(acc, acc, x); break;
    case BAND: acc.bitwise_and_(x); break;
    case BOR: acc.bitwise_or_(x); break;
    case BXOR: acc.bitwise_xor_(x); break;
    default: throw_invalid(std::string("pccl: reduce op ") + reduce_name(code) + " unsupported");
  }
}

// One step: post requests, wait for all of them, then run `after` (may be empty).
struct Step {
  std::function<void(std::vector<MPI_Request>&)> post;
  std::function<void()> after;
};

struct Schedule {
  std::vector<Step> steps;
  std::vector<at::Tensor> keep;  // buffers the requests use
  std::vector<MPI_Request> reqs;
  size_t i = 0;
  bool posted = false;
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<bool>> prev;  // the previous op of this communicator
  const char* op = "";

  bool test() {
    if (prev) {
      if (!prev->load(std::memory_order_acquire)) return false;
      prev.reset();
    }
    while (i < steps.size()) {
      if (!posted) {
        reqs.clear();
        if (steps[i].post) steps[i].post(reqs);
        posted = true;
      }
      if (!reqs.empty()) {
        int flag = 0;
        check_mpi(MPI_Testall((int)reqs.size(), reqs.data(), &flag, MPI_STATUSES_IGNORE), op);
        if (!flag) return false;
      }
      if (steps[i].after) steps[i].after();
      ++i;
      posted = false;
    }
    done->store(true, std::memory_order_release);
    return true;
  }
};

// A view of blocks [lo, hi) of a flat tensor of n-element blocks.
inline at::Tensor blocks(const at::Tensor& t, int64_t n, int64_t lo, int64_t hi) {
  return t.narrow(0, lo * n, (hi - lo) * n);
}

struct Peer {
  MPI_Comm comm;
  int rank, size, tag;
};

void isend(std::vector<MPI_Request>& r, const at::Tensor& t, int dst, const Peer& c) {
  r.push_back(MPI_REQUEST_NULL);
  check_mpi(MPIC(MPI_Isend)(t.data_ptr(), to_mcount(t.nbytes(), "pccl"), MPI_BYTE, dst, c.tag,
                            c.comm, &r.back()),
            "MPI_Isend");
}

void irecv(std::vector<MPI_Request>& r, const at::Tensor& t, int src, const Peer& c) {
  r.push_back(MPI_REQUEST_NULL);
  check_mpi(MPIC(MPI_Irecv)(t.data_ptr(), to_mcount(t.nbytes(), "pccl"), MPI_BYTE, src, c.tag,
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
void all_gather_steps(Schedule& s, const at::Tensor& buf, int64_t n, const Peer& c, Algo algo) {
  const int p = c.size, r = c.rank;
  if (p == 1) return;
  if (algo == Algo::Mpi) {
    s.steps.push_back({[buf, n, c](std::vector<MPI_Request>& q) {
                         q.push_back(MPI_REQUEST_NULL);
                         mcount bytes = to_mcount(n * buf.element_size(), "pccl all_gather");
                         check_mpi(MPIC(MPI_Iallgather)(MPI_IN_PLACE, 0, MPI_BYTE, buf.data_ptr(),
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
      s.steps.push_back({[=](std::vector<MPI_Request>& q) {
                           irecv(q, blocks(buf, n, recv_b, recv_b + 1), left, c);
                           isend(q, blocks(buf, n, send_b, send_b + 1), right, c);
                         },
                         nullptr});
    }
    return;
  }
  Fold f(p);
  const int me = f.survivor(r);
  if (r < 2 * f.rem) {  // fold: the odd rank's block goes to its even partner
    if (r % 2)
      s.steps.push_back({[=](auto& q) { isend(q, blocks(buf, n, r, r + 1), r - 1, c); }, nullptr});
    else
      s.steps.push_back(
          {[=](auto& q) { irecv(q, blocks(buf, n, r + 1, r + 2), r + 1, c); }, nullptr});
  }
  if (me >= 0) {
    for (int d = 1; d < f.p2; d *= 2) {
      int other = me ^ d, mine = me & ~(d - 1), theirs = other & ~(d - 1);
      int peer = f.rank_of(other);
      at::Tensor out = blocks(buf, n, f.lo(mine), f.hi(mine + d - 1));
      at::Tensor in = blocks(buf, n, f.lo(theirs), f.hi(theirs + d - 1));
      s.steps.push_back({[=](auto& q) {
                           irecv(q, in, peer, c);
                           isend(q, out, peer, c);
                         },
                         nullptr});
    }
  }
  if (r < 2 * f.rem) {  // unfold: the even rank hands everything else to the odd one
    if (r % 2)
      s.steps.push_back({[=](auto& q) {
                           irecv(q, blocks(buf, n, 0, r), r - 1, c);
                           irecv(q, blocks(buf, n, r + 1, p), r - 1, c);
                         },
                         nullptr});
    else
      s.steps.push_back({[=](auto& q) {
                           isend(q, blocks(buf, n, 0, r + 1), r + 1, c);
                           isend(q, blocks(buf, n, r + 2, p), r + 1, c);
                         },
                         nullptr});
  }
}

// Reduce-scatter: `acc` holds p blocks of n elements (overwritten as the work buffer),
// `tmp` at least as many; this rank's reduced block ends in `out`.
void reduce_scatter_steps(Schedule& s, const at::Tensor& acc, const at::Tensor& tmp,
                          const at::Tensor& out, int64_t n, int code, const Peer& c, Algo algo) {
  const int p = c.size, r = c.rank;
  if (p == 1) {
    s.steps.push_back({nullptr, [=]() mutable { out.copy_(blocks(acc, n, 0, 1)); }});
    return;
  }
  if (algo == Algo::Mpi) {
    s.steps.push_back({[=](std::vector<MPI_Request>& q) {
                         q.push_back(MPI_REQUEST_NULL);
                         check_mpi(MPIC(MPI_Ireduce_scatter_block)(
                                       acc.data_ptr(), out.data_ptr(),
                                       to_mcount(n, "pccl reduce_scatter"),
                                       move_type(acc.scalar_type()), mpi_op(code), c.comm,
                                       &q.back()),
                                   "MPI_Ireduce_scatter_block");
                       },
                       nullptr});
    return;
  }
  if (algo == Algo::Ring) {
    const int right = (r + 1) % p, left = (r - 1 + p) % p;
    at::Tensor t = blocks(tmp, n, 0, 1);
    for (int k = 0; k < p - 1; ++k) {
      int send_b = ((r - k - 1) % p + p) % p, recv_b = ((r - k - 2) % p + p) % p;
      s.steps.push_back({[=](auto& q) {
                           irecv(q, t, left, c);
                           isend(q, blocks(acc, n, send_b, send_b + 1), right, c);
                         },
                         [=]() mutable {
                           at::Tensor a = blocks(acc, n, recv_b, recv_b + 1);
                           reduce_into(a, t, code);
                         }});
    }
    s.steps.push_back({nullptr, [=]() mutable { out.copy_(blocks(acc, n, r, r + 1)); }});
    return;
  }
  Fold f(p);
  const int me = f.survivor(r);
  if (r < 2 * f.rem) {  // fold: the odd rank's whole vector is reduced into the even one's
    if (r % 2) {
      s.steps.push_back({[=](auto& q) { isend(q, blocks(acc, n, 0, p), r - 1, c); }, nullptr});
    } else {
      s.steps.push_back({[=](auto& q) { irecv(q, blocks(tmp, n, 0, p), r + 1, c); },
                         [=]() mutable {
                           at::Tensor a = blocks(acc, n, 0, p);
                           reduce_into(a, blocks(tmp, n, 0, p), code);
                         }});
    }
  }
  if (me >= 0) {
    int base = 0;
    for (int d = f.p2 / 2; d >= 1; d /= 2) {
      int other = me ^ d, peer = f.rank_of(other);
      bool lower = (me & d) == 0;
      int keep0 = lower ? base : base + d, send0 = lower ? base + d : base;
      int klo = f.lo(keep0), khi = f.hi(keep0 + d - 1);
      int slo = f.lo(send0), shi = f.hi(send0 + d - 1);
      s.steps.push_back({[=](auto& q) {
                           irecv(q, blocks(tmp, n, klo, khi), peer, c);
                           isend(q, blocks(acc, n, slo, shi), peer, c);
                         },
                         [=]() mutable {
                           at::Tensor a = blocks(acc, n, klo, khi);
                           reduce_into(a, blocks(tmp, n, klo, khi), code);
                         }});
      base = keep0;
    }
    if (me < f.rem)  // this survivor also reduced its folded partner's block: hand it back
      s.steps.push_back({[=](auto& q) { isend(q, blocks(acc, n, r + 1, r + 2), r + 1, c); },
                         nullptr});
    s.steps.push_back({nullptr, [=]() mutable { out.copy_(blocks(acc, n, r, r + 1)); }});
  } else {
    s.steps.push_back({[=](auto& q) { irecv(q, out, r - 1, c); }, nullptr});
  }
}

at::Tensor flat_contiguous(py::handle h, const char* op, const char* arg) {
  at::Tensor t = to_tensor(h, op, arg);
  if (!t.is_contiguous())
    throw_invalid(std::string(op) + ": pccl '" + arg + "' must be contiguous");
  return t.view({-1});
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
    if (!identity && !perm.empty()) {
      perm_ = at::empty({(int64_t)perm.size()}, at::TensorOptions().dtype(at::kLong));
      auto a = perm_.accessor<int64_t, 1>();
      for (size_t i = 0; i < perm.size(); ++i) a[i] = perm[i];
    }
  }

  int size() const { return size_; }
  int nodes() const { return inter_.size; }
  int ranks_per_node() const { return intra_.size; }
  void set_timeout(double t) { timeout_s_ = t; }

  // out: size * n elements (rank order), in: n elements; both flat and contiguous.
  py::object all_gather(py::handle output, py::handle input, const std::string& inter_algo,
                        const std::string& intra_algo, bool async_op) {
    const char* op = "all_gather";
    c10::NoGradGuard ng;
    at::Tensor out = flat_contiguous(output, op, "output");
    at::Tensor in = flat_contiguous(input, op, "input");
    Algo ia = parse_algo(inter_algo, op, "inter_algo"), la = parse_algo(intra_algo, op, "intra_algo");
    if (out.numel() != in.numel() * size_ || out.scalar_type() != in.scalar_type())
      throw_invalid("pccl all_gather: output must hold " + std::to_string(size_) +
                    " blocks of the input (dtype " + dtype_name(in.scalar_type()) + ")");
    const int64_t n = in.numel();
    const int N = inter_.size, L = intra_.size;
    auto s = std::make_shared<Schedule>();
    s->op = "pccl all_gather";
    // inter phase into t1 ([node] blocks), intra phase into t2 ([local][node]), shuffle.
    bool direct = !perm_.defined();  // [local][node] order is already rank order
    at::Tensor t2 = direct ? out : at::empty({(int64_t)size_ * n}, in.options());
    at::Tensor t1 = L == 1 ? t2 : blocks(t2, N * n, intra_.rank, intra_.rank + 1);
    s->keep = {out, in, t2};
    const int me = inter_.rank, P = size_;
    s->steps.push_back({nullptr, [=]() mutable { blocks(t1, n, me, me + 1).copy_(in); }});
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op, *s);
    all_gather_steps(*s, t1, n, tagged(inter_), ia);
    if (L > 1) all_gather_steps(*s, t2, N * n, tagged(intra_), la);
    if (!direct)
      s->steps.push_back({nullptr, [=, perm = perm_.to(out.device())]() mutable {
                            out.view({P, n}).index_copy_(0, perm, t2.view({P, n}));
                          }});
    return launch(w, s, async_op, g);
  }

  // in: size * n elements (rank order), out: n elements. code: SUM..BXOR (not AVG).
  py::object reduce_scatter(py::handle output, py::handle input, int code,
                            const std::string& inter_algo, const std::string& intra_algo,
                            bool async_op) {
    const char* op = "reduce_scatter";
    c10::NoGradGuard ng;
    at::Tensor out = flat_contiguous(output, op, "output");
    at::Tensor in = flat_contiguous(input, op, "input");
    Algo ia = parse_algo(inter_algo, op, "inter_algo"), la = parse_algo(intra_algo, op, "intra_algo");
    if (in.numel() != out.numel() * size_ || out.scalar_type() != in.scalar_type())
      throw_invalid("pccl reduce_scatter: input must hold " + std::to_string(size_) +
                    " blocks of the output (dtype " + dtype_name(out.scalar_type()) + ")");
    mpi_op(code);  // rejects AVG and unknown codes
    const int64_t n = out.numel();
    const int N = inter_.size, L = intra_.size;
    auto s = std::make_shared<Schedule>();
    s->op = "pccl reduce_scatter";
    // acc: the input in [local][node] order (a copy: the algorithms overwrite it).
    at::Tensor acc = at::empty({(int64_t)size_ * n}, in.options());
    at::Tensor tmp = at::empty({(int64_t)size_ * n}, in.options());
    at::Tensor mid = L > 1 ? at::empty({(int64_t)N * n}, in.options()) : acc;
    s->keep = {out, in, acc, tmp, mid};
    const int P = size_;
    at::Tensor perm = perm_.defined() ? perm_.to(in.device()) : perm_;
    s->steps.push_back({nullptr, [=]() mutable {
                          if (perm.defined()) {
                            at::Tensor a = acc.view({P, n});
                            at::index_select_out(a, in.view({P, n}), 0, perm);
                          } else {
                            acc.copy_(in);
                          }
                        }});
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op, *s);
    if (L > 1) reduce_scatter_steps(*s, acc, tmp, mid, N * n, code, tagged(intra_), la);
    reduce_scatter_steps(*s, mid, tmp, out, n, code, tagged(inter_), ia);
    return launch(w, s, async_op, g);
  }

 private:
  Peer tagged(Peer c) const {
    c.tag = (int)(seq_ % kTagSpace);
    return c;
  }

  // Called with the post lock held: the op's sequence number and its place in the order.
  std::shared_ptr<Work> make_work(const char* op, Schedule& s) {
    if (!lane_->healthy()) lane_->throw_unhealthy(op);
    auto w = std::make_shared<Work>(op, "pccl", group_, ++seq_, timeout_s_, lane_);
    s.prev = last_;
    last_ = s.done;
    return w;
  }

  py::object launch(const std::shared_ptr<Work>& w, std::shared_ptr<Schedule> s, bool async_op,
                    std::unique_lock<std::mutex>& posted) {
    posted.unlock();
    w->test = [s] { return s->test(); };
    return launch_work(lane_, w, async_op);
  }

  Peer inter_, intra_;
  int size_ = 1;
  at::Tensor perm_;
  std::string group_;
  std::shared_ptr<Lane> lane_;
  double timeout_s_;
  uint64_t seq_ = 0;
  std::shared_ptr<std::atomic<bool>> last_;
  std::mutex post_mu_;
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
      .def("all_gather", &PcclComm::all_gather, arg("output"), arg("input"), arg("inter_algo"),
           arg("intra_algo"), arg("async_op"))
      .def("reduce_scatter", &PcclComm::reduce_scatter, arg("output"), arg("input"), arg("op"),
           arg("inter_algo"), arg("intra_algo"), arg("async_op"));
}

}  // namespace mcrdl
