"""Multi-rank conformance of every operation of docs/api.md against a numpy reference.

Run by every rank under mpiexec (see tests/test_dist_launch.py). Each test loops over
dtypes x sizes (x reduce ops), cycling the group (world, strict subset, permuted),
async_op and the tensor/list form from case to case, so every combination of two of
them is exercised in few calls. A failing case is recorded and the loop goes on, so
that every rank keeps issuing the same collectives in the same order; the test fails
at the end with the list of failing cases of this rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import pytest
import torch
from _ref import (
    DTYPES,
    HALF_BIG,
    SHAPES,
    as_ref,
    assert_bits,
    check_reduced,
    data,
    elems,
    half_sum_inputs,
    layout,
    numel,
    ops_for,
    reduce_ref,
    values,
)

import mcrdl

BACKENDS = ("mpi", "gloo")
WITH_AUTO = ("mpi", "gloo", "auto")
V_MODES = ("none", "packed", "gapped")
V_COUNTS = (0, 1, 7, 3, 250)
A2AV_COUNTS = (0, 1, 7, 3, 40)


# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass
class Case:
    """One call of a test loop."""

    i: int
    dtype: str
    shape: tuple
    gname: str
    async_op: bool
    form: str
    op: str | None = None


def cases(world, *, dtypes=DTYPES, shapes=SHAPES, with_ops=False, nshapes=None, min_group=1):
    """Cases over dtypes (x ops) x shapes; group, async_op and form cycle with the index.

    Over 12 consecutive indices every (group, async_op, form) triple occurs once.
    With ``nshapes``, each (dtype, op) pair takes that many shapes, rotating.
    """
    gnames = [n for n in world.gnames if len(world.members(n)) >= min_group]
    i = 0
    for p, (dtype, op) in enumerate(
        (d, o) for d in dtypes for o in (ops_for(d) if with_ops else (None,))
    ):
        chosen = shapes if nshapes is None else [
            shapes[(2 * p + j) % len(shapes)] for j in range(nshapes)
        ]
        for shape in chosen:
            yield Case(
                i, dtype, tuple(shape), gnames[i % len(gnames)], (i // 3) % 2 == 1,
                ("tensor", "list")[(i // 2) % 2], op,
            )
            i += 1


class Checker:
    """Collects failing cases so every rank keeps issuing the same calls."""

    def __init__(self, world, name: str, backend: str):
        self.world, self.name, self.backend = world, name, backend
        self.failures: list[str] = []
        self.checked = 0

    def desc(self, c: Case, **extra) -> str:
        members = self.world.members(c.gname)
        more = "".join(f" {k}={v}" for k, v in extra.items())
        return (f"{self.name}[{self.backend}] dtype={c.dtype} shape={c.shape} op={c.op} "
                f"group={c.gname}{list(members)} async={c.async_op} form={c.form}{more}")

    @contextlib.contextmanager
    def case(self, what: str):
        try:
            yield
        except mcrdl.CommTimeoutError:
            raise
        except (Exception, pytest.fail.Exception) as exc:  # recorded, reported at the end
            msg = " | ".join(str(exc).strip().splitlines()[:8])
            self.failures.append(f"{what}: {type(exc).__name__}: {msg}")
        else:
            self.checked += 1

    def done(self, min_checked: int = 1) -> None:
        head = f"rank {self.world.rank}/{self.world.size}: "
        if self.failures:
            pytest.fail(head + f"{len(self.failures)} failing case(s):\n"
                        + "\n".join(self.failures[:40]), pytrace=False)
        assert self.checked >= min_checked, head + f"only {self.checked} case(s) checked"


def rop(name: str):
    """mcrdl.ReduceOp member by name."""
    return getattr(mcrdl.ReduceOp, name)


def invoke(fn, backend: str, *args, async_op: bool, **kwargs):
    """Call an operation; in async mode wait on the Work and check its contract."""
    if not async_op:
        res = fn(backend, *args, **kwargs)
        assert res is None, f"synchronous call returned {res!r}"
        return None
    work = fn(backend, *args, async_op=True, **kwargs)
    assert work is not None, "async_op=True returned None"
    work.wait()
    assert work.is_completed() is True, "is_completed() is not True after wait()"
    if backend == "auto":
        assert work.backend != "auto" and work.backend in mcrdl.get_backends(), work.backend
    else:
        assert work.backend == backend, f"work.backend={work.backend!r}"
    return work


def cat_shape(shape, n: int) -> tuple:
    """Shape of n blocks of `shape` concatenated along dim 0."""
    return (n * shape[0],) + tuple(shape[1:])


def sentinel(dtype: str, shape, *key) -> torch.Tensor:
    """Random-bit output buffer, so elements an op fails to write are detected."""
    return data(dtype, shape, -1, "sentinel", *key)


def role(world, c: Case):
    """(members, group-local rank, group size), or None when this rank is not a member."""
    members = world.members(c.gname)
    if world.rank not in members:
        return None
    return members, members.index(world.rank), len(members)


# --------------------------------------------------------------------------- queries


def test_queries(world):
    """Lifecycle queries, ranks and sizes per backend, and the Group objects."""
    assert mcrdl.is_initialized() is True
    assert {"mpi", "gloo"} <= set(mcrdl.get_backends())
    assert {"mpi", "gloo"} <= set(mcrdl.available_backends())
    for backend in WITH_AUTO:
        assert mcrdl.get_rank(backend) == world.rank
        assert mcrdl.get_size(backend) == world.size
        assert mcrdl.get_world_size(backend) == world.size
    ranks = np.zeros(world.size, dtype=np.int64)
    world.comm.Allgather(np.array([world.rank], dtype=np.int64), ranks)
    assert ranks.tolist() == list(range(world.size)), "mcrdl rank != MPI rank"
    for name in world.gnames[1:]:
        g, members = world.group(name), world.members(name)
        assert tuple(g.ranks) == members
        assert g.size == len(members)
        expected = members.index(world.rank) if world.rank in members else -1
        assert g.rank == expected
        if expected >= 0:
            for backend in WITH_AUTO:
                assert mcrdl.get_rank(backend, group=g) == expected
                assert mcrdl.get_size(backend, group=g) == len(members)


# --------------------------------------------------------------------------- reductions


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_all_reduce(world, backend):
    """all_reduce: every dtype x valid op x size, in place on every member."""
    chk = Checker(world, "all_reduce", backend)
    for c in cases(world, with_ops=True, nshapes=3 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, _, _ = r
        key = ("all_reduce", c.i)
        t = values(c.dtype, c.op, c.shape, world.rank, *key)
        with chk.case(chk.desc(c)):
            exp = reduce_ref(c.dtype, c.op,
                             [as_ref(values(c.dtype, c.op, c.shape, m, *key)) for m in members])
            invoke(mcrdl.all_reduce, backend, t, op=rop(c.op),
                   group=world.group(c.gname), async_op=c.async_op)
            check_reduced(t, c.dtype, c.op, exp)
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_reduce(world, backend):
    """reduce: result on the group-local dst, other members' tensors unchanged."""
    chk = Checker(world, "reduce", backend)
    for c in cases(world, with_ops=True, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        dst = (c.i + c.i // 3) % gs
        key = ("reduce", c.i)
        t = values(c.dtype, c.op, c.shape, world.rank, *key)
        orig = t.clone()
        with chk.case(chk.desc(c, dst=dst)):
            invoke(mcrdl.reduce, backend, t, dst=dst, op=rop(c.op),
                   group=world.group(c.gname), async_op=c.async_op)
            if k == dst:
                exp = reduce_ref(c.dtype, c.op,
                                 [as_ref(values(c.dtype, c.op, c.shape, m, *key)) for m in members])
                check_reduced(t, c.dtype, c.op, exp)
            else:
                assert_bits(t, orig, "non-root tensor changed")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_reduce_scatter(world, backend):
    """reduce_scatter: reduced block k lands on group rank k (tensor and list input)."""
    chk = Checker(world, "reduce_scatter", backend)
    for c in cases(world, with_ops=True, nshapes=3 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        key = ("reduce_scatter", c.i)
        blocks = [values(c.dtype, c.op, c.shape, world.rank, *key, j) for j in range(gs)]
        inp = torch.cat(blocks) if c.form == "tensor" else blocks
        out = values(c.dtype, c.op, c.shape, -1, *key)
        with chk.case(chk.desc(c)):
            exp = reduce_ref(c.dtype, c.op,
                             [as_ref(values(c.dtype, c.op, c.shape, m, *key, k)) for m in members])
            invoke(mcrdl.reduce_scatter, backend, out, inp, op=rop(c.op),
                   group=world.group(c.gname), async_op=c.async_op)
            check_reduced(out, c.dtype, c.op, exp)
    chk.done()


# --------------------------------------------------------------------------- data movement


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_bcast(world, backend):
    """bcast/broadcast from a group-local src: bit-exact on every member."""
    chk = Checker(world, "bcast", backend)
    for c in cases(world):
        if (r := role(world, c)) is None:
            continue
        members, _, gs = r
        src = (c.i + c.i // 3) % gs
        key = ("bcast", c.i)
        t = data(c.dtype, c.shape, world.rank, *key)
        fn = mcrdl.broadcast if c.i % 4 == 1 else mcrdl.bcast
        with chk.case(chk.desc(c, src=src, fn=fn.__name__)):
            invoke(fn, backend, t, src=src, group=world.group(c.gname), async_op=c.async_op)
            assert_bits(t, data(c.dtype, c.shape, members[src], *key), "output")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_all_gather(world, backend):
    """all_gather into one tensor or a list, blocks in group order; every third tensor
    case in place (the input is this rank's block of the output, as ZeRO and FSDP call
    it)."""
    chk = Checker(world, "all_gather", backend)
    for c in cases(world):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        key = ("all_gather", c.i)
        inp = data(c.dtype, c.shape, world.rank, *key)
        blocks = [data(c.dtype, c.shape, m, *key) for m in members]
        if c.form == "tensor":
            out = sentinel(c.dtype, cat_shape(c.shape, gs), *key)
            if c.i % 3 == 0 and c.shape and c.shape[0]:
                rows = c.shape[0]
                inp = out[k * rows:(k + 1) * rows]
                inp.copy_(blocks[k])
        else:
            out = [sentinel(c.dtype, c.shape, *key, j) for j in range(gs)]
        with chk.case(chk.desc(c)):
            invoke(mcrdl.all_gather, backend, out, inp,
                   group=world.group(c.gname), async_op=c.async_op)
            if c.form == "tensor":
                assert_bits(out, torch.cat(blocks), "output")
            else:
                for j in range(gs):
                    assert_bits(out[j], blocks[j], f"block {j} differs")
            assert_bits(inp, blocks[members.index(world.rank)], "input changed")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_gather(world, backend):
    """gather to a group-local dst, tensor or list output; output None off dst half the time."""
    chk = Checker(world, "gather", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        dst = (c.i + c.i // 3) % gs
        key = ("gather", c.i)
        inp = data(c.dtype, c.shape, world.rank, *key)
        blocks = [data(c.dtype, c.shape, m, *key) for m in members]
        if k != dst and (c.i // 6) % 2 == 0:
            out = None
        elif c.form == "tensor":
            out = sentinel(c.dtype, cat_shape(c.shape, gs), *key)
        else:
            out = [sentinel(c.dtype, c.shape, *key, j) for j in range(gs)]
        with chk.case(chk.desc(c, dst=dst, out=None if out is None else "buffer")):
            invoke(mcrdl.gather, backend, out, inp, dst=dst,
                   group=world.group(c.gname), async_op=c.async_op)
            if k == dst and c.form == "tensor":
                assert_bits(out, torch.cat(blocks), "output")
            elif k == dst:
                for j in range(gs):
                    assert_bits(out[j], blocks[j], f"block {j} differs")
            assert_bits(inp, blocks[k], "input changed")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_scatter(world, backend):
    """scatter from a group-local src, tensor or list input; input None off src half the time."""
    chk = Checker(world, "scatter", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        src = (c.i + c.i // 3) % gs
        key = ("scatter", c.i)
        blocks = [data(c.dtype, c.shape, members[src], *key, j) for j in range(gs)]
        if k != src:  # anything goes off src: None or a buffer of garbage
            blocks = [data(c.dtype, c.shape, world.rank, "garbage", *key, j) for j in range(gs)]
        if k != src and (c.i // 6) % 2 == 0:
            inp = None
        else:
            inp = torch.cat(blocks) if c.form == "tensor" else blocks
        out = sentinel(c.dtype, c.shape, *key)
        with chk.case(chk.desc(c, src=src, inp=None if inp is None else "buffer")):
            invoke(mcrdl.scatter, backend, out, inp, src=src,
                   group=world.group(c.gname), async_op=c.async_op)
            exp = data(c.dtype, c.shape, members[src], *key, k)
            assert_bits(out, exp, "output")
    chk.done()


def _a2a_rows(c: Case, a: int, b: int) -> int:
    """Rows group rank a sends to group rank b in the uneven all_to_all cases."""
    return ((3 * a + 5 * b + c.i) % 4) * max(1, c.shape[0] // 100)


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_all_to_all_single(world, backend):
    """all_to_all_single: equal blocks ("tensor" cases) or split sizes in rows ("list" cases)."""
    chk = Checker(world, "all_to_all_single", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        key = ("all_to_all_single", c.i)
        rest = tuple(c.shape[1:])
        if c.form == "tensor":
            inp = torch.cat([data(c.dtype, c.shape, world.rank, *key, j) for j in range(gs)])
            exp = torch.cat([data(c.dtype, c.shape, m, *key, k) for m in members])
            kwargs = {}
        else:
            ins = [_a2a_rows(c, k, j) for j in range(gs)]
            outs = [_a2a_rows(c, j, k) for j in range(gs)]
            inp = data(c.dtype, (sum(ins),) + rest, world.rank, *key)
            parts = []
            for j, m in enumerate(members):
                rows = [_a2a_rows(c, j, q) for q in range(gs)]
                peer = data(c.dtype, (sum(rows),) + rest, m, *key)
                parts.append(peer[sum(rows[:k]):sum(rows[:k]) + rows[k]])
            exp = torch.cat(parts)
            kwargs = {"output_split_sizes": outs, "input_split_sizes": ins}
        out = sentinel(c.dtype, exp.shape, *key)
        with chk.case(chk.desc(c, splits=kwargs or None)):
            invoke(mcrdl.all_to_all_single, backend, out, inp,
                   group=world.group(c.gname), async_op=c.async_op, **kwargs)
            assert_bits(out, exp, "output")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_all_to_all(world, backend):
    """all_to_all on lists: equal shapes ("tensor" cases) or uneven first dims ("list" cases)."""
    chk = Checker(world, "all_to_all", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        key = ("all_to_all", c.i)
        rest = tuple(c.shape[1:])

        def shape(a, b, c=c, rest=rest):
            return c.shape if c.form == "tensor" else (_a2a_rows(c, a, b),) + rest

        inp = [data(c.dtype, shape(k, j), world.rank, *key, j) for j in range(gs)]
        out = [sentinel(c.dtype, shape(j, k), *key, j) for j in range(gs)]
        with chk.case(chk.desc(c)):
            invoke(mcrdl.all_to_all, backend, out, inp,
                   group=world.group(c.gname), async_op=c.async_op)
            for j, m in enumerate(members):
                assert_bits(out[j], data(c.dtype, shape(j, k), m, *key, k),
                            f"block from group rank {j}")
    chk.done()


# --------------------------------------------------------------------------- v variants


def _v_counts(c: Case, gs: int) -> list[int]:
    if numel(c.shape) == 0 and len(c.shape) == 1:
        return [0] * gs
    return [V_COUNTS[(3 * j + c.i) % len(V_COUNTS)] for j in range(gs)]


def _flat_or_2d(c: Case, t: torch.Tensor) -> torch.Tensor:
    """The v variants take any contiguous tensor as flat: pass (n, 1) views in "list" cases."""
    return t.view(-1, 1) if c.form == "list" else t


def _placed(base: torch.Tensor, displs, parts) -> np.ndarray:
    """Bytes of `base` with each part's elements written at its displacement."""
    exp = elems(base)
    for d, part in zip(displs, parts, strict=True):
        exp[d:d + part.numel()] = elems(part)
    return exp


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_gatherv(world, backend):
    """gatherv to a group-local dst with packed, explicit and gapped non-monotone displs."""
    chk = Checker(world, "gatherv", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        dst = (c.i + c.i // 3) % gs
        counts = _v_counts(c, gs)
        mode = V_MODES[(c.i // 2) % 3]
        displs, total, eff = layout(counts, mode)
        key = ("gatherv", c.i)
        inp = data(c.dtype, (counts[k],), world.rank, *key)
        out = sentinel(c.dtype, (total,), *key)
        base = out.clone()
        with chk.case(chk.desc(c, dst=dst, counts=counts, displs=displs)):
            invoke(mcrdl.gatherv, backend, _flat_or_2d(c, out), _flat_or_2d(c, inp), counts,
                   displs=displs, dst=dst,
                   group=world.group(c.gname), async_op=c.async_op)
            if k == dst:
                parts = [data(c.dtype, (counts[j],), m, *key) for j, m in enumerate(members)]
                assert_bits(elems(out), _placed(base, eff, parts), "output")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_scatterv(world, backend):
    """scatterv from a group-local src with packed, explicit and gapped non-monotone displs."""
    chk = Checker(world, "scatterv", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        src = (c.i + c.i // 3) % gs
        counts = _v_counts(c, gs)
        displs, total, eff = layout(counts, V_MODES[(c.i // 2) % 3])
        key = ("scatterv", c.i)
        full = data(c.dtype, (total,), members[src], *key)
        inp = full if k == src else data(c.dtype, (total,), world.rank, "garbage", *key)
        out = sentinel(c.dtype, (counts[k],), *key)
        with chk.case(chk.desc(c, src=src, counts=counts, displs=displs)):
            invoke(mcrdl.scatterv, backend, _flat_or_2d(c, out), _flat_or_2d(c, inp), counts,
                   displs=displs, src=src,
                   group=world.group(c.gname), async_op=c.async_op)
            assert_bits(out, full[eff[k]:eff[k] + counts[k]], "output")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_all_gatherv(world, backend):
    """all_gatherv with packed, explicit and gapped non-monotone displs; gaps untouched."""
    chk = Checker(world, "all_gatherv", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        counts = _v_counts(c, gs)
        displs, total, eff = layout(counts, V_MODES[(c.i // 2) % 3])
        key = ("all_gatherv", c.i)
        inp = data(c.dtype, (counts[k],), world.rank, *key)
        out = sentinel(c.dtype, (total,), *key)
        base = out.clone()
        with chk.case(chk.desc(c, counts=counts, displs=displs)):
            invoke(mcrdl.all_gatherv, backend, _flat_or_2d(c, out), _flat_or_2d(c, inp), counts,
                   displs=displs,
                   group=world.group(c.gname), async_op=c.async_op)
            parts = [data(c.dtype, (counts[j],), m, *key) for j, m in enumerate(members)]
            assert_bits(elems(out), _placed(base, eff, parts), "output")
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_all_to_allv(world, backend):
    """all_to_allv with and without send/recv displs (packed, explicit, gapped reversed)."""
    chk = Checker(world, "all_to_allv", backend)
    for c in cases(world, nshapes=2 if backend == "auto" else None):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        zero = numel(c.shape) == 0 and len(c.shape) == 1

        def cnt(a, b, c=c, zero=zero):
            return 0 if zero else A2AV_COUNTS[(2 * a + 3 * b + c.i) % len(A2AV_COUNTS)]

        smode, rmode = V_MODES[(c.i // 2) % 3], V_MODES[(c.i // 6 + c.i) % 3]
        key = ("all_to_allv", c.i)
        send_counts = [cnt(k, j) for j in range(gs)]
        recv_counts = [cnt(j, k) for j in range(gs)]
        sdispls, stotal, _ = layout(send_counts, smode)
        rdispls, rtotal, reff = layout(recv_counts, rmode)
        inp = data(c.dtype, (stotal,), world.rank, *key)
        out = sentinel(c.dtype, (rtotal,), *key)
        base = out.clone()
        with chk.case(chk.desc(c, send_counts=send_counts, send_displs=sdispls,
                               recv_counts=recv_counts, recv_displs=rdispls)):
            invoke(mcrdl.all_to_allv, backend, _flat_or_2d(c, out), _flat_or_2d(c, inp),
                   send_counts, recv_counts,
                   send_displs=sdispls, recv_displs=rdispls,
                   group=world.group(c.gname), async_op=c.async_op)
            parts = []
            for j, m in enumerate(members):
                peer_counts = [cnt(j, q) for q in range(gs)]
                _, ptotal, peff = layout(peer_counts, smode)
                peer = data(c.dtype, (ptotal,), m, *key)
                parts.append(peer[peff[k]:peff[k] + peer_counts[k]])
            assert_bits(elems(out), _placed(base, reff, parts), "output")
    chk.done()


# --------------------------------------------------------------------------- point to point


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_recv_ring(world, backend):
    """send/recv around a ring of group-local ranks, with tags; blocking and async."""
    if world.size < 2:
        pytest.skip("point-to-point needs at least 2 ranks")
    chk = Checker(world, "send_recv", backend)
    for c in cases(world, min_group=2):
        if (r := role(world, c)) is None:
            continue
        members, k, gs = r
        nxt, prv = (k + 1) % gs, (k - 1) % gs
        tag = c.i % 7
        key = ("send_recv", c.i)
        send_t = data(c.dtype, c.shape, world.rank, *key)
        recv_t = sentinel(c.dtype, c.shape, *key)
        g = world.group(c.gname)
        with chk.case(chk.desc(c, tag=tag, to=nxt, frm=prv)):
            if c.async_op:
                ws = mcrdl.send(backend, send_t, nxt, tag=tag, group=g, async_op=True)
                wr = mcrdl.recv(backend, recv_t, prv, tag=tag, group=g, async_op=True)
                for w in (wr, ws):
                    w.wait()
                    assert w.is_completed() is True and w.backend == backend
            elif k % 2 == 0:
                assert mcrdl.send(backend, send_t, nxt, tag=tag, group=g) is None
                assert mcrdl.recv(backend, recv_t, prv, tag=tag, group=g) is None
            else:
                assert mcrdl.recv(backend, recv_t, prv, tag=tag, group=g) is None
                assert mcrdl.send(backend, send_t, nxt, tag=tag, group=g) is None
            assert_bits(recv_t, data(c.dtype, c.shape, members[prv], *key), "output")
            assert_bits(send_t, data(c.dtype, c.shape, world.rank, *key), "send changed")
    chk.done()


# --------------------------------------------------------------------------- barrier


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_barrier(world, backend):
    """No member leaves a barrier before the last member (who arrives late) entered it."""
    chk = Checker(world, "barrier", backend)
    for n, gname in enumerate(world.gnames * 2):
        async_op = n >= len(world.gnames)
        members = world.members(gname)
        stamps = np.full(2, np.nan)
        if world.rank in members:
            k = members.index(world.rank)
            with chk.case(f"barrier[{backend}] group={gname}{list(members)} async={async_op}"):
                if k == len(members) - 1:
                    time.sleep(0.05)
                stamps[0] = time.monotonic()
                invoke(mcrdl.barrier, backend, group=world.group(gname), async_op=async_op)
                stamps[1] = time.monotonic()
        allst = np.empty((world.size, 2))
        world.comm.Allgather(stamps, allst)
        if world.rank in members:
            with chk.case(f"barrier[{backend}] group={gname}{list(members)} async={async_op}"):
                enter, leave = allst[list(members), 0], allst[list(members), 1]
                assert not np.isnan(allst[list(members)]).any(), "a member failed"
                assert enter.max() <= leave.min(), (
                    f"left at {leave.min():.6f} before the last entered at {enter.max():.6f}")
    chk.done()


# --------------------------------------------------------------------------- misc semantics


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_op_aliases(world, backend):
    """torch.distributed.ReduceOp values and ReduceOp.PROD are accepted."""
    import torch.distributed as dist

    chk = Checker(world, "reduce_op_aliases", backend)
    todo = [
        (dist.ReduceOp.SUM, "SUM", "float32"), (dist.ReduceOp.PRODUCT, "PRODUCT", "int64"),
        (dist.ReduceOp.MIN, "MIN", "int32"), (dist.ReduceOp.MAX, "MAX", "bfloat16"),
        (dist.ReduceOp.BAND, "BAND", "uint8"), (dist.ReduceOp.BOR, "BOR", "int8"),
        (dist.ReduceOp.BXOR, "BXOR", "bool"), (dist.ReduceOp.AVG, "AVG", "float64"),
        (mcrdl.ReduceOp.PROD, "PRODUCT", "float16"),
    ]
    members = list(range(world.size))
    for n, (op_value, name, dtype) in enumerate(todo):
        key = ("aliases", n)
        t = values(dtype, name, (13,), world.rank, *key)
        with chk.case(f"all_reduce[{backend}] op={op_value!r} dtype={dtype}"):
            exp = reduce_ref(dtype, name, [as_ref(values(dtype, name, (13,), m, *key))
                                           for m in members])
            mcrdl.all_reduce(backend, t, op=op_value)
            check_reduced(t, dtype, name, exp)
    chk.done(len(todo))


@pytest.mark.parametrize("dtype", sorted(HALF_BIG))
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_sum_rounds_once(world, backend, dtype):
    """float16/bfloat16 SUM at 3 ranks of HALF_BIG + 1 + 1, exact in the dtype but not
    reachable by adding in the dtype: mpi accumulates in float32 and rounds once
    (README.md), so every element is HALF_BIG + 2. Gloo reduces in the dtype itself
    (mcrdl passes 16-bit floats to it unconverted): elements whose first addition is
    HALF_BIG + 1 come out HALF_BIG, the others HALF_BIG + 2, the same on every rank.
    tests/pccl/check_pccl.py checks pccl's (the same as mpi's) on a 3-rank group."""
    if world.size != 3:
        pytest.skip("the sum HALF_BIG + 1 + 1 needs exactly 3 ranks")
    big = HALF_BIG[dtype]
    t = half_sum_inputs(dtype, world.rank)
    mcrdl.all_reduce(backend, t)
    got = t.to(torch.float64)
    if backend == "mpi":
        assert torch.all(got == big + 2), f"{dtype} sum not rounded once: {got.tolist()}"
    else:
        assert set(got.tolist()) == {big, big + 2}, (
            f"gloo {dtype} sum: expected {big} (added in the dtype) and {big + 2}: "
            f"{got.tolist()}")
    everyone = mcrdl.all_gather_object(got.tolist())
    assert all(v == everyone[0] for v in everyone), f"ranks differ: {everyone}"


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_min_max_over_nan_and_signed_zeros_agree_on_every_rank(world, backend):
    """MIN/MAX over a NaN held by one rank, and over -0 and +0: undefined which value
    comes out (docs/api.md), but every rank ends with the same bits. MPI's own MPI_MIN
    compares with <, and ranks combining in other orders ended with 2.0 on one rank and
    NaN on another."""
    results = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for op in (mcrdl.ReduceOp.MIN, mcrdl.ReduceOp.MAX):
            for nan_rank in range(world.size):
                t = torch.full((5,), float(world.rank + 1), dtype=dtype)
                if world.rank == nan_rank:
                    t[1:4] = float("nan")
                t[4] = -0.0 if world.rank % 2 else 0.0
                mcrdl.all_reduce(backend, t, op=op)
                results.append(t.view(torch.int16 if t.element_size() == 2 else
                                      torch.int32 if t.element_size() == 4 else
                                      torch.int64).tolist())
                # the finite values are exact; mpi propagates NaN and orders -0 below +0
                # (auto may route elsewhere by a shipped table)
                want = 1.0 if op == mcrdl.ReduceOp.MIN else float(world.size)
                bad = [] if float(t[0]) == want else [f"t[0] {float(t[0])} != {want}"]
                if backend == "mpi":
                    if not bool(torch.isnan(t[1:4]).all()):
                        bad.append(f"NaN not propagated: {t[1:4].tolist()}")
                    neg = op == mcrdl.ReduceOp.MIN and world.size > 1
                    if float(t[4]) != 0 or bool(torch.signbit(t[4])) != neg:
                        bad.append(f"t[4] is {float(t[4])!r}")
                if bad:
                    results.append(f"{dtype} {op.name} NaN on {nan_rank}: {'; '.join(bad)}")
    everyone = mcrdl.all_gather_object(results)
    wrong = [r for r in results if isinstance(r, str)]
    differ = [(i, [v[i] for v in everyone]) for i in range(len(results))
              if any(v[i] != everyone[0][i] for v in everyone)]
    assert not wrong, wrong[:3]
    assert not differ, f"ranks disagree on {len(differ)} of {len(results)} results: {differ[:3]}"


def test_mixed_backends(world):
    """Async ops of two backends issued and waited in different orders on different ranks."""
    chk = Checker(world, "mixed_backends", "mpi+gloo")
    first, second = ("mpi", "gloo") if world.rank % 2 == 0 else ("gloo", "mpi")
    members = list(range(world.size))
    for n, dtype in enumerate(("float32", "int64", "bfloat16", "bool")):
        key = ("mixed", n)
        ta = values(dtype, "MAX", (257,), world.rank, *key, "a")
        tb = values(dtype, "MAX", (257,), world.rank, *key, "b")
        with chk.case(f"mixed dtype={dtype} order={first},{second}"):
            tensors = {"mpi": ta, "gloo": tb}
            w1 = mcrdl.all_reduce(first, tensors[first], op=rop("MAX"), async_op=True)
            w2 = mcrdl.all_reduce(second, tensors[second], op=rop("MAX"), async_op=True)
            for w in (w2, w1) if n % 2 == 0 else (w1, w2):
                w.wait()
            for t, tag in ((ta, "a"), (tb, "b")):
                exp = reduce_ref(dtype, "MAX", [as_ref(values(dtype, "MAX", (257,), m, *key, tag))
                                                for m in members])
                check_reduced(t, dtype, "MAX", exp)
    # A blocking op of one backend while an async op of the other is outstanding.
    with chk.case("mixed blocking/async"):
        t_g = torch.full((5,), world.rank + 1, dtype=torch.int64)
        t_m = torch.full((5,), world.rank + 1, dtype=torch.int64)
        if world.rank % 2 == 0:
            w = mcrdl.all_reduce("gloo", t_g, async_op=True)
            mcrdl.all_reduce("mpi", t_m)
        else:
            mcrdl.all_reduce("mpi", t_m)
            w = mcrdl.all_reduce("gloo", t_g, async_op=True)
        w.wait()
        total = world.size * (world.size + 1) // 2
        assert t_g.tolist() == [total] * 5 and t_m.tolist() == [total] * 5
    chk.done()


@pytest.mark.parametrize("backend", WITH_AUTO)
def test_outstanding_async(world, backend):
    """Several async ops (world and subgroup) outstanding at once, waited in reverse order."""
    chk = Checker(world, "outstanding_async", backend)
    n, k = world.size, world.rank
    world_members = list(range(n))
    gname = world.gnames[-1]
    g, gmembers = world.group(gname), world.members(gname)
    with chk.case(f"outstanding[{backend}] group={gname}{list(gmembers)}"):
        pending, checks = [], []
        for j, dtype in enumerate(("float32", "int32", "bfloat16")):
            key = ("outstanding", j)
            t = values(dtype, "SUM", (129,), k, *key)
            pending.append(mcrdl.all_reduce(backend, t, async_op=True))
            exp = reduce_ref(dtype, "SUM", [as_ref(values(dtype, "SUM", (129,), m, *key))
                                            for m in world_members])
            checks.append(lambda t=t, dtype=dtype, exp=exp: check_reduced(t, dtype, "SUM", exp))
            if k in gmembers:
                gt = data(dtype, (65,), k, *key, "group")
                pending.append(mcrdl.bcast(backend, gt, src=len(gmembers) - 1, group=g,
                                           async_op=True))
                gexp = data(dtype, (65,), gmembers[-1], *key, "group")
                checks.append(lambda gt=gt, gexp=gexp: assert_bits(gt, gexp, "group bcast"))
            out = sentinel("uint8", (n * 33,), *key)
            pending.append(mcrdl.all_gather(backend, out, data("uint8", (33,), k, *key),
                                            async_op=True))
            aexp = torch.cat([data("uint8", (33,), m, *key) for m in world_members])
            checks.append(lambda out=out, aexp=aexp: assert_bits(out, aexp, "all_gather"))
        for w in reversed(pending):
            w.wait()
        assert all(w.is_completed() is True for w in pending), "work not completed"
        for check in checks:
            check()
    chk.done()


def test_synchronize(world):
    """synchronize() completes every outstanding op of the named backends (or all)."""
    chk = Checker(world, "synchronize", "mpi+gloo")
    total = float(world.size * (world.size + 1) // 2)
    for backends in (["mpi"], ["gloo"], None):
        with chk.case(f"synchronize({backends})"):
            names = backends or ["mpi", "gloo"]
            ts = [torch.full((33,), float(world.rank + 1)) for _ in range(3 * len(names))]
            works = [mcrdl.all_reduce(names[j % len(names)], t, async_op=True)
                     for j, t in enumerate(ts)]
            if backends is None:
                mcrdl.synchronize()
            else:
                mcrdl.synchronize(backends)
            assert all(w.is_completed() is True for w in works), "work not completed"
            for t in ts:
                assert t.tolist() == [total] * 33
    chk.done(3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_arguments(world, backend):
    """Bad arguments raise InvalidArgumentError locally on every rank; ranks stay in step."""
    chk = Checker(world, "invalid_arguments", backend)
    assert issubclass(mcrdl.InvalidArgumentError, ValueError)
    assert issubclass(mcrdl.InvalidArgumentError, mcrdl.MCRDLError)
    assert issubclass(mcrdl.MCRDLError, RuntimeError)
    assert issubclass(mcrdl.CommTimeoutError, TimeoutError)
    n = world.size
    bad = {
        "AVG on int32": lambda: mcrdl.all_reduce(
            backend, torch.ones(4, dtype=torch.int32), op=rop("AVG")),
        "AVG on bool": lambda: mcrdl.all_reduce(
            backend, torch.ones(4, dtype=torch.bool), op=rop("AVG")),
        "BAND on float32": lambda: mcrdl.all_reduce(backend, torch.ones(4), op=rop("BAND")),
        "reduce dst out of range": lambda: mcrdl.reduce(backend, torch.ones(4), dst=n),
        "bcast negative src": lambda: mcrdl.bcast(backend, torch.ones(4), src=-1),
        "all_gather output too small": lambda: mcrdl.all_gather(
            backend, torch.empty(4 * n - 1), torch.ones(4)),
        "all_gather list of wrong length": lambda: mcrdl.all_gather(
            backend, [torch.empty(4) for _ in range(n + 1)], torch.ones(4)),
        "all_gather dtype mismatch": lambda: mcrdl.all_gather(
            backend, torch.empty(4 * n, dtype=torch.float64), torch.ones(4)),
        "all_gatherv counts of wrong length": lambda: mcrdl.all_gatherv(
            backend, torch.empty(4 * n), torch.ones(4), [4] * (n + 1)),
        "all_gatherv negative count": lambda: mcrdl.all_gatherv(
            backend, torch.empty(4 * n), torch.ones(4), [-1] + [4] * (n - 1)),
        "send to out-of-range rank": lambda: mcrdl.send(backend, torch.ones(4), n),
        "non-contiguous tensor": lambda: mcrdl.all_reduce(backend, torch.ones(8)[::2]),
    }
    for what, fn in bad.items():
        with chk.case(what):
            with pytest.raises(mcrdl.InvalidArgumentError):
                fn()
    perm = world.groups.get("perm")
    if perm is not None and world.rank not in perm[1]:
        with chk.case("non-member group"):
            with pytest.raises(mcrdl.InvalidArgumentError):
                mcrdl.all_reduce(backend, torch.ones(4), group=perm[0])
    with chk.case("unknown backend"):
        with pytest.raises(mcrdl.BackendUnavailableError):
            mcrdl.all_reduce("no-such-backend", torch.ones(4))
    with chk.case("still in step"):
        t = torch.full((3,), float(world.rank))
        mcrdl.all_reduce(backend, t, op=rop("MAX"))
        assert t.tolist() == [float(n - 1)] * 3
    chk.done(len(bad) + 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_recv_tags_out_of_order(world, backend):
    """Async sends with tags 1, 2, 3 are matched by tag by recvs posted in another order."""
    if world.size < 2:
        pytest.skip("point-to-point needs at least 2 ranks")
    chk = Checker(world, "send_recv_tags", backend)
    k, n = world.rank, world.size
    nxt, prv = (k + 1) % n, (k - 1) % n
    for dtype in ("float32", "bfloat16", "int8"):
        key = ("tags", dtype)
        with chk.case(f"send_recv_tags[{backend}] dtype={dtype}"):
            payload = {tag: data(dtype, (10 + tag,), k, *key, tag) for tag in (1, 2, 3)}
            sends = [mcrdl.send(backend, payload[tag], nxt, tag=tag, async_op=True)
                     for tag in (1, 2, 3)]
            bufs = {tag: sentinel(dtype, (10 + tag,), *key, tag) for tag in (3, 1, 2)}
            recvs = [mcrdl.recv(backend, bufs[tag], prv, tag=tag, async_op=True)
                     for tag in (3, 1, 2)]
            for w in recvs + sends:
                w.wait()
            for tag, buf in bufs.items():
                assert_bits(buf, data(dtype, (10 + tag,), prv, *key, tag), f"tag {tag}")
    chk.done()



@pytest.mark.parametrize("backend", BACKENDS)
def test_large_messages(world, backend):
    """Messages past eager/chunking thresholds: all_reduce, bcast, all_gather, ring send/recv."""
    chk = Checker(world, "large", backend)
    n, k = world.size, world.rank
    members = list(range(n))
    big = 3 * 2**16 + 5
    for dtype, op in (("float32", "SUM"), ("bfloat16", "SUM"), ("int64", "BXOR")):
        key = ("large all_reduce", dtype)
        t = values(dtype, op, (big,), k, *key)
        with chk.case(f"all_reduce[{backend}] dtype={dtype} op={op} numel={big}"):
            exp = reduce_ref(dtype, op, [as_ref(values(dtype, op, (big,), m, *key))
                                         for m in members])
            invoke(mcrdl.all_reduce, backend, t, op=rop(op), async_op=dtype == "bfloat16")
            check_reduced(t, dtype, op, exp)
    with chk.case(f"bcast[{backend}] float16 numel={big}"):
        t = data("float16", (big,), k, "large bcast")
        mcrdl.bcast(backend, t, src=n - 1)
        assert_bits(t, data("float16", (big,), n - 1, "large bcast"), "output")
    with chk.case(f"all_gather[{backend}] uint8 numel={big}"):
        out = sentinel("uint8", (n * big,), "large all_gather")
        mcrdl.all_gather(backend, out, data("uint8", (big,), k, "large all_gather"))
        exp = torch.cat([data("uint8", (big,), m, "large all_gather") for m in members])
        assert_bits(out, exp, "output")
    if n >= 2:
        with chk.case(f"send/recv ring[{backend}] float64 numel={big}"):
            send_t = data("float64", (big,), k, "large p2p")
            recv_t = sentinel("float64", (big,), "large p2p")
            if k % 2 == 0:
                mcrdl.send(backend, send_t, (k + 1) % n, tag=5)
                mcrdl.recv(backend, recv_t, (k - 1) % n, tag=5)
            else:
                mcrdl.recv(backend, recv_t, (k - 1) % n, tag=5)
                mcrdl.send(backend, send_t, (k + 1) % n, tag=5)
            assert_bits(recv_t, data("float64", (big,), (k - 1) % n, "large p2p"), "output")
    chk.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_timeout(world, backend):
    """wait(timeout) on a recv nobody sent yet raises CommTimeoutError naming op, backend, group
    and sequence number; the recv still completes once the send comes."""
    if world.size < 2:
        pytest.skip("point-to-point needs at least 2 ranks")
    k, n = world.rank, world.size
    buf = sentinel("int32", (9,), "timeout")
    w = mcrdl.recv(backend, buf, (k - 1) % n, tag=91, async_op=True)
    errors = []
    try:
        assert w.is_completed() is False, "recv completed before any send"
        with pytest.raises(mcrdl.CommTimeoutError) as info:
            w.wait(timeout=0.5)
        msg = str(info.value)
        for word in ("recv", backend, "world", "sequence"):
            assert word in msg, f"CommTimeoutError message lacks {word!r}: {msg!r}"
    # keep ranks in step: the matching send must still happen (pytest.raises fails with
    # its own exception, not an AssertionError, when nothing is raised)
    except (AssertionError, pytest.fail.Exception) as exc:
        errors.append(str(exc))
    world.comm.Barrier()
    payload = data("int32", (9,), k, "timeout")
    ws = mcrdl.send(backend, payload, (k + 1) % n, tag=91, async_op=True)
    ws.wait()
    w.wait()
    assert not errors, errors[0]
    assert_bits(buf, data("int32", (9,), (k - 1) % n, "timeout"), "recv after a timed-out wait")
    t = torch.full((3,), float(k))
    mcrdl.all_reduce(backend, t, op=rop("MAX"))
    assert t.tolist() == [float(n - 1)] * 3, "ranks out of step after a timed-out wait"
