"""The "mcrdl" torch.distributed backend (mcrdl/torch_backend): routing and Work in this
process, then real worlds under mpiexec and torchrun (the rank scripts are in
tests/torch_backend/)."""

from __future__ import annotations

import datetime
import inspect
import os
import re
import shutil
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import mcrdl
from mcrdl.torch_backend import factory, monitored, routing
from mcrdl.torch_backend import work as work_module
from mcrdl.torch_backend.convert import explicit_timeout, op_of
from mcrdl.torch_backend.process_group import _pinned_routes
from mcrdl.torch_backend.work import McrdlWork

from ._launch import FULL, mpiexec_or_skip, run_launcher, skip_without
from .test_mixing import _left_behind

HERE = os.path.join(os.path.dirname(__file__), "torch_backend")
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "torch_ddp.py")
_LAUNCHER_VARS = ("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA", "MCRDL_TORCH_ROUTES")

# torch before 2.13 calls a backend only on the members of a new group (no new_group hook
# on the default group), and mcrdl makes groups over every rank, so sub-groups of an mcrdl
# world are refused there (with that reason, tested in this process below). The worlds
# marked so make sub-groups: DeviceMesh's dimensions, and the collectives' own groups.
_TORCH = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
SUBGROUPS = pytest.mark.skipif(_TORCH < (2, 13), reason=(
    f"makes sub-groups of an mcrdl world: needs torch >= 2.13, this is {torch.__version__}"))
# dist.barrier(timeout=) is recent (torch 2.11, the GPU image's, has none): tested by feature.
BARRIER_TIMEOUT = pytest.mark.skipif(
    "timeout" not in inspect.signature(dist.barrier).parameters,
    reason=f"torch {torch.__version__}'s dist.barrier takes no timeout= (this test's subject)")


