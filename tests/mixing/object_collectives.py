"""Object collectives on MPI whose members go out of step (run under mpiexec -n N, N >= 2):
each case raises DesyncError on every member, naming each rank's call, and leaves the
members in step (a good all_gather_object after it); a timeout breaks the group's object
collectives for good (BackendUnavailableError next). Before, the first cases handed
members the objects of other calls (or a raw TypeError) and later calls stayed shifted."""

import time

import mcrdl
from mcrdl.bootstrap import mpi_module

mcrdl.init(["mpi"], timeout=2)
rank, n = mcrdl.get_rank(), mcrdl.get_size()
harness = mpi_module().COMM_WORLD.Dup()  # lines the ranks up, independently of mcrdl


def expect_desync(label: str, call, *needles) -> None:
    try:
        got = call()
        raise AssertionError(f"{label}: returned {got!r}")
    except mcrdl.DesyncError as e:
        for needle in needles:
            assert needle in str(e), (label, needle, str(e))
    assert mcrdl.all_gather_object(rank) == list(range(n)), label  # still in step
    print(f"rank {rank}: {label}: DesyncError, in step after", flush=True)


expect_desync("kind", lambda: mcrdl.all_gather_object("A") if rank == 0
              else mcrdl.broadcast_object("B", src=0),
              "rank 0: all_gather_object", "rank 1: broadcast_object(src=0)")
expect_desync("src", lambda: mcrdl.broadcast_object(rank, src=min(rank, 1)),
              "rank 0: broadcast_object(src=0)", "rank 1: broadcast_object(src=1)")


def skipped_new_group():
    if rank == 0:  # a local error, caught: rank 0 goes on to its next object collective
        try:
            mcrdl.new_group([0, 0])
        except mcrdl.InvalidArgumentError:
            pass
        return mcrdl.all_gather_object("X")
    return mcrdl.new_group(list(range(n)))


expect_desync("new_group", skipped_new_group, "rank 0: all_gather_object,",
              "rank 1: all_gather_object for new_group")

g = mcrdl.new_group(list(range(n)))  # its own communicator: the world's stays clean
if rank != 0:
    start = time.monotonic()
    try:
        mcrdl.all_gather_object("lonely", group=g)
        raise AssertionError("an object collective without rank 0 returned")
    except mcrdl.CommTimeoutError:
        assert time.monotonic() - start < 10 * 2  # a hang guard: the timeout is 2 s
    try:
        mcrdl.all_gather_object(rank, group=g)
        raise AssertionError("the group's object collectives went on after a timeout")
    except mcrdl.BackendUnavailableError as e:
        assert "unusable since an earlier one failed" in str(e), e
    print(f"rank {rank}: timeout: the group refuses after it", flush=True)
# rank 0 joins the world's next object collective once the others timed out (else its
# own 2 s timeout would run while they wait out theirs)
harness.Barrier()
assert mcrdl.all_gather_object(rank) == list(range(n))  # the world's are unaffected
harness.Free()
mcrdl.finalize()
print(f"rank {rank}: object collectives ok", flush=True)
