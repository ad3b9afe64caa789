"""Mixed-backend execution, timeouts, debug mode and faults, on real multi-rank worlds
(the rank scripts are in tests/mixing/)."""

import os
import re
import subprocess
import sys
import time

import pytest

from ._launch import FULL, mpiexec_or_skip, run_launcher, run_scripts

HERE = os.path.join(os.path.dirname(__file__), "mixing")
# The backends the mixing scripts that take a list check in turn, in one launch.
BOTH = ("mpi", "gloo")


def launch(n, script, *args, env=None, timeout=240, expect_rc=0, mpiexec_args=()):
    mpiexec = mpiexec_or_skip()
    full_env = dict(os.environ, **(env or {}))
    cmd = [mpiexec, *mpiexec_args, "-n", str(n), sys.executable, os.path.join(HERE, script),
           *map(str, args)]
    return run_launcher(cmd, env=full_env, timeout=timeout, expect_rc=expect_rc)


#: The 3-rank checks of this module that share one launch: tests/_multi.py runs the
#: scripts in turn in each rank's process (each its own init/finalize session, with its
#: arguments and environment), so the ranks import torch once for the five.
MERGED = [
    ("stress.py", [], {"MCRDL_TIMEOUT": "120"}),
    ("opposite_waits.py", [], {}),
    ("desync.py", [",".join(BOTH)], {"MCRDL_DEBUG": "1"}),
    ("debug_cross_group.py", [",".join(BOTH), "10"], {"MCRDL_DEBUG": "1"}),
    ("p2p_timed_wait.py", [",".join(BOTH)], {}),
    ("object_collectives.py", [], {}),
    ("mismatch.py", [], {"MCRDL_MPI_BLOCKING": "never"}),
    ("mismatch.py", [], {"MCRDL_MPI_BLOCKING": "always"}),
]


@pytest.fixture(scope="module")
def merged() -> str:
    """The output of the launch of MERGED at 3 ranks (once for the module)."""
    plan = [[os.path.join(HERE, script), args, env] for script, args, env in MERGED]
    return run_scripts(3, plan, dict(os.environ), timeout=500)


@pytest.mark.parametrize("n", [3, pytest.param(4, marks=FULL)])
def test_randomized_stress(n, request):
    out = (request.getfixturevalue("merged") if n == 3
           else launch(n, "stress.py", env={"MCRDL_TIMEOUT": "120"}))
    m = re.search(r"stress OK: world (\d+), \d+ rounds, (\d+) async ops", out)
    assert m and int(m.group(1)) == n and int(m.group(2)) >= 1000 * n // 2, out
    print(out[m.start():].splitlines()[0])
    for r in range(n):
        assert f"rank {r}: issued" in out


# CI: 3 ranks (an odd world, every rank both first and last of some order); 2 in the sweep
@pytest.mark.parametrize("n", [pytest.param(2, marks=FULL), 3])
def test_opposite_issue_and_wait_orders_do_not_deadlock(n, request):
    out = request.getfixturevalue("merged") if n == 3 else launch(n, "opposite_waits.py",
                                                                  timeout=180)
    for r in range(n):
        assert f"rank {r}: opposite waits OK" in out


def test_object_collectives_out_of_step(merged):
    """Members whose object collectives differ (the op, src, or a call one rank skipped
    after catching an error) all raise DesyncError naming each rank's call, and stay in
    step; a timeout makes the group's object collectives refuse (mixing/
    object_collectives.py, at 3 ranks)."""
    out = merged
    for r in range(3):
        for case in ("kind", "src", "new_group"):
            assert f"rank {r}: {case}: DesyncError, in step after" in out, (r, case, out)
        assert f"rank {r}: object collectives ok" in out, out
    for r in (1, 2):
        assert f"rank {r}: timeout: the group refuses after it" in out, out


def _check_timeouts(out: str, limit: float, backends=BOTH) -> None:
    """Ranks 1 and 2 timed out on each backend in turn, not before the timeout (a
    ceiling of 10x it only catches a hang), and the backend then refused calls; every
    rank finalized. On gloo one of the two may instead see its op fail with the
    connection closed by the other, whose own timeout fired first (docs/api.md "Work"):
    one of them timed out."""
    for backend in backends:
        timed_out = 0
        for r in (1, 2):
            m = re.search(rf"rank {r}: {backend}: CommTimeoutError after ([\d.]+) s", out)
            if m:
                assert limit * 0.99 <= float(m.group(1)) < 10 * limit, m.group(0)
                timed_out += 1
            else:
                m = re.search(rf"rank {r}: {backend}: peer closed after ([\d.]+) s", out)
                assert m and backend == "gloo", out
                assert float(m.group(1)) < 10 * limit, m.group(0)
            assert f"rank {r}: {backend}: next op refused: BackendUnavailableError" in out
        assert timed_out >= 1, out
    for r in range(3):
        assert f"rank {r}: finalized" in out


