"""The front's operation functions are C callables (mcrdl/csrc/front.cpp) over generated
Python functions (their ``__wrapped__``): every call must behave exactly as the Python
function does. A fresh interpreter (a world of one, no mpiexec) makes the same calls both
ways, through a recording backend (what arguments arrive, in what order) and through the
real ones, and reports each outcome; the tests compare the two.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest

import mcrdl

from ._launch import fresh_probe

_SCRIPT = textwrap.dedent(r'''
    import json
    import torch
    import torch.distributed as dist
    import mcrdl

    res = {}

    def outcome(fn):
        try:
            val = fn()
        except Exception as exc:
            return [type(exc).__name__, str(exc)]
        return ["ok", repr(val)]

    got = []

    class Recorder(mcrdl.Backend):
        """Records what each call receives; lacks everything but these four."""
        capabilities = mcrdl.Capabilities(
            ops=frozenset({"all_reduce", "bcast", "all_gather", "reduce_scatter"}))

        def all_reduce(self, tensor, op, group, async_op):
            got.append(["all_reduce", tensor.tolist(), op.name, group, async_op])
            return "ar-result"

        def bcast(self, tensor, src, group, async_op):
            got.append(["bcast", tensor.tolist(), src, group, async_op])

        def all_gather(self, output, input, group, async_op):
            got.append(["all_gather", output.tolist(), input.tolist(), group, async_op])

        def reduce_scatter(self, output, input, op, group, async_op):
            raise mcrdl.UnsupportedOperationError("reduce_scatter", "recorder")

    t, u = torch.ones(2), torch.zeros(2)
    calls = {
        "positional": lambda f: f("recorder", t),
        "all positional": lambda f: f("recorder", t, mcrdl.ReduceOp.MAX, None, True),
        "op keyword": lambda f: f("recorder", t, op=mcrdl.ReduceOp.MIN),
        "op by name": lambda f: f("recorder", t, op="max"),
        "op torch.distributed": lambda f: f("recorder", t, dist.ReduceOp.PRODUCT),
        "op unknown name": lambda f: f("recorder", t, op="median"),
        "op bad type": lambda f: f("recorder", t, op=3.5),
        "keywords reordered": lambda f: f("recorder", async_op=True, op="sum", tensor=t),
        "tensor keyword": lambda f: f("recorder", tensor=t),
        "backend keyword": lambda f: f(backend="recorder", tensor=t),
        "missing tensor": lambda f: f("recorder"),
        "no arguments": lambda f: f(),
        "unknown keyword": lambda f: f("recorder", t, root=0),
        "given twice": lambda f: f("recorder", t, tensor=t),
        "too many": lambda f: f("recorder", t, "sum", None, False, 7),
        "unknown backend": lambda f: f("nope", t),
        "backend None": lambda f: f(None, t),
        "backend unhashable": lambda f: f(["recorder"], t),
        "async_op truthy object": lambda f: f("recorder", t, async_op=[1]),
    }
    mcrdl.register_backend("recorder", Recorder)
    for phase in ("before init", "initialized", "after finalize"):
        if phase == "initialized":
            mcrdl.init(["recorder", "mpi"])
        for name, call in calls.items():
            for how in ("c", "py"):
                f = mcrdl.all_reduce if how == "c" else mcrdl.all_reduce.__wrapped__
                got.clear()
                out = outcome(lambda: call(f))
                res[f"{phase}|{name}|{how}"] = [out, list(got)]
        if phase == "initialized":
            for name, call in {
                "bcast": lambda f: f("recorder", t, 0),
                "bcast src keyword": lambda f: f("recorder", t, src=0, async_op=True),
                "all_gather": lambda f: f("recorder", u, t),
                "all_gather keywords": lambda f: f("recorder", input=t, output=u),
                "reduce_scatter unsupported": lambda f: f("recorder", u, t),
                "gather missing": lambda f: f("recorder", u, t),
            }.items():
                op = name.split()[0]
                for how in ("c", "py"):
                    f = getattr(mcrdl, op)
                    f = f if how == "c" else f.__wrapped__
                    got.clear()
                    res[f"ops|{name}|{how}"] = [outcome(lambda: call(f)), list(got)]
            # The real mpi backend through the C front: results, not only routing.
            x = torch.arange(4, dtype=torch.float32)
            mcrdl.all_reduce("mpi", x, op="avg")
            out = torch.zeros(4)
            mcrdl.all_gather("mpi", out, x)
            w = mcrdl.all_reduce("mpi", x, async_op=True)
            w.wait()
            res["mpi values"] = [x.tolist(), out.tolist(), type(w).__name__]
            # The backend's C functions convert async_op and ints themselves
            # (csrc/mpi_comm.cpp truthy, csrc/pyargs.h to_int): as Python would.
            class Ambiguous:
                def __bool__(self):
                    raise ValueError("truth value is ambiguous")
            SUM = mcrdl.ReduceOp.SUM
            w1 = mcrdl.all_reduce("mpi", x, SUM, None, 1)
            res["fast args"] = [
                type(w1).__name__, w1.wait(),
                outcome(lambda: mcrdl.all_reduce("mpi", x, SUM, None, 0)),
                outcome(lambda: mcrdl.all_reduce("mpi", x, SUM, None, Ambiguous())),
                outcome(lambda: mcrdl.bcast("mpi", x, torch.tensor(0).item())),
                outcome(lambda: mcrdl.bcast("mpi", x, True)),
                outcome(lambda: mcrdl.bcast("mpi", x, -1)),
                outcome(lambda: mcrdl.bcast("mpi", x, 2 ** 40)),
                outcome(lambda: mcrdl.bcast("mpi", x, 2 ** 70)),
                # past the front's conversion: the backend's own function
                outcome(lambda: mcrdl.api.current_runtime().backend("mpi").all_reduce(
                    x, 2 ** 32, None, False)),
            ]
            mcrdl.finalize()
    # A new session: the front must call the new session's backend object, not a method
    # it cached from the last one (the runtime invalidates the cache at every change).
    seen = []  # the backend objects themselves: kept alive, their ids cannot be reused
    Recorder.bcast = lambda self, tensor, src, group, async_op: seen.append(self)
    for _ in range(2):
        mcrdl.init(["recorder"])
        mcrdl.bcast("recorder", t, 0)
        mcrdl.bcast("recorder", t, 0)
        mcrdl.finalize()
    res["sessions"] = [len(seen), len({id(b) for b in seen})]
    print("@@RESULT@@" + json.dumps(res))
''')


@pytest.fixture(scope="module")
def report() -> dict:
    return fresh_probe(_SCRIPT)


def _pairs(report: dict):
    keys = sorted({k.rsplit("|", 1)[0] for k in report if k.count("|") == 2})
    return [(k, report[k + "|c"], report[k + "|py"]) for k in keys]


def test_c_front_matches_python_function(report):
    """Same result or same exception class and message, and the same arguments delivered
    to the backend, for every call of the matrix, before init, initialized and after."""
    pairs = _pairs(report)
    assert len(pairs) >= 3 * 19 + 6
    for key, c, py in pairs:
        assert c == py, f"{key}: C front {c} != Python function {py}"


def test_front_binds_arguments_as_python_does(report):
    """Spot checks of what the backend received (the matrix compares C with Python; this
    pins the Python behaviour down too, so that both cannot drift together)."""
    out, got = report["initialized|keywords reordered|c"]
    assert out == ["ok", "'ar-result'"]
    assert got == [["all_reduce", [1.0, 1.0], "SUM", None, True]]
    out, got = report["initialized|op by name|c"]
    assert got[0][2] == "MAX"
    out, got = report["initialized|op torch.distributed|c"]
    assert got[0][2] == "PRODUCT"
    out, got = report["ops|all_gather keywords|c"]
    assert got == [["all_gather", [0.0, 0.0], [1.0, 1.0], None, False]]
    (kind, msg), got = report["initialized|async_op truthy object|c"]
    # refused, not read by truth value (async_op="no" was truthy), and nothing was called
    assert kind == "InvalidArgumentError" and "'async_op' must be True or False" in msg, msg
    assert got == []


@pytest.mark.parametrize("key, cls, needle", [
    ("initialized|missing tensor|c", "TypeError", "tensor"),
    ("initialized|unknown keyword|c", "TypeError", "root"),
    ("initialized|given twice|c", "TypeError", "tensor"),
    ("initialized|unknown backend|c", "BackendUnavailableError", "nope"),
    ("initialized|backend unhashable|c", "BackendUnavailableError", "recorder"),
    ("initialized|op unknown name|c", "InvalidArgumentError", "median"),
    ("before init|positional|c", "BackendUnavailableError", "init"),
    ("after finalize|positional|c", "BackendUnavailableError", "init"),
    ("ops|reduce_scatter unsupported|c", "UnsupportedOperationError", "mpi"),
    ("ops|gather missing|c", "UnsupportedOperationError", "mpi"),
])
def test_front_errors(report, key, cls, needle):
    (kind, msg), _ = report[key]
    assert kind == cls and needle in msg, (key, kind, msg)


def test_front_follows_a_new_session(report):
    """Two calls per session, two sessions: each session's own backend object."""
    assert report["sessions"] == [4, 2]