def launch(launcher: str, n: int, script: str, *args, env=None, timeout=300, expect_rc=0,
           mpiexec_args=()) -> str:
    """Run `script` on `n` ranks under mpiexec or torchrun (process group killed on timeout)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    full_env.setdefault("MCRDL_TIMEOUT", "90")
    full_env.update(env or {})
    if launcher == "mpiexec":
        cmd = [mpiexec_or_skip(), *mpiexec_args, "-n", str(n)]
    else:
        torchrun = os.path.join(sys.prefix, "bin", "torchrun")
        if not os.path.exists(torchrun):
            torchrun = shutil.which("torchrun")
        if not torchrun:
            skip_without("torchrun not found")
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(n)]
    cmd += [sys.executable, script, *map(str, args)] if launcher == "mpiexec" else \
        [script, *map(str, args)]
    return run_launcher(cmd, env=full_env, timeout=timeout, expect_rc=expect_rc)


# -- in this process ---------------------------------------------------------------------

def test_import_registers_the_backend_and_rendezvous():
    assert "mcrdl" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["mcrdl"] == ["cpu", "cuda"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # defaults untouched
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    assert "mcrdl" in handlers and "env" in handlers


def test_routes_parse_and_table():
    assert routing.parse("allreduce=mpi, alltoall=gloo", "t") == {"allreduce": "mpi",
                                                                  "alltoall": "gloo"}
    full = routing.table(routing.parse("*=gloo,broadcast=auto", "t"))
    assert set(full) == set(routing.KEYS) and full["broadcast"] == "auto"
    assert {v for k, v in full.items() if k != "broadcast"} == {"gloo"}
    base = routing.table({"allreduce": "mpi"})
    assert routing.table({"alltoall": "gloo"}, base)["allreduce"] == "mpi"


def test_send_and_recv_are_one_route():
    """A message sent on one backend is received only on it: naming one routes both."""
    for routes in ("send=gloo", "recv=gloo", "*=mpi,recv=gloo", "send=gloo,recv=gloo"):
        full = routing.table(routing.parse(routes, "t"), routing.table({"*": "mpi"}))
        assert (full["send"], full["recv"], full["allreduce"]) == ("gloo", "gloo", "mpi"), routes
    with pytest.raises(mcrdl.InvalidArgumentError,
                       match=r"t: send=gloo and recv=mpi: a message sent on one backend is "
                             r"received only on the same one"):
        routing.parse({"send": "gloo", "recv": "mpi"}, "t")


def test_set_torch_routes_never_empties_the_table_a_call_reads(monkeypatch):
    """Calls of other threads read the process-wide table without the lock (DDP's
    all-reduces come from autograd's threads): every key is there at every moment."""
    seen = []

    class Watched(dict):
        def clear(self):
            seen.append("clear")
            super().clear()

        def update(self, *a, **k):
            seen.append(set(self) == set(routing.KEYS))
            super().update(*a, **k)

    table = Watched(routing.process_routes())
    monkeypatch.setattr(routing, "_process_routes", table)
    try:
        mcrdl.set_torch_routes("allreduce=mpi")
        mcrdl.set_torch_routes(None)
    finally:
        monkeypatch.undo()
        mcrdl.set_torch_routes(None)
    assert seen == [True, True] and table["allreduce"] == "auto"


@pytest.mark.parametrize("routes, needle", [
    ("allreduce", "is not 'op=backend'"),
    ("all_reduce=mpi", "is not a c10d operation family"),
    ("allreduce=nope", "unknown mcrdl backend"),
    (["allreduce=mpi"], "must be a string"),
])
def test_bad_routes_say_what_is_wrong(routes, needle):
    with pytest.raises(mcrdl.InvalidArgumentError, match=needle):
        routing.parse(routes, "MCRDL_TORCH_ROUTES")
    with pytest.raises(mcrdl.InvalidArgumentError, match=needle):
        mcrdl.TorchBackendOptions(routes=routes)


def test_set_torch_routes_is_process_wide_and_resets(monkeypatch):
    monkeypatch.setenv(routing.ROUTES_ENV, "barrier=gloo")
    try:
        assert mcrdl.set_torch_routes("allreduce=mpi")["allreduce"] == "mpi"
        assert mcrdl.torch_routes()["barrier"] == "auto"
        assert mcrdl.set_torch_routes(None) == {**dict.fromkeys(routing.KEYS, "auto"),
                                                "barrier": "gloo"}
    finally:
        monkeypatch.delenv(routing.ROUTES_ENV)
        mcrdl.set_torch_routes(None)


def test_set_torch_routes_refuses_a_backend_mcrdl_did_not_initialize(monkeypatch):
    """Once mcrdl is initialized, groups may exist that would call the route: refused
    when set, with the table left as it was."""
    try:
        mcrdl.set_torch_routes("allreduce=mpi")
        monkeypatch.setattr(mcrdl.torch_backend, "_front", GroupFront())  # mpi initialized
        with pytest.raises(mcrdl.BackendUnavailableError,
                           match=r"set_torch_routes: routes allreduce=nccl.*initialized: mpi"):
            mcrdl.set_torch_routes("allreduce=nccl")
        assert mcrdl.torch_routes()["allreduce"] == "mpi"
    finally:
        monkeypatch.undo()
        mcrdl.set_torch_routes(None)


def test_missing_backend_named_with_what_is_initialized():
    with pytest.raises(mcrdl.BackendUnavailableError, match=r"alltoall=pccl.*initialized: mpi"):
        routing.check_initialized(routing.table({"alltoall": "pccl"}), ["mpi"], "here")


INITIALIZED = ["mpi", "gloo", "MyNet"]


@pytest.mark.parametrize("backend,pinned", [
    (None, None), ("mcrdl", None), ("MCRDL", None), ("cpu:mcrdl,cuda:mcrdl", None),
    ("gloo", "gloo"), ("MPI", "mpi"), ("cpu:gloo", "gloo"), ("cpu:gloo,cuda:gloo", "gloo"),
    ("mynet", "MyNet"),  # torch lowercases the name; a plug-in keeps its spelling
])
def test_new_group_backend_pins_the_group(backend, pinned):
    """The backend later torch passes to the new_group hook: one of mcrdl's initialized
    backends carries every op of the group; "mcrdl" (or none) leaves the routes alone."""
    got = _pinned_routes(backend, "new_group([1])", INITIALIZED)
    assert got == (None if pinned is None else dict.fromkeys(routing.KEYS, pinned))


@pytest.mark.parametrize("backend,why", [
    ("cpu:gloo,cuda:nccl", "can pin its ops to one of mcrdl's initialized backends"),
    ("ucc", "can pin its ops to one of mcrdl's initialized backends"),
    ("nccl", r"mcrdl's backend 'nccl' is not initialized in this process \(mcrdl.init"),
])
def test_new_group_backend_mcrdl_cannot_pin_is_refused(backend, why):
    with pytest.raises(mcrdl.InvalidArgumentError,
                       match=r"new_group\(\[1\]\): backend=.* default group: .*" + why +
                             r".*; pass one of mpi, gloo, MyNet, or backend=None"):
        _pinned_routes(backend, "new_group([1])", INITIALIZED)


class FakeFront:
    """The front as create() sees it: initialized, rank 0 of 4."""

    def is_initialized(self):
        return True

    def get_rank(self):
        return 0

    def get_size(self):
        return 4


@pytest.mark.parametrize("default_is_mcrdl,says", [
    (True, r"torch \S+ calls a backend only on the members of a new group, also when "
           r"'mcrdl' is the default group.*need torch >= 2.13"),
    (False, r"when the default group is another backend's. Make 'mcrdl' the default"),
])
def test_sub_group_through_the_creator_is_refused(monkeypatch, default_is_mcrdl, says):
    """torch calls the creator only on the members of a sub-group: under another default
    backend, and under the mcrdl default before torch 2.13 (no new_group hook)."""
    monkeypatch.setattr(factory, "_default_group_is_mcrdl", lambda: default_is_mcrdl)
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.global_ranks_in_group, opts.group_rank, opts.group_size = [0, 1], 0, 2
    with pytest.raises(mcrdl.InvalidArgumentError, match=r"new_group\(ranks=\[0, 1\].*" + says):
        factory.create(FakeFront(), opts, None)


class GroupFront(FakeFront):
    """FakeFront with mpi initialized, recording the groups it is asked to make."""

    def __init__(self):
        self.made = []

    def get_backends(self):
        return ["mpi"]

    def new_group(self, ranks):
        self.made.append(ranks)
        raise AssertionError("create() made the group before checking its routes")


@pytest.mark.parametrize("pg_options,error,says", [
    ("routes", mcrdl.InvalidArgumentError, r"pg_options of the mcrdl backend is a "
                                           r"mcrdl.TorchBackendOptions, got str"),
    (mcrdl.TorchBackendOptions(routes="alltoall=pccl"), mcrdl.BackendUnavailableError,
     r"alltoall=pccl.*initialized: mpi"),
])
def test_creator_checks_routes_before_making_the_group(pg_options, error, says):
    """new_group(every rank, backend="mcrdl") under another default backend: the group's
    routes are refused on every rank before the collective creation of the group."""
    front = GroupFront()
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.global_ranks_in_group, opts.group_rank, opts.group_size = [0, 1, 2, 3], 0, 4
    with pytest.raises(error, match=r"new_group\(\[0, 1, 2, 3\]\).*" + says):
        factory.create(front, opts, pg_options)
    assert front.made == []


class InitFront(GroupFront):
    """GroupFront not yet initialized, recording init and finalize."""

    def __init__(self):
        super().__init__()
        self.calls, self.up = [], False

    def is_initialized(self):
        return self.up

    def init(self, backends=None, timeout=None):
        self.calls.append("init")
        self.up = True

    def available_backends(self):
        return ["mpi"]

    def finalize(self):
        self.calls.append("finalize")
        self.up = False


def test_refused_world_routes_leave_mcrdl_uninitialized():
    """init_process_group("mcrdl") with routes to a backend init() would not initialize:
    refused before init, so that a retry (or destroy_process_group) starts clean, with
    no collective cleanup to wait in."""
    front = InitFront()
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.global_ranks_in_group, opts.group_rank, opts.group_size = [], 0, 4
    with pytest.raises(mcrdl.BackendUnavailableError,
                       match=r"init_process_group\('mcrdl'\).*alltoall=pccl.*initialized: mpi"):
        factory.create(front, opts, mcrdl.TorchBackendOptions(routes="alltoall=pccl"))
    assert front.calls == [] and not front.up


def test_explicit_timeout():
    assert explicit_timeout(dist.constants.default_pg_timeout) is None
    assert explicit_timeout(datetime.timedelta(seconds=7)) == 7.0


def test_reduce_op_read_once_by_hash_matches_the_slow_way():
    opts = dist.AllreduceOptions()
    for op in mcrdl.ReduceOp:
        if hasattr(dist.ReduceOp, op.name):
            opts.reduceOp = getattr(dist.ReduceOp, op.name)
            assert op_of(opts, "t") is op
            opts.reduceOp = dist.ReduceOp(getattr(dist.ReduceOp.RedOpType, op.name))
            assert op_of(opts, "t") is op
    opts.reduceOp = dist._make_nccl_premul_sum(2.0)
    with pytest.raises(mcrdl.InvalidArgumentError, match="PREMUL_SUM has no mcrdl equivalent"):
        op_of(opts, "t")


class FakeWork:
    """An mcrdl Work that completes when `done` is set (or fails with `error`)."""

    def __init__(self, error: Exception | None = None):
        self.done = threading.Event()
        self.error = error
        self.waits = 0
        self.timeouts = []  # the timeout of each wait

    def wait(self, timeout=None):
        self.waits += 1
        self.timeouts.append(timeout)
        if not self.done.wait(timeout):
            raise mcrdl.CommTimeoutError("fake: still pending")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.done.is_set()


def _monitored_ranks(size: int, arriving, seconds: float, wait_all: bool = False):
    """monitored.monitored_barrier on a HashStore by a thread per rank in `arriving`:
    each rank's error message, or "passed"."""
    store, results = dist.HashStore(), {}

    def rank(r):
        try:
            monitored.monitored_barrier(store, "mb/0/1", r, size, seconds, wait_all)
            results[r] = "passed"
        except RuntimeError as exc:
            results[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in arriving]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, store


def test_monitored_barrier_names_the_ranks_that_did_not_arrive():
    """Gloo's semantics and messages, over the group's store; no key is left behind."""
    results, store = _monitored_ranks(3, [0, 1, 2], 30)
    assert results == {0: "passed", 1: "passed", 2: "passed"}
    assert store.num_keys() == 0
    results, _ = _monitored_ranks(3, [0, 1], 0.5)
    assert "Rank 2 failed to pass monitoredBarrier in 500 ms" in results[0], results
    assert results[1].startswith("Rank 1 successfully reached monitoredBarrier, but "
                                 "received errors while waiting for send/recv from rank 0")
    results, _ = _monitored_ranks(4, [0, 2], 0.3, wait_all=True)
    assert "Ranks 1, 3 failed to pass monitoredBarrier in 300 ms" in results[0], results
    results, _ = _monitored_ranks(2, [0], 0)
    assert results[0].startswith("Rank 0 timed out in monitoredBarrier after 0 ms"), results


def test_work_finishes_once_and_completes_its_future():
    inner, out, finished = FakeWork(), [torch.zeros(2)], []
    work = McrdlWork.of((inner,), out, None, lambda: finished.append(1), "allreduce")
    assert isinstance(work, dist.Work) and not work.is_completed()
    future = work.get_future()
    assert not future.done()
    with pytest.raises(mcrdl.CommTimeoutError, match="still pending"):
        work.wait(datetime.timedelta(milliseconds=50))
    inner.done.set()
    assert future.wait() == out and future.value()[0] is out[0]
    assert work.wait() and work.is_completed() and finished == [1]
    assert work.get_future() is future


class SlowWork(FakeWork):
    """Completes 0.6 s into its first wait (in the waiting thread: no timer thread)."""

    def wait(self, timeout=None):
        if not self.done.is_set():
            time.sleep(0.6)
            self.done.set()
        return super().wait(timeout)


def test_work_wait_timeout_bounds_all_its_works_together():
    # a call of two ops (e.g. a coalesced pair) waits `timeout` in all, not per op: the
    # second work gets what the first left of it, at most 1.0 - 0.6 s (1.0 s each with
    # a timeout per work), whatever the machine's load
    first, second = SlowWork(), FakeWork()
    work = McrdlWork.of((first, second), [], None, None, "allreduce_coalesced")
    t0 = time.monotonic()
    with pytest.raises(mcrdl.CommTimeoutError, match="still pending"):
        work.wait(datetime.timedelta(seconds=1.0))
    took = time.monotonic() - t0
    assert first.waits == 1 and second.waits == 1
    assert first.timeouts[0] <= 1.0 and second.timeouts[0] <= 0.4 + 1e-9, (
        f"timeouts passed on: {first.timeouts[0]} s, then {second.timeouts[0]} s")
    # it waited the timeout out (not less); the ceiling only catches a hang
    assert 0.95 <= took < 10.0, f"wait(1.0 s) over two works took {took:.2f} s"
    second.done.set()
    assert work.wait() and work.is_completed()


def test_work_timed_out_on_its_own_is_completed_and_keeps_the_error():
    # a work that failed by its own timeout reports completion (c10d expects a bool);
    # wait() then raises the error, every time
    inner = FakeWork(mcrdl.CommTimeoutError("fake: timed out"))
    inner.done.set()
    work = McrdlWork.of((inner,), [], None, None, "broadcast")
    assert work.is_completed() is True
    for _ in range(2):
        with pytest.raises(mcrdl.CommTimeoutError, match="fake: timed out"):
            work.wait()
    assert inner.waits == 1 and not work.is_success()


def test_work_error_reaches_the_future():
    inner = FakeWork(mcrdl.CommTimeoutError("fake: timed out"))
    work = McrdlWork.of((inner,), [], 5.0, None, "broadcast")
    future = work.get_future()
    inner.done.set()
    with pytest.raises(mcrdl.CommTimeoutError, match="timed out"):
        future.wait()
    with pytest.raises(mcrdl.CommTimeoutError):
        work.wait()
    assert work.exception() is not None and not work.is_success()


def test_work_result_waits_for_completion_and_a_failed_future_fails_the_work():
    inner, out = FakeWork(), [torch.zeros(2)]
    work = McrdlWork.of((inner,), out, None, None, "allreduce")
    with pytest.raises(RuntimeError, match=r"allreduce on mcrdl: Work needs to be completed "
                                           r"before calling result\(\)"):
        work.result()  # the outputs may be half written: refused, as torch's works do
    inner.done.set()
    assert work.wait() and work.result() is out
    # a future failed by its timeout: the work is completed and failed, everywhere
    inner = FakeWork()
    work = McrdlWork.of((inner,), out, 0.2, None, "broadcast")
    with pytest.raises(mcrdl.CommTimeoutError, match="still pending"):
        work.get_future().wait()
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), mcrdl.CommTimeoutError)
    inner.done.set()  # the op completing later does not undo the future's failure
    for call in (work.wait, work.result):
        with pytest.raises(mcrdl.CommTimeoutError, match="still pending"):
            call()


