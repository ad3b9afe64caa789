"""Completion callbacks of ``mcrdl._C.Work`` and the futures of the "mcrdl" process group
they settle; run by both ranks of ``mpiexec -n 2``.

Rank 0 posts receives that rank 1 sends only when told (over mcrdl's "mpi" barrier), so
every op is pending for as long as the check needs. Checked:

- callbacks run once the op completes, on the lane thread when nobody waits, in
  registration order, with error None; one that raises goes to sys.unraisablehook and
  the ones after it still run; one registered after completion runs at once on the
  registering thread; the lane keeps working.
- ``Work.time_out(t)`` raises the CommTimeoutError ``wait(t)`` raises, leaves the op
  pending, runs no callback and, under a timeout of its own, leaves the backend usable.
- a failed op (its lane shut down: abandoned) passes the error ``wait()`` raises, of the
  same class, to the callback, and through it to the c10d future.
- the futures of McrdlWork: settled by the callbacks (value, ``then`` chains, no thread
  of the completer pool), failed by the watchdog with wait()'s CommTimeoutError when
  pending past the group's own timeout (the backend stays usable) and past mcrdl's
  default (the backend then refuses new ops, as after a blocking timeout); a future
  taken after completion is settled at once.

Ops of their own (a Lane and an MpiComm on a duplicate of MPI_COMM_WORLD) serve the
failure checks, so that shutting or failing their lane leaves mcrdl's backend intact.

Prints "rank R: torch backend callbacks OK" on success.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time

import mpi4py
import torch
import torch.distributed as dist

import mcrdl
from mcrdl import _C
from mcrdl.torch_backend.work import McrdlWork, watchdog

mpi4py.rc.thread_level = "multiple"
MPI = importlib.import_module("mpi4py.MPI")

dist.init_process_group("mcrdl")
rank, size = dist.get_rank(), dist.get_world_size()
assert size == 2, "run with mpiexec -n 2"
SUM = int(mcrdl.ReduceOp.SUM)


def go() -> None:
    """Rank 1 sends only after this (both ranks call it)."""
    mcrdl.barrier("mpi")


def until(cond, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"rank {rank}: {what} did not happen in {limit} s"
        time.sleep(0.001)


def own_comm(timeout: float):
    """A Lane and an MpiComm of this check's own (failing them spares mcrdl's)."""
    lane = _C.Lane("check")
    comm = MPI.COMM_WORLD.Dup()
    return lane, _C.MpiComm(comm.handle, rank, size, "check", lane, timeout, "mpi"), comm


unraisable = []
sys.unraisablehook = unraisable.append

# -- callbacks: order, lane thread, a raising one, registration after completion ---------
t = torch.zeros(8)
if rank == 0:
    w = mcrdl.recv("mpi", t, 1, async_op=True)
    calls = []
    w.add_done_callback(lambda e: calls.append(("a", e, threading.current_thread().name,
                                                 t.sum().item())))
    w.add_done_callback(lambda e: 1 / 0)
    w.add_done_callback(lambda e: calls.append(("b", e)))
    assert not w.is_completed() and calls == []
    start = time.monotonic()
    try:
        w.time_out(0.2)
        raise AssertionError("time_out on a pending op returned")
    except mcrdl.CommTimeoutError as exc:
        assert "did not complete within 0.2 s" in str(exc), exc
    assert not w.is_completed() and calls == []
    go()
    until(lambda: len(calls) == 2, "the callbacks")  # nobody waits: the lane completes it
    assert calls[0][:2] == ("a", None) and calls[1] == ("b", None), calls
    assert calls[0][2] != threading.current_thread().name, calls  # the lane's thread
    assert calls[0][3] == 8 * 3.0, calls  # the data is in when the callback runs
    assert len(unraisable) == 1 and unraisable[0].exc_type is ZeroDivisionError, unraisable
    w.time_out(0.2)  # completed: returns
    late = []
    w.add_done_callback(lambda e: late.append((e, threading.current_thread().name)))
    assert late == [(None, threading.current_thread().name)], late  # at once, here
    assert w.wait()
else:
    go()
    mcrdl.send("mpi", torch.full((8,), 3.0), 0)
x = torch.ones(4)
mcrdl.all_reduce("mpi", x)  # the timeout of its own did not fail the backend
assert torch.all(x == 2), x

# -- a failed op: its error reaches the callback and the future ------------------------
lane, comm, mpi_comm = own_comm(60.0)
buf = torch.zeros(4)
if rank == 0:
    w1, w2 = comm.recv(buf, 1, 7, True), comm.recv(buf, 1, 8, True)
    got = []
    w1.add_done_callback(got.append)
    future = McrdlWork.of((w2,), [buf], None, None, "recv").get_future()
    lane.shutdown("shut down by the check", 0.0)  # abandons both
    assert len(got) == 1 and isinstance(got[0], mcrdl.BackendUnavailableError), got
    assert "shut down by the check" in str(got[0]), got
    try:
        w1.wait()
        raise AssertionError("wait on an abandoned op returned")
    except mcrdl.BackendUnavailableError as exc:
        assert str(exc) == str(got[0])
    try:
        future.wait()
        raise AssertionError("the future of an abandoned op completed")
    except mcrdl.BackendUnavailableError as exc:
        assert "shut down by the check" in str(exc), exc
go()
if rank == 1:  # what the abandoned receives wait for (MPI still holds their requests)
    comm.send(torch.ones(4), 0, 7, False)
    comm.send(torch.ones(4), 0, 8, False)
    lane.shutdown("done", 1.0)
go()

# -- McrdlWork futures through the process group: settled by the callbacks --------------
world = dist.group.WORLD
pending = []
for i in range(4):  # rank 1 joins late: every future is taken while its op is pending
    if rank == 1:
        time.sleep(0.05)
    v = torch.full((16,), float(rank + i))
    work = dist.all_reduce(v, async_op=True)
    fut = work.get_future()
    pending.append((i, v, fut.then(lambda f: f.value()[0] * 2), fut))
for i, v, doubled, fut in reversed(pending):
    want = float(sum(r + i for r in range(size)))
    assert torch.all(doubled.wait() == 2 * want) and fut.value()[0] is v
    assert torch.all(v == want), (i, v)
assert not [th for th in threading.enumerate() if th.name.startswith("mcrdl-torch-future")]
done = dist.all_reduce(torch.ones(2), async_op=True)
done.wait()
assert torch.all(done.get_future().wait()[0] == size)  # taken after completion

# -- the watchdog: past a group's own timeout, and past mcrdl's default ----------------
lane, comm, mpi_comm = own_comm(1.0)  # its ops' default timeout: 1 s
watchdog.default_timeout = lambda: 1.0  # mcrdl's, as far as the watchdog knows
buf = torch.zeros(4)
if rank == 0:
    for own, default in ((0.3, False), (None, True)):
        w = comm.recv(buf, 1, 9, True)
        work = McrdlWork.of((w,), [buf], own, None, "recv")
        start = time.monotonic()
        fut = work.get_future()
        try:
            fut.wait()
            raise AssertionError("a future pending past its timeout completed")
        except mcrdl.CommTimeoutError as exc:
            took = time.monotonic() - start
            limit = own or 1.0
            assert isinstance(exc, TimeoutError) and isinstance(exc, RuntimeError)
            assert f"did not complete within {limit:g} s" in str(exc), exc
            assert limit <= took < limit + 2, took
            assert work.exception() is exc
        go()  # rank 1 sends: the op completes; the future stays failed
        w.wait()
        assert fut.done()
        try:
            comm.all_reduce(torch.ones(1), SUM, False)
            assert not default, "the backend served an op after its default timeout"
        except mcrdl.BackendUnavailableError as exc:
            assert default and "did not complete within 1 s" in str(exc), exc
else:
    for default in (False, True):
        go()
        comm.send(torch.ones(4), 0, 9, False)
        if not default:
            comm.all_reduce(torch.ones(1), SUM, False)
lane.shutdown("done", 1.0)
mpi_comm.Free()
dist.destroy_process_group()
print(f"rank {rank}: torch backend callbacks OK", flush=True)
