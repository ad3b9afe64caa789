"""Single-process error checks: use before init, available_backends, new_group arguments,
the error class hierarchy, ReduceOp aliases, stale groups, unsupported operations.

This process never initialises mcrdl (other test modules share it): everything that needs
a fresh or an initialised mcrdl runs in one fresh interpreter (a world of one, launched
without mpiexec), which reports each call's outcome as JSON; the tests judge the report.
"""

from __future__ import annotations

import textwrap

import pytest

import mcrdl

from ._launch import fresh_probe

# Run in a fresh interpreter. Each probe records ["ok", result (repr unless plain)] or
# [exception class name, message, names of the class's MRO].
_SCRIPT = textwrap.dedent(r'''
    import json, os, sys
    import torch
    import mcrdl

    res = {}

    def probe(key, fn):
        try:
            val = fn()
        except Exception as exc:
            res[key] = [type(exc).__name__, str(exc), [c.__name__ for c in type(exc).__mro__]]
        else:
            plain = isinstance(val, (list, str, int, float, bool, type(None)))
            res[key] = ["ok", val if plain else repr(val)]

    t = torch.ones(2)
    res["initialized_at_start"] = mcrdl.is_initialized()
    # where nccl can run: a CUDA build of torch with NCCL and a GPU visible to this process
    res["nccl_runs_here"] = bool(
        torch.cuda.is_available() and torch.distributed.is_available()
        and torch.distributed.is_nccl_available() and not getattr(torch.version, "hip", None))
    probe("available_before_init", mcrdl.available_backends)
    before = {
        "all_reduce mpi": lambda: mcrdl.all_reduce("mpi", t),
        "all_reduce gloo": lambda: mcrdl.all_reduce("gloo", t),
        "all_reduce auto": lambda: mcrdl.all_reduce("auto", t),
        "all_reduce async": lambda: mcrdl.all_reduce("gloo", t, async_op=True),
        "bcast": lambda: mcrdl.bcast("mpi", t, 0),
        "all_gather": lambda: mcrdl.all_gather("gloo", torch.ones(2), t),
        "send": lambda: mcrdl.send("mpi", t, 0),
        "barrier": lambda: mcrdl.barrier("gloo"),
        "get_rank": lambda: mcrdl.get_rank(),
        "get_size mpi": lambda: mcrdl.get_size("mpi"),
        "get_world_size": lambda: mcrdl.get_world_size(),
        "new_group": lambda: mcrdl.new_group([0]),
        "synchronize mpi": lambda: mcrdl.synchronize("mpi"),
    }
    for name, fn in before.items():
        probe("before_init " + name, fn)
    probe("get_backends_before_init", mcrdl.get_backends)

    # A bool is not a number of seconds (and must not become a 1 s timeout).
    probe("init timeout=True", lambda: mcrdl.init(["gloo"], timeout=True))
    os.environ["MCRDL_TIMEOUT"] = "abc"
    probe("init MCRDL_TIMEOUT=abc", lambda: mcrdl.init(["gloo"]))
    del os.environ["MCRDL_TIMEOUT"]
    if mcrdl.is_initialized():
        mcrdl.finalize()

    mcrdl.init(["mpi", "gloo"])
    probe("available_after_init", mcrdl.available_backends)
    for bad in ([], [0, 0], [5], ["a"], [-1], [True], 0, "0", None):
        probe("new_group " + repr(bad), lambda bad=bad: mcrdl.new_group(bad))
    probe("all_reduce after bad new_group", lambda: mcrdl.all_reduce("mpi", torch.ones(1)))

    # A group of an earlier session must not be usable after finalize + init, even when
    # the new session has created a group of its own (which may reuse the old one's id).
    old = mcrdl.new_group([0])
    # The mpi backend's methods are C functions holding plain communicator pointers: one
    # kept past finalize must refuse the call, not reach freed memory or MPI.
    import mcrdl.api
    import gc, weakref
    backend = mcrdl.api.current_runtime().backend("mpi")
    kept, gone = backend.all_reduce, weakref.ref(backend)
    mcrdl.finalize()
    probe("after_finalize all_reduce", lambda: mcrdl.all_reduce("gloo", t))
    for key, grp, asy in (("world", None, False), ("group", old, False), ("async", None, True)):
        probe("kept mpi method " + key,
              lambda grp=grp, asy=asy: kept(t, mcrdl.ReduceOp.SUM, grp, asy))
    probe("kept mpi method lookup", lambda: backend.all_reduce(t, mcrdl.ReduceOp.SUM, None, False))
    probe("kept mpi method add_group", lambda: backend.add_group(old))
    probe("second finalize of the mpi backend", backend.finalize)
    # finalized and no longer referenced: collected (no cycle through the C functions)
    del kept, backend
    gc.collect()
    res["finalized backend collected"] = gone() is None
    mcrdl.init(["mpi", "gloo"])
    probe("stale group, no new group", lambda: mcrdl.all_reduce("gloo", t, group=old))
    mcrdl.new_group([0])
    for b in ("mpi", "gloo"):
        probe("stale group " + b, lambda b=b: mcrdl.all_reduce(b, t, group=old))
    mcrdl.finalize()

    # A lane failed by a timeout still adds groups: the rank's peers are in the same
    # collective MPI_Comm_split (a rank refusing alone would leave them waiting).
    mcrdl.init(["mpi"])
    mcrdl.api.current_runtime().backend("mpi").mark_failed("a simulated timeout")
    probe("new_group on a failed lane", lambda: list(mcrdl.new_group([0]).ranks))
    mcrdl.finalize()

    # pccl too: a group added to a finalized backend (its communicators freed).
    mcrdl.init(["pccl"])
    grp, pccl_backend = mcrdl.new_group([0]), mcrdl.api.current_runtime().backend("pccl")
    mcrdl.finalize()
    probe("kept pccl add_group", lambda: pccl_backend.add_group(grp))
    del pccl_backend

    # A third-party backend that implements only all_reduce.
    class Partial(mcrdl.Backend):
        capabilities = mcrdl.Capabilities(ops=frozenset({"all_reduce"}))

        def all_reduce(self, tensor, op, group, async_op):
            return None

    mcrdl.register_backend("partial", Partial)
    mcrdl.init(["partial"])
    probe("partial all_reduce", lambda: mcrdl.all_reduce("partial", torch.ones(2)))
    probe("partial gather", lambda: mcrdl.gather("partial", torch.ones(2), torch.ones(2)))
    probe("partial barrier", lambda: mcrdl.barrier("partial"))
    probe("partial bad dtype",
          lambda: mcrdl.all_reduce("partial", torch.ones(2, dtype=torch.complex64)))
    probe("partial bad root", lambda: mcrdl.reduce("partial", torch.ones(2), dst=3))
    mcrdl.finalize()
    print("@@RESULT@@" + json.dumps(res))
''')