@pytest.mark.parametrize("debug", ["0", "1"])
def test_collective_one_rank_never_joins_times_out(debug, tmp_path):
    """On "mpi", then on "gloo" in the same launch. In debug mode the error also names the
    rank that never arrived."""
    limit = 2.0
    # The nonblocking path's contract; the blocking MPI path's is in test_blocking.py.
    # pccl too: its all_reduce (a reduce-scatter then an all-gather) is one op, numbered
    # and named all_reduce like the others'.
    backends = (*BOTH, "pccl")
    out = launch(3, "timeout.py", ",".join(backends), limit,
                 env={"MCRDL_DEBUG": debug, "MCRDL_MPI_BLOCKING": "never",
                      "TIMEOUT_DONE_DIR": str(tmp_path)}, timeout=120)
    _check_timeouts(out, limit, backends)
    if debug == "0":  # docs/api.md "Work": the same error again
        for backend in backends:
            for r in (1, 2):
                assert f"rank {r}: {backend}: second wait raised again after" in out, out


def test_sizes_that_differ_are_named_outside_debug_mode(merged):
    """A bcast whose receiver expects fewer elements: the truncation MPI reports (on the
    nonblocking path only "See the MPI_ERROR field in MPI_Status") comes with the likely
    cause and MCRDL_DEBUG=1, on both paths (tests/mixing/mismatch.py)."""
    for mode, mpi_text in (("never", "See the MPI_ERROR field"), ("always", "truncated")):
        m = re.search(rf"rank 1: mismatch \({mode}\): MCRDLError: (.*)", merged)
        assert m and mpi_text in m.group(1), merged
        assert "The likeliest cause: the ranks' calls differ" in m.group(1), m.group(1)
        assert "MCRDL_DEBUG=1" in m.group(1), m.group(1)


def test_init_past_its_timeout_raises():
    """A rank that calls init later than the others' timeout: they raise CommTimeoutError
    naming init within the timeout (before, MPI_Comm_dup waited for it without end), and
    the job ends."""
    limit, late = 2.0, 5.0
    start = time.monotonic()
    out = launch(2, "late_init.py", limit, late, timeout=60, expect_rc="nonzero")
    m = re.search(r"rank 0: raised after ([\d.]+) s: (.*)", out)
    assert m and float(m.group(1)) < limit + 5, out
    assert m.group(2).startswith(f"init (group world) did not complete within {limit} s"), out
    assert "every rank must call mcrdl.init" in m.group(2), out
    assert "init returned" not in out, out
    assert time.monotonic() - start < late + limit + 30, out


@pytest.mark.parametrize("hooks", ["mcrdl", "buffered"])
def test_uncaught_exception_ends_the_job(hooks):
    """Rank 1 raises and nobody catches it: mcrdl's excepthook prints the traceback and
    ends the job with MPI_Abort within seconds, not after the others' 60 s timeout.
    "buffered": a hook chained after mcrdl's (torch.distributed's) prints the traceback
    once mcrdl's returned; the abort had come first, and the job ended without a word."""
    # ended by the abort, not by the others' 60 s timeout (their CommTimeoutError); the
    # launch's own timeout, past theirs, only catches a hang
    out = launch(3, "uncaught.py", *(["buffered"] if hooks == "buffered" else []),
                 timeout=300, expect_rc="nonzero")
    assert "CommTimeoutError" not in out, out
    prefix = "[rank1]: " if hooks == "buffered" else ""
    assert f"{prefix}RuntimeError: not caught on rank 1" in out, out
    assert "went on without rank 1" not in out, out
    # mcrdl's line follows the traceback; the abort's kill may cut the launcher's
    # forwarding of it (seen once in CI), so it is not required here


def test_fused_call_one_rank_never_joins_times_out(tmp_path):
    """Tensor fusion, on "mpi" then on "gloo": the round's agreement times out instead of
    hanging; the (backend, group) then refuses fused calls."""
    limit = 2.0
    # The agreement is a small blocking all_reduce: on the blocking MPI path its timeout
    # ends the job (test_blocking.py); this checks the nonblocking path's contract.
    out = launch(3, "timeout.py", ",".join(BOTH), limit, "fusion",
                 env={"MCRDL_MPI_BLOCKING": "never", "TIMEOUT_DONE_DIR": str(tmp_path)},
                 timeout=120)
    _check_timeouts(out, limit)