class CallbackWork(FakeWork):
    """FakeWork with the completion callbacks and time_out of an mcrdl._C.Work."""

    def __init__(self):
        super().__init__()
        self.callbacks = []

    def add_done_callback(self, fn):
        self.callbacks.append(fn)

    def time_out(self, timeout):
        raise mcrdl.CommTimeoutError(f"fake: past {timeout} s")


def test_watchdog_failed_future_fails_the_work_for_good(monkeypatch):
    """The callback path (every single-op call): the watchdog fails the pending future;
    the op's completion callback coming later leaves the work failed, as its future."""
    monkeypatch.setattr(work_module, "_CWork", CallbackWork)
    inner, out = CallbackWork(), [torch.zeros(2)]
    work = McrdlWork.of((inner,), out, 0.2, None, "broadcast")
    future = work.get_future()
    assert inner.callbacks and not work.is_completed()
    with pytest.raises(mcrdl.CommTimeoutError, match=r"fake: past 0.2 s"):
        future.wait()
    assert work.is_completed() and not work.is_success()
    inner.done.set()
    for callback in inner.callbacks:  # the op completes after all
        callback(None)
    for call in (work.wait, work.result):
        with pytest.raises(mcrdl.CommTimeoutError, match=r"fake: past 0.2 s"):
            call()
    assert isinstance(work.exception(), mcrdl.CommTimeoutError)