@pytest.fixture(scope="module")
def fresh() -> dict:
    """Outcomes of the probes of _SCRIPT in a fresh interpreter."""
    return fresh_probe(_SCRIPT)


def _raised(fresh: dict, key: str, cls: type, *needles: str) -> str:
    """Assert probe `key` raised `cls` (by name, checking the MRO) with the needles."""
    got = fresh[key]
    assert got[0] != "ok", f"{key}: expected {cls.__name__}, nothing raised (returned {got[1]})"
    name, msg, mro = got
    assert cls.__name__ in mro, f"{key}: expected {cls.__name__}, got {name}: {msg}"
    for n in needles:
        assert n in msg, f"{key}: message lacks {n!r}: {msg!r}"
    return msg


# ------------------------------------------------------------------------ before init


def test_fresh_process_starts_uninitialized(fresh):
    assert fresh["initialized_at_start"] is False
    assert fresh["get_backends_before_init"] == ["ok", []]


@pytest.mark.parametrize("what", [
    "all_reduce mpi", "all_reduce gloo", "all_reduce auto", "all_reduce async", "bcast",
    "all_gather", "send", "barrier", "get_rank", "get_size mpi", "get_world_size",
    "new_group", "synchronize mpi",
])
def test_before_init(fresh, what):
    """Every operation and query before init: BackendUnavailableError that says to init."""
    _raised(fresh, f"before_init {what}", mcrdl.BackendUnavailableError, "init")


def test_after_finalize(fresh):
    _raised(fresh, "after_finalize all_reduce", mcrdl.BackendUnavailableError, "init")


def test_backend_method_kept_past_finalize_refuses(fresh):
    for key in ("world", "group", "async", "lookup", "add_group"):
        _raised(fresh, "kept mpi method " + key, mcrdl.BackendUnavailableError,
                "backend 'mpi' is closed (the 'mpi' backend was finalized)", "mcrdl.init()")