def test_real_backend_through_c_front(report):
    x, out, work = report["mpi values"]
    assert x == [0.0, 1.0, 2.0, 3.0] and out == x and work == "Work"


def test_fast_functions_convert_arguments_as_python_does(report):
    """async_op a bool or 0/1 (anything else refused, its __bool__ never asked); ints,
    one-digit or not, range-checked; bools refused."""
    work, waited, zero, ambiguous, src0, boolean, neg, big, huge, wide_op = report["fast args"]
    assert (work, waited, zero, src0) == ("Work", True, ["ok", "None"], ["ok", "None"])
    assert ambiguous[0] == "InvalidArgumentError" and "'async_op' must be" in ambiguous[1]
    assert boolean[0] == "InvalidArgumentError" and "must be an int, got bool" in boolean[1]
    for got, shown in ((neg, "'src' is -1"), (big, f"'src' is {2 ** 40}")):
        assert got[0] == "InvalidArgumentError" and shown in got[1], got
    assert huge[0] == "InvalidArgumentError" and "outside the 64-bit integer range" in huge[1]
    assert wide_op == ["InvalidArgumentError", f"all_reduce: 'op' has unknown value {2 ** 32}; "
                       "expected a mcrdl.ReduceOp (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, "
                       "BXOR)"], wide_op


def test_front_objects_introspect_like_functions():
    """help(), inspect.signature and the docs see the generated function."""
    for name in ("all_reduce", "all_gather", "send", "all_to_allv"):
        f = getattr(mcrdl, name)
        assert f.__name__ == name and f.__module__ == "mcrdl.api"
        assert f.__doc__ == f.__wrapped__.__doc__ and "backend" in f.__doc__
        sig = inspect.signature(f)
        assert list(sig.parameters)[0] == "backend"
        assert list(sig.parameters)[-2:] == ["group", "async_op"]
    assert inspect.signature(mcrdl.all_reduce).parameters["op"].default is mcrdl.ReduceOp.SUM
