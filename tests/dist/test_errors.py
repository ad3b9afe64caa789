"""Bad arguments: the right error class, on every rank, with a useful message, and no hang.

Run by every rank under mpiexec (``mpiexec -n N python -m pytest tests/dist/test_errors.py``),
the same tests in the same order. Each test feeds every rank a bad argument (a rank's
argument may differ from another's, but every rank's call is bad, so every rank must
raise), records the cases that misbehave instead of stopping at the first one, then has
every rank run good collectives (:func:`_settle`) to prove that no rank is stuck and
nothing of the failed calls was half-sent, and only then fails with the list of bad cases.

Roots (dst/src) are group-local ranks. Errors that only the root can detect (its output
buffer too small, its output None) are checked at the root while the other ranks get a
locally detectable error of their own (their ``counts[rank]`` disagrees with their
tensor), so that every rank still raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mcrdl
from mcrdl.ops import OPS, Kind

BACKENDS = ("mpi", "gloo")

IAE = mcrdl.InvalidArgumentError
BUE = mcrdl.BackendUnavailableError

# dtypes outside docs/api.md's list (each named in the message as Python prints it).
BAD_DTYPES = [torch.complex64, torch.int16] + [
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)
]
INT_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
R = mcrdl.ReduceOp


# ------------------------------------------------------------------------------ helpers


class Ctx:
    """This rank's view: rank, size, and g0 = new_group([0]) (created on every rank)."""

    def __init__(self, rank: int, size: int, g0):
        self.rank, self.size, self.g0 = rank, size, g0

    @property
    def peer(self) -> int:
        """The next rank (this rank itself in a world of one)."""
        return (self.rank + 1) % self.size


@pytest.fixture(scope="module")
def ctx():
    """Initialise mcrdl (mpi + gloo) unless done already; never finalize (shared session)."""
    if not mcrdl.is_initialized() or not set(BACKENDS) <= set(mcrdl.get_backends()):
        mcrdl.init(list(BACKENDS))
    rank, size = mcrdl.get_rank("mpi"), mcrdl.get_size("mpi")
    g0 = mcrdl.new_group([0])  # collective: every rank, same order
    return Ctx(rank, size, g0)