def test_backend_finalize_twice_is_harmless(fresh):
    assert fresh["second finalize of the mpi backend"][0] == "ok"


def test_failed_lane_still_adds_groups(fresh):
    """Only a closed lane refuses add_group: a timeout fails one rank's lane, and its
    peers are already in the collective that creates the group."""
    assert fresh["new_group on a failed lane"] == ["ok", [0]]


def test_pccl_add_group_after_finalize_refuses(fresh):
    _raised(fresh, "kept pccl add_group", mcrdl.BackendUnavailableError,
            "backend 'pccl' is closed", "mcrdl.init()")


def test_finalized_backend_is_collected(fresh):
    """The mpi backend's C functions and their table hold its methods: after finalize the
    backend must not stay alive through that cycle."""
    assert fresh["finalized backend collected"] is True


def test_before_init_in_this_process():
    """The same in this process, when it is not initialised (else covered by the above)."""
    if mcrdl.is_initialized():
        pytest.skip("this process is initialised")
    import torch

    for fn in (lambda: mcrdl.all_reduce("mpi", torch.ones(1)), lambda: mcrdl.barrier("gloo"),
               lambda: mcrdl.get_rank(), lambda: mcrdl.new_group([0])):
        with pytest.raises(mcrdl.BackendUnavailableError, match="init"):
            fn()


# ------------------------------------------------------------------ available_backends


def _listed(fresh: dict, key: str) -> list:
    status, value = fresh[key][:2]
    assert status == "ok", f"{key} raised {status}: {value}"
    return value


@pytest.mark.parametrize("key", ["available_before_init", "available_after_init"])
def test_available_backends_fresh(fresh, key):
    got = _listed(fresh, key)
    assert isinstance(got, list) and all(isinstance(n, str) for n in got), got
    assert "mpi" in got and "gloo" in got, got
    assert "auto" not in got, got
    assert ("nccl" in got) == fresh["nccl_runs_here"], (got, fresh["nccl_runs_here"])


def test_available_backends_here():
    got = mcrdl.available_backends()
    assert isinstance(got, list), type(got)
    assert {"mpi", "gloo"} <= set(got), got


# --------------------------------------------------------------------------- new_group


@pytest.mark.parametrize("bad, needles", [
    ([], ("'ranks'", "empty")),
    ([0, 0], ("'ranks'", "[0, 0]")),
    ([5], ("'ranks'[0]", "5", "[0, 0]")),
    (["a"], ("'ranks'[0]", "'a'")),
    ([-1], ("'ranks'[0]", "-1")),
    ([True], ("'ranks'[0]", "True")),
    (0, ("'ranks'", "int")),
    ("0", ("'ranks'", "str")),
    (None, ("'ranks'", "None")),
], ids=repr)
def test_new_group_bad_ranks(fresh, bad, needles):
    _raised(fresh, f"new_group {bad!r}", mcrdl.InvalidArgumentError, *needles)


def test_usable_after_bad_new_group(fresh):
    assert fresh["all_reduce after bad new_group"][0] == "ok", fresh[
        "all_reduce after bad new_group"]


# ------------------------------------------------------------------------ other checks


def test_init_timeout_bool(fresh):
    """timeout=True is not a number of seconds (bool is rejected for ranks and tags too);
    nor is MCRDL_TIMEOUT=abc (a bare ValueError before)."""
    _raised(fresh, "init timeout=True", mcrdl.InvalidArgumentError, "'timeout'", "True")
    _raised(fresh, "init MCRDL_TIMEOUT=abc", mcrdl.InvalidArgumentError, "MCRDL_TIMEOUT='abc'")


def test_log_level_takes_names_and_numbers_and_ignores_bad_values():
    """MCRDL_LOG_LEVEL=10 made `import mcrdl` fail (ValueError: Unknown level)."""
    import logging

    log = logging.getLogger("mcrdl")
    before = log.level
    try:
        mcrdl.api._log_level("10")
        assert log.level == 10
        mcrdl.api._log_level("warning")
        assert log.level == logging.WARNING
        with pytest.warns(UserWarning, match="MCRDL_LOG_LEVEL='loud'"):
            mcrdl.api._log_level("loud")
        assert log.level == logging.WARNING
    finally:
        log.setLevel(before)


