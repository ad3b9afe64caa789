// The "mpi" backend's hot path: every operation of API.md posted as one nonblocking
// MPI call on a communicator owned by this backend, then driven to completion by the
// caller (blocking ops, with a deadline) or by the backend's lane thread (async ops).
//
// Types MPI lacks (float16, bfloat16) move as 16-bit words and reduce in float32.
// bool reduces as uint8 0/1 with bitwise ops (SUM/MAX = or, PRODUCT/MIN = and).
#include <mpi.h>

#include <c10/core/GradMode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <climits>

#include "launch_work.h"
#include "mpi_util.h"
#include "pyargs.h"

namespace mcrdl {

namespace {

struct ReducePlan {
  MPI_Op op;
  MPI_Datatype type;
  bool upcast;  // reduce a float32 copy (float16/bfloat16)
  bool average;
};

ReducePlan reduce_plan(at::ScalarType t, int code) {
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
    case MIN: op = MPI_MIN; break;
    case MAX: op = MPI_MAX; break;
    case BAND: op = MPI_BAND; break;
    case BOR: op = MPI_BOR; break;
    case BXOR: op = MPI_BXOR; break;
  }
  return {op, type, half, code == AVG};
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto a0 = static_cast<const char*>(a.data_ptr()), b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
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

// Everything a posted op needs until it completes: requests, count arrays, buffers.
struct InFlight {
  std::vector<MPI_Request> reqs;
  std::vector<mcount> c1, c2;
  std::vector<mdisp> d1, d2;
  std::vector<at::Tensor> keep;
  MPI_Request* req() {
    reqs.push_back(MPI_REQUEST_NULL);
    return &reqs.back();
  }
};

}  // namespace

class MpiComm {
 public:
  MpiComm(uint64_t handle, int rank, int size, std::string group, std::shared_ptr<Lane> lane,
          double timeout_s, std::string backend)
      : rank_(rank), size_(size), group_(std::move(group)), backend_(std::move(backend)),
        lane_(std::move(lane)), timeout_s_(timeout_s) {
    comm_ = comm_from_handle<MPI_Comm>(handle);
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t seq() const { return seq_; }
  void set_timeout(double t) { timeout_s_ = t; }

  py::object all_reduce(py::handle tensor, int rop, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor t = to_tensor(tensor, "all_reduce", "tensor");
    validate_all_reduce(t, rop);
    check_device("all_reduce", t);
    ReducePlan p = reduce_plan(t.scalar_type(), rop);
    auto s = std::make_shared<InFlight>();
    at::Tensor buf = p.upcast ? t.to(at::kFloat) : t;
    s->keep = {t, buf};
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("all_reduce");
    check_mpi(MPIC(MPI_Iallreduce)(MPI_IN_PLACE, buf.data_ptr(), to_mcount(buf.numel(), "all_reduce"),
                                   p.type, p.op, comm_, s->req()),
              "MPI_Iallreduce");
    if (p.average || p.upcast)
      w->finish = [t, buf, p, n = size_] {
        c10::NoGradGuard ng;
        if (p.average) buf.div_(n);
        if (p.upcast) t.copy_(buf);
      };
    return launch(w, s, async_op, g);
  }

  py::object reduce(py::handle tensor, py::handle dst_, int rop, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor t = to_tensor(tensor, "reduce", "tensor");
    int64_t dst = to_int(dst_, "reduce", "dst");
    validate_reduce(t, dst, rop, size_);
    check_device("reduce", t);
    ReducePlan p = reduce_plan(t.scalar_type(), rop);
    auto s = std::make_shared<InFlight>();
    at::Tensor buf = p.upcast ? t.to(at::kFloat) : t;
    s->keep = {t, buf};
    bool root = dst == rank_;
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("reduce");
    check_mpi(MPIC(MPI_Ireduce)(root ? MPI_IN_PLACE : buf.data_ptr(), root ? buf.data_ptr() : nullptr,
                                to_mcount(buf.numel(), "reduce"), p.type, p.op, (int)dst, comm_,
                                s->req()),
              "MPI_Ireduce");
    if (root && (p.average || p.upcast))
      w->finish = [t, buf, p, n = size_] {
        c10::NoGradGuard ng;
        if (p.average) buf.div_(n);
        if (p.upcast) t.copy_(buf);
      };
    return launch(w, s, async_op, g);
  }

  py::object bcast(py::handle tensor, py::handle src_, bool async_op) {
    at::Tensor t = to_tensor(tensor, "bcast", "tensor");
    int64_t src = to_int(src_, "bcast", "src");
    validate_bcast(t, src, size_);
    check_device("bcast", t);
    auto s = std::make_shared<InFlight>();
    s->keep = {t};
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("bcast");
    check_mpi(MPIC(MPI_Ibcast)(t.data_ptr(), to_mcount(t.numel(), "bcast"), move_type(t.scalar_type()),
                               (int)src, comm_, s->req()),
              "MPI_Ibcast");
    return launch(w, s, async_op, g);
  }

  py::object all_gather(py::handle output, py::handle input, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor in = to_tensor(input, "all_gather", "input");
    BlockArg out = to_blocks(output, "all_gather", "output", false);
    validate_all_gather(out, in, size_);
    check_device("all_gather", in);
    auto s = std::make_shared<InFlight>();
    at::Tensor recv = out.is_list ? at::empty({in.numel() * size_}, in.options()) : out.tensor;
    if (overlaps(in, recv)) in = in.clone();
    s->keep = {in, recv};
    MPI_Datatype dt = move_type(in.scalar_type());
    mcount n = to_mcount(in.numel(), "all_gather");
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("all_gather");
    check_mpi(MPIC(MPI_Iallgather)(in.data_ptr(), n, dt, recv.data_ptr(), n, dt, comm_, s->req()),
              "MPI_Iallgather");
    if (out.is_list) w->finish = [recv, list = out.list] { c10::NoGradGuard ng; scatter_into(recv, list); };
    return launch(w, s, async_op, g);
  }

  py::object gather(py::handle output, py::handle input, py::handle dst_, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor in = to_tensor(input, "gather", "input");
    int64_t dst = to_int(dst_, "gather", "dst");
    BlockArg out = to_blocks(output, "gather", "output", true);
    validate_gather(out, in, dst, rank_, size_);
    check_device("gather", in);
    bool root = dst == rank_;
    auto s = std::make_shared<InFlight>();
    at::Tensor recv;
    if (root) {
      recv = out.is_list ? at::empty({in.numel() * size_}, in.options()) : out.tensor;
      if (overlaps(in, recv)) in = in.clone();
    }
    s->keep = {in, recv};
    MPI_Datatype dt = move_type(in.scalar_type());
    mcount n = to_mcount(in.numel(), "gather");
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("gather");
    check_mpi(MPIC(MPI_Igather)(in.data_ptr(), n, dt, root ? recv.data_ptr() : nullptr, n, dt, (int)dst,
                                comm_, s->req()),
              "MPI_Igather");
    if (root && out.is_list)
      w->finish = [recv, list = out.list] { c10::NoGradGuard ng; scatter_into(recv, list); };
    return launch(w, s, async_op, g);
  }

  py::object scatter(py::handle output, py::handle input, py::handle src_, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor out = to_tensor(output, "scatter", "output");
    int64_t src = to_int(src_, "scatter", "src");
    BlockArg in = to_blocks(input, "scatter", "input", true);
    validate_scatter(out, in, src, rank_, size_);
    check_device("scatter", out);
    bool root = src == rank_;
    auto s = std::make_shared<InFlight>();
    at::Tensor send;
    if (root) {
      send = in.is_list ? flat_cat(in.list) : in.tensor;
      if (overlaps(send, out)) send = send.clone();
    }
    s->keep = {out, send};
    MPI_Datatype dt = move_type(out.scalar_type());
    mcount n = to_mcount(out.numel(), "scatter");
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("scatter");
    check_mpi(MPIC(MPI_Iscatter)(root ? send.data_ptr() : nullptr, n, dt, out.data_ptr(), n, dt, (int)src,
                                 comm_, s->req()),
              "MPI_Iscatter");
    return launch(w, s, async_op, g);
  }

  py::object reduce_scatter(py::handle output, py::handle input, int rop, bool async_op) {
    c10::NoGradGuard ng;
    at::Tensor out = to_tensor(output, "reduce_scatter", "output");
    BlockArg in = to_blocks(input, "reduce_scatter", "input", false);
    validate_reduce_scatter(out, in, rop, size_);
    check_device("reduce_scatter", out);
    ReducePlan p = reduce_plan(out.scalar_type(), rop);
    at::Tensor send = in.is_list ? flat_cat(in.list) : in.tensor;
    if (p.upcast) send = send.to(at::kFloat);
    else if (overlaps(send, out)) send = send.clone();
    at::Tensor recv = p.upcast ? at::empty({out.numel()}, out.options().dtype(at::kFloat)) : out;
    auto s = std::make_shared<InFlight>();
    s->keep = {send, recv, out};
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("reduce_scatter");
    check_mpi(MPIC(MPI_Ireduce_scatter_block)(send.data_ptr(), recv.data_ptr(),
                                              to_mcount(out.numel(), "reduce_scatter"), p.type, p.op,
                                              comm_, s->req()),
              "MPI_Ireduce_scatter_block");
    if (p.average || p.upcast)
      w->finish = [out, recv, p, n = size_] {
        c10::NoGradGuard ng;
        if (p.average) recv.div_(n);
        if (p.upcast) out.view({-1}).copy_(recv);
      };
    return launch(w, s, async_op, g);
  }

  py::object all_to_all_single(py::handle output, py::handle input, py::handle out_splits_,
                               py::handle in_splits_, bool async_op) {
    const char* op = "all_to_all_single";
    at::Tensor out = to_tensor(output, op, "output");
    at::Tensor in = to_tensor(input, op, "input");
    auto out_splits = to_counts(out_splits_, op, "output_split_sizes", true);
    auto in_splits = to_counts(in_splits_, op, "input_split_sizes", true);
    auto [is, os] = validate_all_to_all_single(out, in, out_splits, in_splits, size_);
    check_device(op, in);
    if (overlaps(in, out)) in = in.clone();
    auto row = [](const at::Tensor& t) {
      int64_t r = 1;
      for (int64_t d = 1; d < t.dim(); ++d) r *= t.size(d);
      return r;
    };
    auto s = std::make_shared<InFlight>();
    s->keep = {in, out};
    MPI_Datatype dt = move_type(in.scalar_type());
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op);
    if (!in_splits && !out_splits && in.numel() == out.numel()) {
      mcount n = to_mcount(in.numel() / size_, op);
      check_mpi(MPIC(MPI_Ialltoall)(in.data_ptr(), n, dt, out.data_ptr(), n, dt, comm_, s->req()),
                "MPI_Ialltoall");
    } else {
      s->c1 = to_mcounts(is, op, row(in));
      s->c2 = to_mcounts(os, op, row(out));
      s->d1 = packed_disps(s->c1);
      s->d2 = packed_disps(s->c2);
      check_mpi(MPIC(MPI_Ialltoallv)(in.data_ptr(), s->c1.data(), s->d1.data(), dt, out.data_ptr(),
                                     s->c2.data(), s->d2.data(), dt, comm_, s->req()),
                "MPI_Ialltoallv");
    }
    return launch(w, s, async_op, g);
  }