def test_debug_mode_mismatches_raise_desync_on_every_rank(merged):
    """On "mpi", then on "gloo" (in one launch)."""
    out = merged
    cases = ["count", "dtype", "root", "reduce op", "split sizes", "async wait", "local error"]
    for backend in BOTH:
        for case in cases:
            for r in range(3):
                assert f"rank {r}: {backend}: {case}: DesyncError raised" in out, (
                    backend, case, r, out)
    assert "ranks disagree on the element count" in out


def test_debug_mode_orders_per_backend_and_group(merged):
    """Groups of one backend issued in a different order on different ranks: valid, so
    debug mode must not serialize them (a deadlock would end in CommTimeoutError). On
    "mpi" and on "gloo", in one launch."""
    out = merged
    for backend in BOTH:
        for r in range(3):
            assert f"rank {r}: cross-group order OK on {backend}" in out, out


def test_async_p2p_completes_by_timed_wait_and_by_polling(merged):
    """wait(timeout) and is_completed() of async send/recv (Gloo's complete only through
    a plain wait in c10d), on "mpi" and on "gloo", in one launch."""
    out = merged
    for backend in BOTH:
        for r in range(3):
            assert f"rank {r}: p2p timed waits OK on {backend}" in out, out


# mpiexec's own cleanup does not depend on the backend: CI runs it on mpi, and the
# survivors' own detection on both; the wide sweep adds the launcher's on gloo
@pytest.mark.parametrize("backend, cleanup", [("mpi", "launcher"),
                                              pytest.param("gloo", "launcher", marks=FULL),
                                              ("mpi", "survivors"), ("gloo", "survivors")])
def test_dead_rank_makes_the_job_exit_nonzero(backend, cleanup):
    """A rank is SIGKILLed mid-run. 'launcher': mpiexec's own cleanup; 'survivors':
    with it disabled, the survivors raise (CommTimeoutError, or Gloo's connection error)
    or are ended by the MPI runtime; either way the job exits non-zero, nothing is left."""
    limit = 3
    args = ("-disable-auto-cleanup",) if cleanup == "survivors" else ()
    start = time.monotonic()
    out = launch(3, "fault.py", backend, env={"MCRDL_TIMEOUT": str(limit)}, timeout=limit + 60,
                 expect_rc="nonzero", mpiexec_args=args)
    took = time.monotonic() - start
    assert "loop finished" not in out, out
    assert "rank 1: reached iteration 50" in out, out  # the kill ended it, not a timeout
    assert took < limit + 30, took
    pids = [int(p) for p in re.findall(r"rank \d: pid (\d+)", out)]
    alive = _left_behind(pids)
    assert not alive, f"processes left behind: {alive}"


def _left_behind(pids: list[int], grace: float = 5.0) -> list[int]:
    """The pids still alive after up to `grace` seconds. A rank's MPI_Abort (mcrdl's
    excepthook, or the blocking path's watchdog) kills the others, and that kill, or the
    aborting rank's own exit, may land just after mpiexec returned."""
    deadline = time.monotonic() + grace
    while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                           text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def test_finalize_waits_for_a_late_rank_at_most_the_timeout():
    """Rank 1 reaches finalize 7 s late, past the 2 s timeout and the 2 s the one
    backend (mpi) may take draining its ops: rank 0's finalize raises CommTimeoutError
    naming finalize within 4 + 5 s (it waited without end on the bootstrap's closing
    barrier), and rank 1's still completes."""
    limit, delay = 2.0, 7.0
    out = launch(2, "slow_finalize.py", limit, delay, timeout=120)
    m = re.search(r"rank 0: CommTimeoutError after ([\d.]+) s: (.*)", out)
    assert m, out
    assert 2 * limit <= float(m.group(1)) < 2 * limit + 5, out
    assert "finalize (group world) did not complete within 4.0 s" in m.group(2), out
    assert re.search(r"rank 1: finalized after [\d.]+ s", out), out


def test_lane_edges_p2p_past_a_collective_inference_mode_and_exit():
    """2 ranks, small collectives on the blocking variant: a send is not held behind an
    async blocking collective; async finish steps keep the caller's inference mode;
    timeouts too large for the clock; an exit without finalize with an op in flight
    ends cleanly (tests/mixing/lane_edges.py says how each is checked)."""
    out = launch(2, "lane_edges.py", env={"MCRDL_MPI_BLOCKING": "always"}, timeout=120)
    assert out.count("lane edges OK") == 2, out
    assert "Segmentation" not in out and "signal" not in out.lower(), out
