"""Launch the multi-rank conformance suite (tests/dist) under mpiexec at world sizes 1-3
(4 and 5 in the wider sweep, MCRDL_TEST_FULL=1)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._launch import FULL, skip_without

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TIMEOUT_S = 300


def _mpiexec() -> str | None:
    """mpiexec next to this interpreter, else on PATH."""
    for name in ("mpiexec", "mpirun"):
        cand = os.path.join(sys.prefix, "bin", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _descendants(pid: int) -> list[int]:
    """Pids of every descendant of `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """Terminate mpiexec, its process group and every descendant (ranks get their own groups)."""
    pids = _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in [proc.pid, *pids]:
            try:
                os.kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        time.sleep(2 if sig == signal.SIGTERM else 0)


@pytest.mark.parametrize(("nprocs", "debug", "mpi_blocking"),
                         [(1, "0", "auto"), (2, "0", "always"),
                          (2, "0", "never"),
                          (3, "0", "auto"), (2, "1", "auto"),
                          # the variant's own check: test_blocking.py's allreduce_variant
                          pytest.param(2, "0", "allreduce", marks=FULL),
                          pytest.param(4, "0", "auto", marks=FULL),
                          pytest.param(5, "0", "auto", marks=FULL),
                          pytest.param(3, "1", "auto", marks=FULL)])
def test_dist_conformance(nprocs, debug, mpi_blocking):
    """`mpiexec -n N python -m pytest tests/dist` exits 0; once more in debug mode
    (MCRDL_DEBUG=1, at 2 ranks; at 3 too in the wider sweep), whose agreement checks must
    pass every correct call unchanged. At 2 ranks the mpi backend runs every blocking call
    as the blocking MPI collective (MCRDL_MPI_BLOCKING=always), then none (never), then
    all_gather and reduce_scatter as MPI_Allreduce (allreduce, in the wider sweep: the
    default run checks that variant in test_blocking.py); elsewhere by its measurements."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        skip_without(f"no mpiexec in {os.path.join(sys.prefix, 'bin')} nor on PATH")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_COMM_WORLD", "HYDRA_", "PYTEST_"))}
    env.update(MCRDL_TIMEOUT="60", MCRDL_DIST_TEST="1", MCRDL_DEBUG=debug,
               MCRDL_MPI_BLOCKING=mpi_blocking)
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores shared by up to 5 ranks
    cmd = [mpiexec, "-n", str(nprocs), sys.executable, "-m", "pytest", str(TESTS / "dist"),
           "-p", "no:cacheprovider", "-q"]
    if mpi_blocking in ("always", "never"):
        # The mode is the mpi backend's: its tests and "auto"'s (which routes to mpi on
        # this machine) run; "gloo"'s are the same in every mode and run at 1 and 3 ranks
        # and in debug mode.
        cmd += ["-k", "not gloo"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT_S} s; output:\n{out}")
    took = time.monotonic() - start
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode} after {took:.0f} s; output:\n{out}")
    print(f"world size {nprocs}: {took:.1f} s\n{out[-2000:]}")