  py::object all_to_all(py::handle output_list, py::handle input_list, bool async_op) {
    c10::NoGradGuard ng;
    const char* op = "all_to_all";
    auto outs = to_tensor_list(output_list, op, "output_list");
    auto ins = to_tensor_list(input_list, op, "input_list");
    validate_all_to_all(outs, ins, size_);
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
    MPI_Datatype dt = move_type(send.scalar_type());
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op);
    check_mpi(MPIC(MPI_Ialltoallv)(send.data_ptr(), s->c1.data(), s->d1.data(), dt, recv.data_ptr(),
                                   s->c2.data(), s->d2.data(), dt, comm_, s->req()),
              "MPI_Ialltoallv");
    w->finish = [recv, outs] { c10::NoGradGuard ng; scatter_into(recv, outs); };
    return launch(w, s, async_op, g);
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
    bool root = dst == rank_;
    if (root && overlaps(in, *out)) in = in.clone();
    auto s = std::make_shared<InFlight>();
    s->keep = {in, out_storage};
    s->c1 = to_mcounts(counts, op);
    s->d1 = to_disps(d);
    MPI_Datatype dt = move_type(in.scalar_type());
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op);
    check_mpi(MPIC(MPI_Igatherv)(in.data_ptr(), to_mcount(in.numel(), op), dt,
                                 root ? out->data_ptr() : nullptr, s->c1.data(), s->d1.data(), dt,
                                 (int)dst, comm_, s->req()),
              "MPI_Igatherv");
    return launch(w, s, async_op, g);
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
    bool root = src == rank_;
    if (root && overlaps(*in, out)) in_storage = in->clone(), in = &in_storage;
    auto s = std::make_shared<InFlight>();
    s->keep = {out, in_storage};
    s->c1 = to_mcounts(counts, op);
    s->d1 = to_disps(d);
    MPI_Datatype dt = move_type(out.scalar_type());
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op);
    check_mpi(MPIC(MPI_Iscatterv)(root ? in->data_ptr() : nullptr, s->c1.data(), s->d1.data(), dt,
                                  out.data_ptr(), to_mcount(out.numel(), op), dt, (int)src, comm_,
                                  s->req()),
              "MPI_Iscatterv");
    return launch(w, s, async_op, g);
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
    MPI_Datatype dt = move_type(in.scalar_type());
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op);
    check_mpi(MPIC(MPI_Iallgatherv)(in.data_ptr(), to_mcount(in.numel(), op), dt, out.data_ptr(),
                                    s->c1.data(), s->d1.data(), dt, comm_, s->req()),
              "MPI_Iallgatherv");
    return launch(w, s, async_op, g);
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
    auto [sd, rd] = validate_all_to_allv(out, in, sc, rc, sd_, rd_, size_);
    check_device(op, in);
    if (overlaps(in, out)) in = in.clone();
    auto s = std::make_shared<InFlight>();
    s->keep = {in, out};
    s->c1 = to_mcounts(sc, op);
    s->c2 = to_mcounts(rc, op);
    s->d1 = to_disps(sd);
    s->d2 = to_disps(rd);
    MPI_Datatype dt = move_type(in.scalar_type());
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op);
    check_mpi(MPIC(MPI_Ialltoallv)(in.data_ptr(), s->c1.data(), s->d1.data(), dt, out.data_ptr(),
                                   s->c2.data(), s->d2.data(), dt, comm_, s->req()),
              "MPI_Ialltoallv");
    return launch(w, s, async_op, g);
  }

  py::object send(py::handle tensor, py::handle dst, py::handle tag, bool async_op) {
    return p2p(true, tensor, dst, tag, async_op);
  }

  py::object recv(py::handle tensor, py::handle src, py::handle tag, bool async_op) {
    return p2p(false, tensor, src, tag, async_op);
  }

  py::object barrier(bool async_op) {
    auto s = std::make_shared<InFlight>();
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work("barrier");
    check_mpi(MPI_Ibarrier(comm_, s->req()), "MPI_Ibarrier");
    return launch(w, s, async_op, g);
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
    mcount n = to_mcount(t.numel(), op);
    MPI_Datatype dt = move_type(t.scalar_type());
    std::unique_lock<std::mutex> g(post_mu_);
    auto w = make_work(op);
    if (sending)
      check_mpi(MPIC(MPI_Isend)(t.data_ptr(), n, dt, (int)peer, (int)tag, comm_, s->req()),
                "MPI_Isend");
    else
      check_mpi(MPIC(MPI_Irecv)(t.data_ptr(), n, dt, (int)peer, (int)tag, comm_, s->req()),
                "MPI_Irecv");
    return launch(w, s, async_op, g);
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

  std::shared_ptr<Work> make_work(const char* op) {
    if (!lane_->healthy()) lane_->throw_unhealthy(op);
    return std::make_shared<Work>(op, backend_, group_, ++seq_, timeout_s_, lane_);
  }

  // Called with the post lock held (ops are posted in issue order); releases it before
  // waiting, so another thread can post while this one waits.
  py::object launch(const std::shared_ptr<Work>& w, std::shared_ptr<InFlight> s, bool async_op,
                    std::unique_lock<std::mutex>& posted) {
    posted.unlock();
    w->test = [s, op = w->op()] {
      int flag = 0;
      check_mpi(MPI_Testall((int)s->reqs.size(), s->reqs.data(), &flag, MPI_STATUSES_IGNORE),
                op.c_str());
      return flag != 0;
    };
    return launch_work(lane_, w, async_op);
  }

  MPI_Comm comm_;
  int rank_, size_;
  std::string group_, backend_;
  std::shared_ptr<Lane> lane_;
  double timeout_s_;
  uint64_t seq_ = 0;
  std::mutex post_mu_;
};

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  return std::string(buf, len);
}

void bind_mpi(py::module_& m) {
  using py::arg;
  m.def("mpi_library_version", &mpi_library_version,
        "Version string of the MPI library this extension was linked against.");
  py::class_<MpiComm>(m, "MpiComm")
      .def(py::init<uint64_t, int, int, std::string, std::shared_ptr<Lane>, double, std::string>(),
           arg("handle"), arg("rank"), arg("size"), arg("group"), arg("lane"), arg("timeout"),
           arg("backend") = "mpi")
      .def_property_readonly("rank", &MpiComm::rank)
      .def_property_readonly("size", &MpiComm::size)
      .def_property_readonly("seq", &MpiComm::seq)
      .def("set_timeout", &MpiComm::set_timeout)
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