class Expect:
    """Runs bad calls, records each one that does not raise as expected."""

    def __init__(self, ctx: Ctx, backend: str):
        self.ctx, self.backend = ctx, backend
        self.failures: list[str] = []
        self.count = 0

    def __call__(self, label: str, cls: type, fn: Callable[[], object], *needles) -> None:
        """`fn()` must raise `cls`; each needle (a str, or a tuple of alternatives) must
        occur in the message."""
        self.count += 1
        where = f"[{self.backend}] {label}"
        try:
            fn()
        except cls as exc:
            msg = str(exc)
            for n in needles:
                alts = n if isinstance(n, tuple) else (n,)
                if not any(a in msg for a in alts):
                    want = " or ".join(repr(a) for a in alts)
                    self.failures.append(f"{where}: message lacks {want}: {msg!r}")
        except mcrdl.CommTimeoutError as exc:  # a rank went on into the collective
            self.failures.append(f"{where}: expected {cls.__name__}, got a timeout: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded, reported at the end
            self.failures.append(
                f"{where}: expected {cls.__name__}, got {type(exc).__name__}: {exc}")
        else:
            self.failures.append(f"{where}: expected {cls.__name__}, nothing was raised")

    def check(self, label: str, ok: bool, detail: str = "") -> None:
        """A non-raising expectation (e.g. an accepted argument gave the right result)."""
        self.count += 1
        if not ok:
            self.failures.append(f"[{self.backend}] {label}: {detail}")

    def guard(self, label: str, fn: Callable[[], object]) -> object:
        """Run a call that must succeed; record its exception instead of raising."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"[{self.backend}] {label}: unexpected "
                                 f"{type(exc).__name__}: {exc}")
            return None

    def done(self, backends=None) -> None:
        """Prove every rank is still in lockstep, then report this rank's failures."""
        _settle(self, backends or (self.backend,))
        head = f"rank {self.ctx.rank}/{self.ctx.size}: "
        if self.failures:
            pytest.fail(head + f"{len(self.failures)} of {self.count} case(s) failed:\n"
                        + "\n".join(self.failures[:60]), pytrace=False)


def _settle(ex: Expect, backends) -> None:
    """Good collectives on every rank: all_reduce of ones == size, all_gather of ranks."""
    n, r = ex.ctx.size, ex.ctx.rank
    for b in backends:
        t = torch.ones(1)
        ex.guard(f"settle all_reduce on {b}", lambda b=b, t=t: mcrdl.all_reduce(b, t))
        ex.check(f"settle all_reduce on {b}", t.item() == n,
                 f"sum of ones is {t.item()}, expected {n}: a failed call left traffic behind")
        out = torch.full((n,), -1, dtype=torch.int64)
        ex.guard(f"settle all_gather on {b}",
                 lambda b=b, out=out: mcrdl.all_gather(b, out, torch.tensor([r])))
        ex.check(f"settle all_gather on {b}", out.tolist() == list(range(n)),
                 f"all_gather of ranks gave {out.tolist()}")


def z(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def nc(rows: int, cols: int) -> torch.Tensor:
    """A non-contiguous [rows, cols] tensor (every other column of a wider one)."""
    t = torch.zeros(rows, 2 * cols)[:, ::2]
    assert not t.is_contiguous()
    return t


def _at_root(rank: int, root: int, root_needles, other_needles):
    """The needles of this rank's message: the root's error or the others' own error."""
    return root_needles if rank == root else other_needles


# ------------------------------------------------------------------------------ dtypes


def _bad_dtype_cases(ex: Expect, b: str, ctx: Ctx, dt: torch.dtype) -> None:
    n = ctx.size
    d = str(dt)
    x = z(2, dtype=dt)
    ex(f"all_reduce {d}", IAE, lambda: mcrdl.all_reduce(b, x), "'tensor'", d)
    ex(f"all_reduce async {d}", IAE, lambda: mcrdl.all_reduce(b, x, async_op=True),
       "'tensor'", d)
    ex(f"reduce {d}", IAE, lambda: mcrdl.reduce(b, x, dst=0), "'tensor'", d)
    ex(f"bcast {d}", IAE, lambda: mcrdl.bcast(b, x, src=0), "'tensor'", d)
    ex(f"all_gather {d}", IAE, lambda: mcrdl.all_gather(b, z(2 * n, dtype=dt), x),
       "'input'", d)
    ex(f"gather {d}", IAE, lambda: mcrdl.gather(b, z(2 * n, dtype=dt), x, dst=0),
       "'input'", d)
    ex(f"scatter {d}", IAE, lambda: mcrdl.scatter(b, x, z(2 * n, dtype=dt), src=0),
       "'output'", d)
    ex(f"reduce_scatter {d}", IAE,
       lambda: mcrdl.reduce_scatter(b, x, z(2 * n, dtype=dt)), "'output'", d)
    ex(f"all_to_all_single {d}", IAE,
       lambda: mcrdl.all_to_all_single(b, z(n, dtype=dt), z(n, dtype=dt)), d)
    ex(f"all_to_all {d}", IAE,
       lambda: mcrdl.all_to_all(b, [z(1, dtype=dt)] * n, [z(1, dtype=dt)] * n), d)
    ex(f"gatherv {d}", IAE, lambda: mcrdl.gatherv(b, z(2 * n, dtype=dt), x, [2] * n),
       "'input'", d)
    ex(f"scatterv {d}", IAE, lambda: mcrdl.scatterv(b, x, z(2 * n, dtype=dt), [2] * n),
       "'output'", d)
    ex(f"all_gatherv {d}", IAE,
       lambda: mcrdl.all_gatherv(b, z(2 * n, dtype=dt), x, [2] * n), d)
    ex(f"all_to_allv {d}", IAE,
       lambda: mcrdl.all_to_allv(b, z(n, dtype=dt), z(n, dtype=dt), [1] * n, [1] * n), d)
    ex(f"send {d}", IAE, lambda: mcrdl.send(b, x, ctx.peer), "'tensor'", d)
    ex(f"recv {d}", IAE, lambda: mcrdl.recv(b, x, ctx.peer), "'tensor'", d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_dtype(ctx, backend):
    """complex64, int16 and float8 tensors: InvalidArgumentError naming the argument and
    the dtype as Python prints it (str(dtype), e.g. 'torch.complex64')."""
    ex = Expect(ctx, backend)
    for dt in BAD_DTYPES:
        _bad_dtype_cases(ex, backend, ctx, dt)
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_mismatch(ctx, backend):
    """Input and output of different dtypes: InvalidArgumentError naming both."""
    ex, b, n, r = Expect(ctx, backend), backend, ctx.size, ctx.rank
    f32, f64 = "torch.float32", "torch.float64"
    x = z(2)
    ex("all_gather tensor", IAE, lambda: mcrdl.all_gather(b, z(2 * n, dtype=torch.float64), x),
       "'output'", "'input'", f64, f32)
    ex("all_gather list", IAE,
       lambda: mcrdl.all_gather(b, [z(2)] * (n - 1) + [z(2, dtype=torch.float64)], x),
       f"'output[{n - 1}]'", f64, f32)
    ex("gather", IAE, lambda: mcrdl.gather(b, z(2 * n, dtype=torch.int32), x, dst=0),
       "'output'", "torch.int32", f32)
    ex("scatter", IAE, lambda: mcrdl.scatter(b, x, z(2 * n, dtype=torch.float64), src=0),
       "'input'", f64, f32)
    ex("reduce_scatter", IAE,
       lambda: mcrdl.reduce_scatter(b, x, [z(2, dtype=torch.float16)] * n),
       "'input[0]'", "torch.float16", f32)
    ex("all_to_all_single", IAE,
       lambda: mcrdl.all_to_all_single(b, z(n, dtype=torch.float64), z(n)), f64, f32)
    ex("all_to_all", IAE,
       lambda: mcrdl.all_to_all(b, [z(1)] * (n - 1) + [z(1, dtype=torch.int64)], [z(1)] * n),
       f"'output_list[{n - 1}]'", "torch.int64", f32)
    ex("all_gatherv", IAE,
       lambda: mcrdl.all_gatherv(b, z(2 * n, dtype=torch.float64), x, [2] * n), f64, f32)
    ex("all_to_allv", IAE,
       lambda: mcrdl.all_to_allv(b, z(n, dtype=torch.bfloat16), z(n), [1] * n, [1] * n),
       "torch.bfloat16", f32)
    # gatherv/scatterv: only the root holds the full buffer; the others get a bad count.
    good = z(2)
    other = z(3)  # counts[rank] is 2: a locally detectable error off the root
    mine = good if r == 0 else other
    ex("gatherv at dst", IAE,
       lambda: mcrdl.gatherv(b, z(2 * n, dtype=torch.float64), mine, [2] * n, dst=0),
       *_at_root(r, 0, ("'output'", f64, f32), (f"'counts'[{r}]", "3")))
    ex("scatterv at src", IAE,
       lambda: mcrdl.scatterv(b, mine, z(2 * n, dtype=torch.float64), [2] * n, src=0),
       *_at_root(r, 0, ("'input'", f64, f32), (f"'counts'[{r}]", "3")))
    ex.done()


# ------------------------------------------------------------------ layout, device, types


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_layout(ctx, backend):
    """Non-contiguous (and sparse) tensors: InvalidArgumentError naming the argument."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    cont = ("contiguous",)
    ex("all_reduce", IAE, lambda: mcrdl.all_reduce(b, nc(2, 4)), "'tensor'", cont, "[2, 4]")
    ex("reduce", IAE, lambda: mcrdl.reduce(b, nc(2, 4), dst=0), "'tensor'", cont)
    ex("bcast", IAE, lambda: mcrdl.bcast(b, nc(2, 4), src=0), "'tensor'", cont)
    ex("all_gather input", IAE, lambda: mcrdl.all_gather(b, z(8 * n), nc(2, 4)),
       "'input'", cont)
    ex("all_gather output", IAE, lambda: mcrdl.all_gather(b, nc(n, 8), z(8)),
       "'output'", cont)
    ex("all_gather output list", IAE,
       lambda: mcrdl.all_gather(b, [nc(2, 4) for _ in range(n)], z(2, 4)),
       "'output[0]'", cont)
    ex("gather output", IAE, lambda: mcrdl.gather(b, nc(n, 8), z(8), dst=0), "'output'", cont)
    ex("scatter output", IAE, lambda: mcrdl.scatter(b, nc(2, 4), z(8 * n), src=0),
       "'output'", cont)
    ex("reduce_scatter input", IAE, lambda: mcrdl.reduce_scatter(b, z(8), nc(n, 8)),
       "'input'", cont)
    ex("all_to_all_single input", IAE,
       lambda: mcrdl.all_to_all_single(b, z(2 * n, 3), nc(2 * n, 3)), "'input'", cont)
    ex("all_to_all input_list", IAE,
       lambda: mcrdl.all_to_all(b, [z(2, 4)] * n, [nc(2, 4)] * n), "'input_list[0]'", cont)
    ex("gatherv input", IAE, lambda: mcrdl.gatherv(b, z(8 * n), nc(2, 4), [8] * n),
       "'input'", cont)
    ex("scatterv output", IAE, lambda: mcrdl.scatterv(b, nc(2, 4), z(8 * n), [8] * n),
       "'output'", cont)
    ex("all_gatherv output", IAE, lambda: mcrdl.all_gatherv(b, nc(n, 8), z(8), [8] * n),
       "'output'", cont)
    ex("all_to_allv input", IAE,
       lambda: mcrdl.all_to_allv(b, z(8 * n), nc(n, 8), [8] * n, [8] * n), "'input'", cont)
    ex("send", IAE, lambda: mcrdl.send(b, nc(2, 4), ctx.peer), "'tensor'", cont)
    ex("recv", IAE, lambda: mcrdl.recv(b, nc(2, 4), ctx.peer), "'tensor'", cont)
    sparse = torch.zeros(4).to_sparse()
    ex("all_reduce sparse", IAE, lambda: mcrdl.all_reduce(b, sparse), "'tensor'",
       ("sparse", "layout", "strided", "dense"))
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_device(ctx, backend):
    """A tensor on a device the backend cannot use (meta): BackendUnavailableError naming the
    device; input and output on different devices: InvalidArgumentError."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    meta = torch.zeros(2, device="meta")
    ex("all_reduce on meta", BUE, lambda: mcrdl.all_reduce(b, meta), "meta", f"'{b}'")
    ex("bcast on meta", BUE, lambda: mcrdl.bcast(b, meta, src=0), "meta")
    ex("all_gather on meta", BUE,
       lambda: mcrdl.all_gather(b, torch.zeros(2 * n, device="meta"), meta), "meta")
    ex("all_gather mixed devices", IAE,
       lambda: mcrdl.all_gather(b, torch.zeros(2 * n, device="meta"), z(2)),
       "'output'", "'input'", "meta", "cpu")
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_tensor_arguments(ctx, backend):
    """Non-tensor / non-int / non-sequence arguments: InvalidArgumentError (never a bare
    TypeError) naming the argument and the type it got."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    x = z(2)
    ex("all_reduce list", IAE, lambda: mcrdl.all_reduce(b, [1.0, 2.0]), "'tensor'", "list")
    ex("all_reduce None", IAE, lambda: mcrdl.all_reduce(b, None), "'tensor'", "None")
    ex("all_reduce ndarray", IAE, lambda: mcrdl.all_reduce(b, np.zeros(2)), "'tensor'",
       "ndarray")
    ex("bcast float", IAE, lambda: mcrdl.bcast(b, 3.0), "'tensor'", "float")
    ex("all_gather output None", IAE, lambda: mcrdl.all_gather(b, None, x), "'output'", "None")
    ex("all_gather input list", IAE, lambda: mcrdl.all_gather(b, z(2 * n), [x]), "'input'",
       "list")
    ex("all_gather output list item", IAE,
       lambda: mcrdl.all_gather(b, [z(2)] * (n - 1) + ["x"], x), f"'output[{n - 1}]'", "str")
    ex("gather input int", IAE, lambda: mcrdl.gather(b, z(2 * n), 3, dst=0), "'input'", "int")
    ex("scatter output str", IAE, lambda: mcrdl.scatter(b, "out", z(2 * n), src=0),
       "'output'", "str")
    ex("reduce_scatter input None", IAE, lambda: mcrdl.reduce_scatter(b, x, None), "'input'",
       "None")
    ex("all_to_all output_list tensor", IAE,
       lambda: mcrdl.all_to_all(b, z(n), [z(1)] * n), "'output_list'", "Tensor")
    ex("all_to_all input_list item", IAE,
       lambda: mcrdl.all_to_all(b, [z(1)] * n, [z(1)] * (n - 1) + [5]),
       f"'input_list[{n - 1}]'", "int")
    ex("all_to_all_single split str", IAE,
       lambda: mcrdl.all_to_all_single(b, z(n), z(n), input_split_sizes="ab"),
       "'input_split_sizes'", "str")
    ex("gatherv counts None", IAE, lambda: mcrdl.gatherv(b, z(2 * n), x, None),
       "'counts'", "None")
    ex("gatherv counts float items", IAE, lambda: mcrdl.gatherv(b, z(2 * n), x, [2.0] * n),
       "counts", "[0]", "float")
    ex("all_gatherv counts int", IAE, lambda: mcrdl.all_gatherv(b, z(2 * n), x, 2),
       "'counts'", "int")
    ex("all_to_allv send_counts str", IAE,
       lambda: mcrdl.all_to_allv(b, z(n), z(n), "1" * n, [1] * n), "'send_counts'", "str")
    ex("scatterv displs float", IAE,
       lambda: mcrdl.scatterv(b, x, z(2 * n), [2] * n, displs=[0.5] * n), "displs", "float")
    ex("send tensor str", IAE, lambda: mcrdl.send(b, "t", ctx.peer), "'tensor'", "str")
    ex("reduce dst str", IAE, lambda: mcrdl.reduce(b, x, dst="0"), "'dst'", "str")
    ex("reduce dst float", IAE, lambda: mcrdl.reduce(b, x, dst=0.0), "'dst'", "float")
    ex("reduce dst bool", IAE, lambda: mcrdl.reduce(b, x, dst=False), "'dst'", "bool")
    ex("bcast src None", IAE, lambda: mcrdl.bcast(b, x, src=None), "'src'", "None")
    ex("gather dst float", IAE, lambda: mcrdl.gather(b, z(2 * n), x, dst=0.0), "'dst'",
       "float")
    ex("send tag str", IAE, lambda: mcrdl.send(b, x, ctx.peer, tag="1"), "'tag'", "str")
    ex("recv tag float", IAE, lambda: mcrdl.recv(b, x, ctx.peer, tag=1.5), "'tag'", "float")
    # ints that do not fit in 64 bits are bad values too, not a pybind11 cast failure
    ex("reduce dst 2**64", IAE, lambda: mcrdl.reduce(b, x, dst=2**64), "'dst'", f"{2**64}")
    ex("bcast src -2**70", IAE, lambda: mcrdl.bcast(b, x, src=-(2**70)), "'src'")
    ex("send tag 2**70", IAE, lambda: mcrdl.send(b, x, ctx.peer, tag=2**70), "'tag'")
    ex("all_gatherv counts 2**63", IAE,
       lambda: mcrdl.all_gatherv(b, z(2 * n), x, [2**63] * n), "counts", f"{2**63}")
    ex.done()


# ---------------------------------------------------------------- blocks of (all_)gather...


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_sizes(ctx, backend):
    """all_gather / gather output and reduce_scatter / scatter input: wrong numel (tensor
    form), wrong list length, wrong list element; None at the root."""
    ex, b, n, r = Expect(ctx, backend), backend, ctx.size, ctx.rank
    x = z(2, 3)  # 6 elements per rank
    bad_numels = (6 * n + 1, 6 * (n + 1), 6 * n - 1)
    for m in bad_numels:
        ex(f"all_gather output numel {m}", IAE, lambda m=m: mcrdl.all_gather(b, z(m), x),
           "'output'", f"{m} elements", f"{6 * n}")
        ex(f"gather output numel {m}", IAE, lambda m=m: mcrdl.gather(b, z(m), x, dst=0),
           "'output'", f"{m} elements", f"{6 * n}")
        ex(f"reduce_scatter input numel {m}", IAE,
           lambda m=m: mcrdl.reduce_scatter(b, x, z(m)), "'input'", f"{m} elements", f"{6 * n}")
        ex(f"scatter input numel {m}", IAE, lambda m=m: mcrdl.scatter(b, x, z(m), src=0),
           "'input'", f"{m} elements", f"{6 * n}")
    for k in (n - 1, n + 1):
        lst = [z(2, 3) for _ in range(k)]
        ex(f"all_gather output list of {k}", IAE, lambda lst=lst: mcrdl.all_gather(b, lst, x),
           "'output'", f"{k} tensors", f"({n})")
        ex(f"gather output list of {k}", IAE,
           lambda lst=lst: mcrdl.gather(b, lst, x, dst=0), "'output'", f"{k} tensors")
        ex(f"reduce_scatter input list of {k}", IAE,
           lambda lst=lst: mcrdl.reduce_scatter(b, x, lst), "'input'", f"{k} tensors")
        ex(f"scatter input list of {k}", IAE,
           lambda lst=lst: mcrdl.scatter(b, x, lst, src=0), "'input'", f"{k} tensors")
    wrong_item = [z(2, 3) for _ in range(n - 1)] + [z(5)]
    item = f"'output[{n - 1}]'"
    ex("all_gather list item numel", IAE, lambda: mcrdl.all_gather(b, wrong_item, x),
       item, "5 elements")
    ex("gather list item numel", IAE, lambda: mcrdl.gather(b, wrong_item, x, dst=0),
       item, "5 elements")
    ex("reduce_scatter list item numel", IAE, lambda: mcrdl.reduce_scatter(b, x, wrong_item),
       f"'input[{n - 1}]'", "5 elements")
    ex("scatter list item numel", IAE, lambda: mcrdl.scatter(b, x, wrong_item, src=0),
       f"'input[{n - 1}]'", "5 elements")
    # as many elements in another shape: refused too (it would be filled reshaped)
    turned = [z(2, 3) for _ in range(n - 1)] + [z(3, 2)]
    ex("all_gather list item shape", IAE, lambda: mcrdl.all_gather(b, turned, x),
       item, "shape [3, 2]", "[2, 3]")
    ex("scatter list item shape", IAE, lambda: mcrdl.scatter(b, x, turned, src=0),
       f"'input[{n - 1}]'", "shape [3, 2]", "[2, 3]")
    # None where the root needs a buffer; the other ranks pass a list of the wrong length.
    bad_list = [z(2, 3) for _ in range(n + 1)]
    ex("gather output None at dst", IAE,
       lambda: mcrdl.gather(b, None if r == 0 else bad_list, x, dst=0),
       *_at_root(r, 0, ("'output'", "None"), ("'output'", f"{n + 1} tensors")))
    ex("scatter input None at src", IAE,
       lambda: mcrdl.scatter(b, x, None if r == 0 else bad_list, src=0),
       *_at_root(r, 0, ("'input'", "None"), ("'input'", f"{n + 1} tensors")))
    ex("all_to_all list lengths", IAE,
       lambda: mcrdl.all_to_all(b, [z(1)] * n, [z(1)] * (n + 1)),
       "'input_list'", f"{n + 1}")
    ex("all_to_all output_list length", IAE,
       lambda: mcrdl.all_to_all(b, [z(1)] * (n + 1), [z(1)] * n), "'output_list'", f"{n + 1}")
    ex.done()


# ---------------------------------------------------------------------- v variants


@pytest.mark.parametrize("backend", BACKENDS)
def test_counts_and_displs(ctx, backend):
    """gatherv / scatterv / all_gatherv / all_to_allv: counts or displs of the wrong length,
    negative, a block past the end of the buffer, overlapping receive blocks,
    counts[rank] != this rank's numel."""
    ex, b, n, r = Expect(ctx, backend), backend, ctx.size, ctx.rank
    x = z(3)
    cnt = [3] * n
    packed = [3 * i for i in range(n)]
    neg_c = cnt[:-1] + [-1]
    neg_d = [-1] + packed[1:]
    # all_gatherv: every rank receives, so every check is local on every rank.
    ag = lambda out, counts, displs=None: lambda: mcrdl.all_gatherv(b, out, x, counts, displs)  # noqa: E731
    ex("all_gatherv counts too long", IAE, ag(z(3 * n), cnt + [3]), "'counts'",
       f"{n + 1} entries")
    ex("all_gatherv counts too short", IAE, ag(z(3 * n), cnt[:-1]), "'counts'",
       f"{n - 1} entries")
    ex("all_gatherv negative count", IAE, ag(z(3 * n), neg_c), f"'counts'[{n - 1}]", "-1")
    ex("all_gatherv displs length", IAE, ag(z(3 * n), cnt, packed + [0]), "'displs'",
       f"{n + 1} entries")
    ex("all_gatherv negative displ", IAE, ag(z(3 * n), cnt, neg_d), "'displs'[0]", "-1")
    ex("all_gatherv packed past end", IAE, ag(z(3 * n - 1), cnt), "'output'", "past",
       f"{3 * n - 1} elements")
    shifted = packed[:-1] + [packed[-1] + 1]
    ex("all_gatherv displs past end", IAE, ag(z(3 * n), cnt, shifted), "'output'", "past",
       f"displacement {shifted[-1]}")
    ex("all_gatherv counts[rank] != numel", IAE, ag(z(4 * n), [4] * n),
       f"'counts'[{r}]", "4", "3 elements")
    if n >= 2:
        ovl = [0, 2] + [3 * i + 2 for i in range(2, n)]
        ex("all_gatherv overlapping blocks", IAE, ag(z(3 * n + 2), cnt, ovl), "overlap",
           "'output'", "0 and 1")
    # A displacement so large that displacement + count overflows int64 is past the end
    # too. The output is a view into a larger tensor, so that an implementation that lets
    # it through and wraps the address around writes into memory the test owns.
    big = 2**63 - 1
    host = z(3 * n + 16)
    ex("all_gatherv displ overflowing int64", IAE,
       ag(host[8:8 + 3 * n], cnt, packed[:-1] + [big]), "'output'", ("past", "overflow"),
       f"{big}")
    # all_to_allv: send side checked against input, receive side against output.
    a2a = lambda out, inp, sc, rc, sd=None, rd=None: lambda: mcrdl.all_to_allv(  # noqa: E731
        b, out, inp, sc, rc, sd, rd)
    c2, p2 = [2] * n, [2 * i for i in range(n)]
    ex("all_to_allv send_counts length", IAE, a2a(z(2 * n), z(2 * n), c2 + [2], c2),
       "'send_counts'", f"{n + 1} entries")
    ex("all_to_allv recv_counts length", IAE, a2a(z(2 * n), z(2 * n), c2, c2[:-1]),
       "'recv_counts'", f"{n - 1} entries")
    ex("all_to_allv negative send count", IAE, a2a(z(2 * n), z(2 * n), [-2] * n, c2),
       "'send_counts'[0]", "-2")
    ex("all_to_allv negative recv displ", IAE,
       a2a(z(2 * n), z(2 * n), c2, c2, None, [-1] + p2[1:]), "'recv_displs'[0]", "-1")
    ex("all_to_allv send_displs length", IAE,
       a2a(z(2 * n), z(2 * n), c2, c2, p2[:-1], None), "'send_displs'", f"{n - 1} entries")
    ex("all_to_allv send past end", IAE, a2a(z(2 * n), z(2 * n - 1), c2, c2), "'input'",
       "past", f"{2 * n - 1} elements")
    ex("all_to_allv recv past end", IAE, a2a(z(2 * n - 1), z(2 * n), c2, c2), "'output'",
       "past", f"{2 * n - 1} elements")
    host = z(2 * n + 16)
    ex("all_to_allv recv displ overflowing int64", IAE,
       a2a(host[8:8 + 2 * n], z(2 * n), c2, c2, None, p2[:-1] + [big]), "'output'",
       ("past", "overflow"), f"{big}")
    if n >= 2:
        ex("all_to_allv overlapping recv blocks", IAE,
           a2a(z(2 * n), z(2 * n), c2, c2, None, [0, 1] + p2[2:]), "overlap", "'output'")
    # gatherv: the counts checks run on every rank; the buffer checks only at dst, where
    # the others get counts[rank] != their input's numel instead.
    gv = lambda out, inp, counts, displs=None: lambda: mcrdl.gatherv(  # noqa: E731
        b, out, inp, counts, displs, dst=0)
    ex("gatherv counts length", IAE, gv(z(3 * n), x, cnt + [3]), "'counts'", f"{n + 1} entries")
    ex("gatherv negative count", IAE, gv(z(3 * n), x, neg_c), f"'counts'[{n - 1}]", "-1")
    ex("gatherv negative displ", IAE, gv(z(3 * n), x, cnt, neg_d), "'displs'[0]", "-1")
    ex("gatherv displs length", IAE, gv(z(3 * n), x, cnt, packed[:-1]), "'displs'",
       f"{n - 1} entries")
    ex("gatherv counts[rank] != numel", IAE, gv(z(4 * n), x, [4] * n), f"'counts'[{r}]",
       "4", "3 elements")
    mine = x if r == 0 else z(4)
    off_root = (f"'counts'[{r}]", "4 elements")
    ex("gatherv output too small at dst", IAE, gv(z(3 * n - 1), mine, cnt),
       *_at_root(r, 0, ("'output'", "past", f"{3 * n - 1} elements"), off_root))
    ex("gatherv output None at dst", IAE, gv(None, mine, cnt),
       *_at_root(r, 0, ("'output'", "None"), off_root))
    if n >= 2:
        ovl = [0, 2] + [3 * i + 2 for i in range(2, n)]
        ex("gatherv overlapping blocks at dst", IAE, gv(z(3 * n + 2), mine, cnt, ovl),
           *_at_root(r, 0, ("overlap", "'output'"), off_root))
    # scatterv: the same with the input at src.
    sv = lambda out, inp, counts, displs=None: lambda: mcrdl.scatterv(  # noqa: E731
        b, out, inp, counts, displs, src=0)
    ex("scatterv counts length", IAE, sv(x, z(3 * n), cnt[:-1]), "'counts'", f"{n - 1} entries")
    ex("scatterv negative count", IAE, sv(x, z(3 * n), neg_c), f"'counts'[{n - 1}]", "-1")
    ex("scatterv negative displ", IAE, sv(x, z(3 * n), cnt, neg_d), "'displs'[0]", "-1")
    ex("scatterv counts[rank] != numel", IAE, sv(x, z(4 * n), [4] * n), f"'counts'[{r}]",
       "4", "3 elements")
    ex("scatterv input too small at src", IAE, sv(mine, z(3 * n - 1), cnt),
       *_at_root(r, 0, ("'input'", "past", f"{3 * n - 1} elements"), off_root))
    ex("scatterv input None at src", IAE, sv(mine, None, cnt),
       *_at_root(r, 0, ("'input'", "None"), off_root))
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_to_all_single_splits(ctx, backend):
    """all_to_all_single: split sizes of the wrong length, negative, not summing to dim 0;
    dim 0 not divisible by the group size without splits; rows of different sizes."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    out, inp = z(2 * n, 3), z(2 * n, 3)
    off = [2] * (n - 1) + [3]
    a2a = lambda o, i, os_=None, is_=None: lambda: mcrdl.all_to_all_single(  # noqa: E731
        b, o, i, output_split_sizes=os_, input_split_sizes=is_)
    ex("input splits sum", IAE, a2a(out, inp, None, off), "'input_split_sizes'",
       f"sums to {2 * n + 1}", f"{2 * n} rows")
    ex("output splits sum", IAE, a2a(out, inp, off, None), "'output_split_sizes'",
       f"sums to {2 * n + 1}", f"{2 * n} rows")
    ex("input splits length", IAE, a2a(out, inp, None, [2 * n] + [0] * n),
       "'input_split_sizes'", f"{n + 1} entries")
    ex("output splits length", IAE, a2a(out, inp, [2] * (n - 1), None),
       "'output_split_sizes'", f"{n - 1} entries")
    neg = [2 * n + 1] + [0] * (n - 2) + [-1] if n >= 2 else [-1]
    ex("negative input split", IAE, a2a(out, inp, None, neg), "'input_split_sizes'", "-1")
    ex("rows differ", IAE, a2a(z(2 * n, 4), inp), "'input'", "'output'", f"[{2 * n}, 3]",
       f"[{2 * n}, 4]")
    ex("zero-dim tensors", IAE, a2a(z(()), z(())), "'input'", "dimension")
    if n >= 2:
        ex("input dim 0 not divisible", IAE, a2a(out, z(2 * n + 1, 3)), "'input'",
           f"{2 * n + 1} rows", "divisible", f"{n}")
        ex("output dim 0 not divisible", IAE, a2a(z(2 * n - 1, 3), inp), "'output'",
           f"{2 * n - 1} rows", "divisible")
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_to_all_own_block(ctx, backend):
    """The block a rank sends itself must be the size it expects from itself (the one size
    mismatch of an all-to-all a rank sees alone): before, mpi dropped rows or left the
    output's tail unwritten without a word, gloo raised its own enforce text."""
    ex, b, n, r = Expect(ctx, backend), backend, ctx.size, ctx.rank
    me = f"this rank ({r}) sends itself"
    ex("all_to_all_single without splits", IAE,
       lambda: mcrdl.all_to_all_single(b, z(n), z(2 * n)), me, "2 rows", "expects 1",
       f"'input_split_sizes'[{r}]", f"'output_split_sizes'[{r}]")
    splits = [1] * n
    splits[r] = 2
    ex("all_to_all_single splits", IAE,
       lambda: mcrdl.all_to_all_single(b, z(n), z(n + 1), input_split_sizes=splits), me,
       "2 rows", "expects 1")
    outs = [z(1) for _ in range(n)]
    outs[r] = z(3)
    ex("all_to_all lists", IAE, lambda: mcrdl.all_to_all(b, outs, [z(1)] * n), me,
       "1 elements", "expects 3", f"'input_list'[{r}]", f"'output_list'[{r}]")
    recv = [1] * n
    recv[r] = 0
    ex("all_to_allv counts", IAE,
       lambda: mcrdl.all_to_allv(b, z(n), z(n), [1] * n, recv), me,
       f"'send_counts'[{r}]", f"'recv_counts'[{r}]")
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_op_must_be_a_bool(ctx, backend):
    """async_op="no" was truthy (mpi returned a Work) or a raw TypeError (gloo): now an
    InvalidArgumentError; 0/1 and numpy bools are taken for what they say."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    for bad in ("no", None, 2, 1.0):
        ex(f"async_op={bad!r}", IAE, lambda bad=bad: mcrdl.all_reduce(b, z(1), async_op=bad),
           "'async_op' must be True or False", repr(bad))
    t = torch.ones(1)
    ex.check("async_op=0", ex.guard("async_op=0", lambda: mcrdl.all_reduce(b, t, async_op=0))
             is None and t.item() == n, f"gave {t.item()}")
    t = torch.ones(1)
    w = ex.guard("async_op=np.True_", lambda: mcrdl.all_reduce(b, t, async_op=np.True_))
    ex.check("async_op=np.True_", w is not None and w.wait() and t.item() == n,
             f"work {w!r}, gave {t.item()}")
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_timeout_must_be_seconds(ctx, backend):
    """Work.wait(timeout="1") was a raw TypeError (C++ Works) or 1 s (Python ones): every
    Work kind now takes None or seconds >= 0 (numpy scalars too) and names the rest."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    for kind, make in (("plain", lambda: torch.ones(4)),  # the backend's own Work
                       ("chained", lambda: torch.ones(4, dtype=torch.float16))):
        t = make()
        w = ex.guard(f"{kind} post", lambda t=t: mcrdl.all_reduce(b, t, async_op=True))
        if w is None:
            continue
        for bad in ("1", True, -1, float("nan"), [1]):
            ex(f"{kind} wait(timeout={bad!r})", IAE, lambda bad=bad, w=w: w.wait(timeout=bad),
               "'timeout' is", repr(bad))
        ok = ex.guard(f"{kind} wait(np.float64)", lambda w=w: w.wait(timeout=np.float64(60)))
        ex.check(f"{kind} result", ok and torch.equal(t, make() * n), f"gave {t}")
    ex.done()


# ------------------------------------------------------------------- roots and p2p


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_roots(ctx, backend):
    """dst/src of -1 and size (group-local ranks): InvalidArgumentError naming the argument,
    the value and the valid range."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    x = z(2)
    rng = f"[0, {n - 1}]"
    for bad in (-1, n, n + 7):
        v = f" is {bad}"
        ex(f"reduce dst={bad}", IAE, lambda bad=bad: mcrdl.reduce(b, x, dst=bad), "'dst'" + v, rng)
        ex(f"reduce async dst={bad}", IAE,
           lambda bad=bad: mcrdl.reduce(b, x, dst=bad, async_op=True), "'dst'" + v, rng)
        ex(f"bcast src={bad}", IAE, lambda bad=bad: mcrdl.bcast(b, x, src=bad), "'src'" + v, rng)
        ex(f"gather dst={bad}", IAE, lambda bad=bad: mcrdl.gather(b, z(2 * n), x, dst=bad),
           "'dst'" + v, rng)
        ex(f"scatter src={bad}", IAE, lambda bad=bad: mcrdl.scatter(b, x, z(2 * n), src=bad),
           "'src'" + v, rng)
        ex(f"gatherv dst={bad}", IAE,
           lambda bad=bad: mcrdl.gatherv(b, z(2 * n), x, [2] * n, dst=bad), "'dst'" + v, rng)
        ex(f"scatterv src={bad}", IAE,
           lambda bad=bad: mcrdl.scatterv(b, x, z(2 * n), [2] * n, src=bad), "'src'" + v, rng)
        ex(f"send dst={bad}", IAE, lambda bad=bad: mcrdl.send(b, x, bad), "'dst'" + v, rng)
        ex(f"recv src={bad}", IAE, lambda bad=bad: mcrdl.recv(b, x, bad), "'src'" + v, rng)
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_p2p_self_and_tags(ctx, backend):
    """send/recv to self and tags outside [0, 32767]: InvalidArgumentError; then a ring of
    good messages with the tag the bad sends used proves none of them was sent."""
    ex, b, n, r = Expect(ctx, backend), backend, ctx.size, ctx.rank
    x = z(2)
    ex("send to self", IAE, lambda: mcrdl.send(b, x, r), "'dst'", f"rank {r}")
    ex("recv from self", IAE, lambda: mcrdl.recv(b, x, r), "'src'", f"rank {r}")
    ex("send to self async", IAE, lambda: mcrdl.send(b, x, r, async_op=True), "'dst'")
    ex("send to self in g0", IAE, lambda: mcrdl.send(b, x, 0, group=ctx.g0) if r == 0
       else mcrdl.send(b, x, r, tag=3), "'dst'", f"rank {0 if r == 0 else r}")
    if n >= 2:
        prev = (r - 1) % n
        for tag in (-1, 32768, 2**40):
            ex(f"send tag={tag}", IAE, lambda tag=tag: mcrdl.send(b, x, ctx.peer, tag=tag),
               "'tag'", f"{tag}", "32767", "fold larger tags")
            ex(f"recv tag={tag}", IAE, lambda tag=tag: mcrdl.recv(b, x, prev, tag=tag),
               "'tag'", f"{tag}", "32767", "fold larger tags")
        # Bad sends on tag 5 toward the ring peer: if any went out, the ring's recv gets it.
        ex("send bad dtype tag 5", IAE,
           lambda: mcrdl.send(b, torch.full((2,), 9, dtype=torch.int16), ctx.peer, tag=5),
           "'tensor'")
        ex("send non-contiguous tag 5", IAE,
           lambda: mcrdl.send(b, torch.full((4, 2), 9.0).t(), ctx.peer, tag=5), "'tensor'")
        ex("send dst=-1 tag 5", IAE,
           lambda: mcrdl.send(b, torch.full((2,), 9.0), -1, tag=5), "'dst'")
        got = torch.full((2,), -1.0)

        def ring():
            w = mcrdl.send(b, torch.full((2,), float(r)), ctx.peer, tag=5, async_op=True)
            mcrdl.recv(b, got, prev, tag=5)
            w.wait()

        ex.guard("ring send/recv", ring)
        ex.check("ring send/recv", got.tolist() == [float(prev)] * 2,
                 f"received {got.tolist()} from rank {prev}, expected {[float(prev)] * 2}")
    ex.done()


# ------------------------------------------------------------------------ groups


# The smallest arguments of each kind of parameter (one-rank shapes: these calls are
# refused for their group before the shapes matter); optional parameters keep defaults.
_SMALL = {Kind.TENSOR: lambda: z(2), Kind.BLOCKS: lambda: z(2), Kind.OPT_BLOCKS: lambda: z(2),
          Kind.OPT_TENSOR: lambda: z(2), Kind.TENSOR_LIST: lambda: [z(2)],
          Kind.COUNTS: lambda: [2], Kind.ROOT: lambda: 0}


def _on_group(name: str, async_op: bool = False) -> Callable:
    spec = OPS[name]
    small = {p.name: _SMALL[p.kind] for p in spec.params if p.kind in _SMALL}
    return lambda b, g: getattr(mcrdl, name)(b, **{k: f() for k, f in small.items()},
                                             group=g, async_op=async_op)


#: Every operation, called with `group`: name -> fn(backend, group).
OPS_ON_GROUP = {name: _on_group(name) for name in OPS}
OPS_ON_GROUP["all_reduce async"] = _on_group("all_reduce", async_op=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_member_group(ctx, backend):
    """g0 = new_group([0]): ranks != 0 get InvalidArgumentError for every operation on it;
    rank 0 uses it (group-local ranks: dst=1 is out of range in g0 whatever the world)."""
    if ctx.size < 2:
        pytest.skip("needs a rank outside new_group([0])")
    ex, b, r = Expect(ctx, backend), backend, ctx.rank
    if r != 0:
        for name, fn in OPS_ON_GROUP.items():
            ex(f"{name} on non-member group", IAE, lambda fn=fn: fn(b, ctx.g0), "group", "[0]",
               ("not a member", "does not contain"))
        ex.check("get_rank on non-member group", mcrdl.get_rank(b, group=ctx.g0) == -1,
                 f"get_rank = {mcrdl.get_rank(b, group=ctx.g0)}, expected -1")
    else:
        t = torch.full((2,), 7.0)
        ex.guard("all_reduce on g0 at its member", lambda: mcrdl.all_reduce(b, t, group=ctx.g0))
        ex.check("all_reduce on g0 at its member", t.tolist() == [7.0, 7.0], str(t.tolist()))
        ex("reduce dst=1 in g0", IAE, lambda: mcrdl.reduce(b, z(2), dst=1, group=ctx.g0),
           "'dst' is 1", "[0, 0]")
        ex("bcast src=1 in g0", IAE, lambda: mcrdl.bcast(b, z(2), src=1, group=ctx.g0),
           "'src' is 1", "[0, 0]")
        ex("all_gather world-sized output in g0", IAE,
           lambda: mcrdl.all_gather(b, z(2 * ctx.size), z(2), group=ctx.g0), "'output'",
           f"{2 * ctx.size} elements")
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_not_a_group(ctx, backend):
    """A group argument that is not a mcrdl Group: InvalidArgumentError naming 'group' and
    the type it got."""
    ex, b = Expect(ctx, backend), backend
    for bad in ("world", 0, [0], (0,), object()):
        tname = type(bad).__name__
        for name in ("all_reduce", "bcast", "all_gather", "gatherv", "all_to_all", "send",
                     "barrier"):
            ex(f"{name} group={bad!r}", IAE, lambda bad=bad, name=name:
               OPS_ON_GROUP[name](b, bad), "'group'", tname)
        ex(f"get_rank group={bad!r}", IAE, lambda bad=bad: mcrdl.get_rank(b, group=bad),
           "'group'", tname)
        ex(f"get_size group={bad!r}", IAE, lambda bad=bad: mcrdl.get_size(b, group=bad),
           "'group'", tname)
    ex.done()


def test_new_group_bad_ranks(ctx):
    """new_group with bad ranks fails locally on every rank, before any collective."""
    ex, n = Expect(ctx, "-"), ctx.size
    for bad, needles in (([], ("'ranks'", "empty")), ([0, 0], ("'ranks'", "[0, 0]")),
                         ([n], ("'ranks'[0]", f"{n}")), ([-1], ("'ranks'[0]", "-1")),
                         (["a"], ("'ranks'[0]", "'a'")), ([0.0], ("'ranks'[0]", "0.0")),
                         (3, ("'ranks'", "int")), ("01", ("'ranks'", "str"))):
        ex(f"new_group({bad!r})", IAE, lambda bad=bad: mcrdl.new_group(bad), *needles)
    ex.done(BACKENDS)


# --------------------------------------------------------------------- backend names


def test_unknown_backend(ctx):
    """Unknown / unusable / non-str backend: BackendUnavailableError naming it and listing
    the usable backends; also in init, which then changes nothing."""
    ex = Expect(ctx, "-")
    x = z(1)
    # a known backend that cannot run here: nccl without a usable GPU, else rccl
    unusable = next(n for n in ("nccl", "rccl") if n not in mcrdl.available_backends())
    for bad, shown in (("nosuch", "'nosuch'"), ("", "''"), ("MPI", "'MPI'"),
                       (unusable, repr(unusable)),
                       (None, "None"), (3, "3"), (["mpi"], "['mpi']")):
        lists = ("mpi", "gloo")
        ex(f"all_reduce backend={bad!r}", BUE, lambda bad=bad: mcrdl.all_reduce(bad, x),
           shown, *lists)
        ex(f"all_reduce async backend={bad!r}", BUE,
           lambda bad=bad: mcrdl.all_reduce(bad, x, async_op=True), shown, *lists)
        ex(f"barrier backend={bad!r}", BUE, lambda bad=bad: mcrdl.barrier(bad), shown, *lists)
        ex(f"send backend={bad!r}", BUE, lambda bad=bad: mcrdl.send(bad, x, 0), shown, *lists)
        ex(f"get_rank backend={bad!r}", BUE, lambda bad=bad: mcrdl.get_rank(bad), shown)
        ex(f"get_size backend={bad!r}", BUE, lambda bad=bad: mcrdl.get_size(bad), shown)
        if isinstance(bad, (str, int)):  # None: all backends; a list: those named
            ex(f"synchronize backends={bad!r}", BUE, lambda bad=bad: mcrdl.synchronize(bad),
               shown)
    ex(f"{unusable} says why", BUE, lambda: mcrdl.all_reduce(unusable, x), unusable,
       "unavailable")
    for bad, shown in (("nosuch", "'nosuch'"), (["mpi", "nosuch"], "'nosuch'"), ([None], "None"),
                       (3, "3"), (unusable, repr(unusable))):
        ex(f"init({bad!r})", BUE, lambda bad=bad: mcrdl.init(bad), shown, "mpi", "gloo")
    ex.check("backends unchanged after failed init", set(BACKENDS) <= set(mcrdl.get_backends()),
             f"get_backends() = {mcrdl.get_backends()}")
    ex.done(BACKENDS)


def test_init_bad_timeout(ctx):
    """init(timeout <= 0 or not a number): InvalidArgumentError naming 'timeout' and the value,
    raised before any collective (every rank, nothing changes)."""
    ex = Expect(ctx, "-")
    for bad in (0, 0.0, -1, -0.5, float("-inf"), float("nan"), "5"):
        ex(f"init(timeout={bad!r})", IAE,
           lambda bad=bad: mcrdl.init(list(BACKENDS), timeout=bad), "'timeout'", repr(bad))
    ex.done(BACKENDS)


# ------------------------------------------------------------------------ reduce ops


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_op_dtype_mismatch(ctx, backend):
    """AVG on integer/bool tensors and BAND/BOR/BXOR on floating tensors (mcrdl and
    torch.distributed spellings): InvalidArgumentError naming the op and the dtype."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    cases = [(R.AVG, "AVG", dt) for dt in INT_DTYPES] + [
        (op, op.name, dt) for op in (R.BAND, R.BOR, R.BXOR) for dt in FLOAT_DTYPES]
    cases += [(dist.ReduceOp.AVG, "AVG", torch.int32), (dist.ReduceOp.BXOR, "BXOR", torch.float32)]
    for op, name, dt in cases:
        d = str(dt)
        ex(f"all_reduce {name} {d}", IAE, lambda op=op, dt=dt: mcrdl.all_reduce(
            b, z(2, dtype=dt), op=op), name, d)
        ex(f"reduce {name} {d}", IAE, lambda op=op, dt=dt: mcrdl.reduce(
            b, z(2, dtype=dt), dst=0, op=op), name, d)
        ex(f"reduce_scatter {name} {d}", IAE, lambda op=op, dt=dt: mcrdl.reduce_scatter(
            b, z(2, dtype=dt), z(2 * n, dtype=dt), op=op), name, d)
    ex("all_reduce async AVG int64", IAE,
       lambda: mcrdl.all_reduce(b, z(2, dtype=torch.int64), op=R.AVG, async_op=True), "AVG",
       "torch.int64")
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_reduce_op(ctx, backend):
    """An op that is no reduce operation: InvalidArgumentError naming 'op' and the value."""
    ex, b, n = Expect(ctx, backend), backend, ctx.size
    bad_ops = [(99, "99"), (-1, "-1"), ("nosuch", "'nosuch'"), (None, "None"), (2.5, "2.5"),
               (dist.ReduceOp.PREMUL_SUM, "PREMUL_SUM")]
    for op, shown in bad_ops:
        ex(f"all_reduce op={op!r}", IAE, lambda op=op: mcrdl.all_reduce(b, z(2), op=op),
           "'op'", shown)
        ex(f"reduce op={op!r}", IAE, lambda op=op: mcrdl.reduce(b, z(2), dst=0, op=op),
           "'op'", shown)
        ex(f"reduce_scatter op={op!r}", IAE,
           lambda op=op: mcrdl.reduce_scatter(b, z(2), z(2 * n), op=op), "'op'", shown)
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_op_bool_and_int(ctx, backend):
    """mcrdl.ReduceOp is an IntEnum: a plain int must mean the mcrdl member of that value
    (or be rejected), never the torch.distributed RedOpType of that number; a bool is not
    a reduce op."""
    ex, b, n, r = Expect(ctx, backend), backend, ctx.size, ctx.rank
    vals = [float(i + 2) for i in range(n)]
    expect = {R.MAX: max(vals), R.MIN: min(vals), R.PRODUCT: math.prod(vals), R.SUM: sum(vals)}
    for op in (R.MAX, R.PRODUCT, R.MIN):
        t = torch.tensor([float(r + 2)])
        try:
            mcrdl.all_reduce(b, t, op=int(op))
        except IAE:
            ex.check(f"op={int(op)} rejected", True)
            continue
        except Exception as exc:  # noqa: BLE001
            ex.check(f"op={int(op)}", False, f"{type(exc).__name__}: {exc}")
            continue
        ex.check(f"all_reduce op={int(op)} (int of ReduceOp.{op.name})", t.item() == expect[op],
                 f"gave {t.item()}, ReduceOp.{op.name} gives {expect[op]}")
    for op in (True, False):
        ex(f"all_reduce op={op!r}", IAE, lambda op=op: mcrdl.all_reduce(b, z(2), op=op),
           "'op'", repr(op))
    ex.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_reduce_op_accepted(ctx, backend):
    """torch.distributed.ReduceOp values (and mcrdl's PROD alias) are accepted and reduce
    like the mcrdl op of the same name."""
    ex, b, n, r = Expect(ctx, backend), backend, ctx.size, ctx.rank
    vals = [float(i + 2) for i in range(n)]
    ref = {"SUM": sum(vals), "PRODUCT": math.prod(vals), "MIN": min(vals), "MAX": max(vals),
           "AVG": sum(vals) / n}
    ops = [(dist.ReduceOp.MAX, "MAX"), (dist.ReduceOp.MIN, "MIN"), (dist.ReduceOp.SUM, "SUM"),
           (dist.ReduceOp.PRODUCT, "PRODUCT"), (dist.ReduceOp.AVG, "AVG"),
           (dist.ReduceOp(dist.ReduceOp.MAX), "MAX"), (R.PROD, "PRODUCT")]
    for op, name in ops:
        label = f"{op!r}"[:40]
        t = torch.tensor([float(r + 2)])
        ex.guard(f"all_reduce {label}", lambda op=op, t=t: mcrdl.all_reduce(b, t, op=op))
        ex.check(f"all_reduce {label}", t.item() == ref[name], f"gave {t.item()}, "
                 f"expected {name} = {ref[name]}")
        t = torch.tensor([float(r + 2)])
        ex.guard(f"reduce {label}", lambda op=op, t=t: mcrdl.reduce(b, t, dst=0, op=op))
        want = ref[name] if r == 0 else float(r + 2)
        ex.check(f"reduce {label}", t.item() == want, f"gave {t.item()}, expected {want}")
        out = torch.zeros(1)
        ex.guard(f"reduce_scatter {label}", lambda op=op, out=out: mcrdl.reduce_scatter(
            b, out, torch.full((n,), float(r + 2)), op=op))
        ex.check(f"reduce_scatter {label}", out.item() == ref[name],
                 f"gave {out.item()}, expected {ref[name]}")
    t = torch.tensor([r + 1], dtype=torch.int32)
    ex.guard("all_reduce torch BOR int32",
             lambda: mcrdl.all_reduce(b, t, op=dist.ReduceOp.BOR))
    want = 0
    for i in range(n):
        want |= i + 1
    ex.check("all_reduce torch BOR int32", t.item() == want, f"gave {t.item()}, expected {want}")
    ex.done()