# -- real worlds -------------------------------------------------------------------------

def test_work_completion_callbacks_settle_futures():
    out = launch("mpiexec", 2, os.path.join(HERE, "callbacks.py"), timeout=180)
    for r in range(2):
        assert f"rank {r}: torch backend callbacks OK" in out, out


#: collectives.py's blocks that run on some ranks or launches only
CONDITIONAL_BLOCKS = {"bad input", "non-member call", "mixing", "unsupported op"}


def collective_blocks(launcher: str, n: int, rank: int) -> tuple[set[str], set[str]]:
    """(backends mcrdl starts, CONDITIONAL_BLOCKS collectives.py runs) on `rank`:
    torchrun starts Gloo alone; mpiexec every backend of this machine (mpi, gloo and
    pccl at least), and there the mixing stress runs (mpi and gloo, 2 ranks or more)
    and the last rank's call routed to pccl's missing all_to_all raises
    UnsupportedOperationError. The last rank passes the bad input, rank 0 is the
    sub-group's non-member from 2 ranks on."""
    blocks = {"bad input"} if rank == n - 1 else set()
    blocks |= {"non-member call"} if rank == 0 and n > 1 else set()
    if launcher == "torchrun":
        return {"gloo"}, blocks
    blocks |= {"mixing"} if n > 1 else set()
    blocks |= {"unsupported op"} if rank == n - 1 else set()
    return {"mpi", "gloo", "pccl"}, blocks