def test_stale_group_rejected(fresh):
    """A group from before finalize() is refused after a new init."""
    _raised(fresh, "stale group, no new group", mcrdl.InvalidArgumentError, "group")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_stale_group_rejected_when_ids_are_reused(fresh, backend):
    """... also when the new session created a group of its own (same id as the old one)."""
    _raised(fresh, f"stale group {backend}", mcrdl.InvalidArgumentError, "group")


def test_unsupported_operation(fresh):
    """An op the backend lacks: UnsupportedOperationError naming the op, the backend and
    the backends that can do it; bad arguments are still InvalidArgumentError first."""
    assert fresh["partial all_reduce"][0] == "ok", fresh["partial all_reduce"]
    msg = _raised(fresh, "partial gather", mcrdl.UnsupportedOperationError, "gather",
                  "'partial'", "backends that do: mpi, gloo")
    # nccl has gather but no GPU here: named apart, not offered as a way out
    assert "(nccl" in msg and "cannot run in this process)" in msg, msg
    _raised(fresh, "partial barrier", mcrdl.UnsupportedOperationError, "barrier", "'partial'")
    _raised(fresh, "partial bad dtype", mcrdl.InvalidArgumentError, "'tensor'")
    _raised(fresh, "partial bad root", mcrdl.InvalidArgumentError, "'dst'", "3")


# ---------------------------------------------------------------- classes and ReduceOp


@pytest.mark.parametrize("cls, bases", [
    ("MCRDLError", (RuntimeError,)),
    ("BackendUnavailableError", ("MCRDLError", RuntimeError)),
    ("InvalidArgumentError", ("MCRDLError", ValueError, RuntimeError)),
    ("UnsupportedOperationError", ("MCRDLError", RuntimeError)),
    ("CommTimeoutError", ("MCRDLError", TimeoutError, RuntimeError)),
    ("DesyncError", ("MCRDLError", RuntimeError)),
])
def test_error_hierarchy(cls, bases):
    """docs/api.md "Errors": base classes, and mcrdl re-exports the classes of mcrdl.errors."""
    c = getattr(mcrdl, cls)
    assert c is getattr(mcrdl.errors, cls)
    assert isinstance(c, type) and issubclass(c, Exception)
    for base in bases:
        base = getattr(mcrdl, base) if isinstance(base, str) else base
        assert issubclass(c, base), f"{cls} is not a subclass of {base.__name__}"


def test_error_classes_are_distinct():
    names = ("BackendUnavailableError", "InvalidArgumentError", "UnsupportedOperationError",
             "CommTimeoutError", "DesyncError")
    for a in names:
        for b in names:
            if a != b:
                assert not issubclass(getattr(mcrdl, a), getattr(mcrdl, b)), (a, b)
    assert not issubclass(mcrdl.BackendUnavailableError, ValueError)
    assert not issubclass(mcrdl.MCRDLError, ValueError)


def test_reduce_op_aliases():
    assert mcrdl.ReduceOp.PROD is mcrdl.ReduceOp.PRODUCT
    names = {"SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"}
    assert names <= set(mcrdl.ReduceOp.__members__)
    assert len({mcrdl.ReduceOp[n] for n in names}) == len(names)


def test_wait_policy_follows_cores_and_env(monkeypatch):
    """Idle lanes sleep longer (and waiters yield at once) only when ranks outnumber
    cores; MCRDL_IDLE_SLEEP / MCRDL_POLL_SPINS override, and a bad value is named."""
    from mcrdl.backends import mpi
    from mcrdl.launch import node_cores_for_ranks
    monkeypatch.delenv("MCRDL_IDLE_SLEEP", raising=False)
    monkeypatch.delenv("MCRDL_POLL_SPINS", raising=False)
    cores = node_cores_for_ranks()
    assert mpi.idle_sleep(cores) is False and mpi.idle_sleep(cores + 1) is True
    assert mpi.poll_spins(cores) == 64 and mpi.poll_spins(cores + 1) == 0
    monkeypatch.setenv("MCRDL_IDLE_SLEEP", "0")
    assert mpi.idle_sleep(cores + 1) is False
    monkeypatch.setenv("MCRDL_IDLE_SLEEP", "1")
    assert mpi.idle_sleep(1) is True
    monkeypatch.setenv("MCRDL_IDLE_SLEEP", "yes")
    with pytest.raises(ValueError, match="MCRDL_IDLE_SLEEP must be 0 or 1, got 'yes'"):
        mpi.idle_sleep(1)
