"""Fixtures of the multi-rank tests: run by every rank under mpiexec, same tests in the same order.

The session fixture ``world`` initialises mcrdl with the "mpi" and "gloo" backends and
creates the test groups (collectively, in the same order on every rank). A test
harness communicator (an mpi4py duplicate of COMM_WORLD, independent of mcrdl) lines
the ranks up before each test, and a per-test watchdog turns a hang into a failed run
with every thread's traceback.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys
import threading
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # make `_ref` importable whatever pytest's import mode
    sys.path.insert(0, _HERE)

WATCHDOG_S = float(os.environ.get("MCRDL_TEST_WATCHDOG", "240"))


def _env_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


_CONFIG = {}


def pytest_configure(config):
    """Only rank 0 reports progress; the others print failures and their summary line."""
    _CONFIG["config"] = config
    if _env_rank() != 0:
        config.option.verbose = min(config.option.verbose, -2)


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report, config):
    """Ranks other than 0 print no progress letter for passing tests."""
    if _env_rank() != 0 and report.when == "call" and report.passed:
        return "passed", "", ""
    return None


def _watchdog_expired(nodeid: str) -> None:
    """Print every thread's stack to the real stderr and end this rank (mpiexec ends the rest)."""
    capman = _CONFIG["config"].pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=False)
    sys.stderr.write(f"\n[rank {_env_rank()}] {nodeid} exceeded the {WATCHDOG_S:.0f} s "
                     "watchdog (MCRDL_TEST_WATCHDOG); stacks:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(70)


def pytest_terminal_summary(terminalreporter):
    """Name the rank in each process's summary."""
    terminalreporter.write_line(f"[mcrdl dist tests: rank {_env_rank()}, pid {os.getpid()}]")


def group_specs(size: int) -> dict[str, tuple[int, ...]]:
    """World ranks of the test groups besides the world: a strict subset and a permuted group."""
    if size < 2:
        return {}
    perm = {2: (1, 0), 3: (2, 0), 4: (3, 0, 2)}.get(size, (size - 1, 1, 3, 0))
    return {"sub": tuple(range(1, size)), "perm": perm}


@dataclasses.dataclass
class World:
    """This process's view of the test world."""

    rank: int
    size: int
    groups: dict  # name -> (Group or None, world ranks in group order)
    comm: object  # mpi4py harness communicator (not mcrdl)

    @property
    def gnames(self) -> list[str]:
        return list(self.groups)

    def group(self, name: str):
        return self.groups[name][0]

    def members(self, name: str) -> tuple[int, ...]:
        return self.groups[name][1]


@pytest.fixture(scope="session")
def world():
    """Initialise mcrdl(["mpi", "gloo"]) once; finalize at session end."""
    import mcrdl

    mcrdl.init(["mpi", "gloo"])
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    size = mcrdl.get_size("mpi")
    groups = {"world": (None, tuple(range(size)))}
    for name, ranks in group_specs(size).items():
        groups[name] = (mcrdl.new_group(list(ranks)), ranks)
    w = World(rank=mcrdl.get_rank("mpi"), size=size, groups=groups, comm=comm)
    yield w
    comm.Barrier()
    comm.Free()
    mcrdl.finalize()


@pytest.fixture(autouse=True)
def _lockstep(world, request):
    """Line ranks up before each test; dump stacks and exit if a test hangs."""
    world.comm.Barrier()
    timer = threading.Timer(WATCHDOG_S, _watchdog_expired, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