# CI: torchrun at an odd world size (env:// rendezvous, Gloo alone) and mpiexec at 2
# (mcrdl's rendezvous, every backend: the pccl and mixing blocks); the wide sweep adds
# mpiexec at 1, 3 and 5 and torchrun at 4
@pytest.mark.parametrize("launcher, n", [pytest.param("mpiexec", 1, marks=FULL),
                                         ("mpiexec", 2),
                                         pytest.param("mpiexec", 3, marks=FULL),
                                         ("torchrun", 3),
                                         pytest.param("torchrun", 4, marks=FULL),
                                         pytest.param("mpiexec", 5, marks=FULL)])
@SUBGROUPS
def test_every_collective_matches_numpy(launcher, n):
    out = launch(launcher, n, os.path.join(HERE, "collectives.py"))
    for r in range(n):
        m = re.search(rf"rank {r}: torch backend collectives OK \({n} ranks, backends (\S+), "
                      r"\d+ checks, blocks ([^)]*)\)", out)
        assert m, out
        backends, blocks = set(m.group(1).split(",")), set(m.group(2).split(","))
        want_backends, want_blocks = collective_blocks(launcher, n, r)
        assert want_backends <= backends and (launcher == "mpiexec" or backends == {"gloo"}), (
            f"rank {r} started {sorted(backends)}, expected {sorted(want_backends)}")
        assert blocks & CONDITIONAL_BLOCKS == want_blocks, (
            f"rank {r} ran {sorted(blocks & CONDITIONAL_BLOCKS)}, expected {sorted(want_blocks)}")
    print(re.search(r"rank 0: .*", out).group(0))


# torchrun's env:// start is also the collectives' (torchrun 3) and the entry points'
@pytest.mark.parametrize("launcher, n", [("mpiexec", 4), pytest.param("torchrun", 2,
                                                                       marks=FULL)])
@SUBGROUPS
def test_ddp_fsdp2_dtensor_dcp_match_gloo(launcher, n):
    out = launch(launcher, n, os.path.join(HERE, "training.py"), timeout=400)
    for r in range(n):
        assert f"rank {r}: torch backend training OK" in out, out
    print(re.search(r"rank 0: .*", out).group(0))


def test_debug_mode_and_timeout_reach_torch_programs():
    limit = 5
    out = launch("mpiexec", 3, os.path.join(HERE, "failures.py"), "debug-and-timeout", limit,
                 env={"MCRDL_DEBUG": "1"}, timeout=180)
    for r in range(3):
        assert f"rank {r}: DesyncError raised" in out, out
        assert f"rank {r}: finalized" in out, out
    for r in (1, 2):
        m = re.search(rf"rank {r}: CommTimeoutError after ([\d.]+) s", out)
        assert m and limit <= float(m.group(1)) < limit + 5, out
        assert f"rank {r}: next op refused: BackendUnavailableError" in out, out


@BARRIER_TIMEOUT
def test_timeouts_of_a_call_and_of_a_group():
    """barrier(timeout=) is honoured both ways; a timed-out op of a group with its own
    timeout breaks that group (its next call is refused), not the world
    (tests/torch_backend/failures.py group-timeouts)."""
    limit = 2
    out = launch("mpiexec", 2, os.path.join(HERE, "failures.py"), "group-timeouts", limit,
                 timeout=180)
    for r in range(2):
        assert f"rank {r}: group timeouts OK" in out, out
    m = re.search(r"rank 0: barrier\(timeout=60 s\) waited ([\d.]+) s", out)
    assert m and float(m.group(1)) > limit, out  # past the group's timeout
    for what, error in (("sub-group all_reduce", "CommTimeoutError"),
                        ("sub-group retry", "BackendUnavailableError"),
                        (r"barrier\(timeout=1 s\)", "CommTimeoutError"),
                        ("world after it", "BackendUnavailableError")):
        assert re.search(rf"rank 0: {what}: {error} after", out), (what, out)
    assert "an earlier allreduce of this group timed out" in out, out
    assert "an earlier barrier of this group timed out" in out, out


def test_dead_rank_ends_the_job():
    """Rank 1 is SIGKILLed with mpiexec's own cleanup off: the survivors raise or are
    ended by the MPI runtime; the job exits non-zero and leaves nothing behind."""
    limit = 5
    start = time.monotonic()
    out = launch("mpiexec", 3, os.path.join(HERE, "failures.py"), "dead-rank", limit,
                 timeout=limit + 90, expect_rc="nonzero",
                 mpiexec_args=("-disable-auto-cleanup",))
    assert "loop finished" not in out, out
    assert time.monotonic() - start < limit + 60
    pids = [int(p) for p in re.findall(r"rank \d: pid (\d+)", out)]
    assert len(pids) == 3 and not _left_behind(pids), out


def test_example_torch_ddp():
    out = launch("mpiexec", 2, EXAMPLE, env={"MCRDL_TORCH_ROUTES": "allreduce=gloo"})
    assert "routes: allreduce->gloo" in out and re.search(r"all_reduce\s+gloo", out), out
    assert "loss" in out, out
