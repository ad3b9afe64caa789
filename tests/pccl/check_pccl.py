"""Rank script: the "pccl" backend against numpy, and its C++ algorithms against the
mpi4py reference (mcrdl/backends/pccl_ref.py). Run under mpiexec with
MCRDL_RANKS_PER_NODE set to simulate nodes; rank 0 prints one summary line.

Checked, for every dtype and every reduce op that applies (on the world with each of
auto/mpi, ring/ring and rd/rd at 2 ranks, and with auto/mpi only from 3 ranks on;
elsewhere one dtype per path, and every op at size 7, SUM at the others), sizes 0, 1, 7
and 1000 (multi-dimensional too, but not with PCCL_TEST_ALGOS=core), tensor and list forms,
blocking and async, on the world, on a permuted sub-group (mixed_order) and from 4 ranks
on a third (every rank but the last: uneven), with each
(inter, intra) algorithm pair (with PCCL_TEST_ALGOS=core: ring/ring and rd/rd):
  all_gather (bit-exact), reduce_scatter and all_reduce (numpy reference, exact but
  for a floating AVG, as the conformance tests). Then the flat C++ ring/rd
  algorithms and the Python reference on the same inputs agree bit for bit on integer
  and float32 data, at several block sizes.
"""

import contextlib
import os
import sys
import time
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dist"))
import _ref as R  # noqa: E402

import mcrdl  # noqa: E402
from mcrdl import _C  # noqa: E402
from mcrdl.backends import pccl, pccl_ref  # noqa: E402
from mcrdl.backends.pccl import use_algorithms  # noqa: E402

# (inter, intra); intra "gloo": the intra-node phase on the gloo backend (hierarchical
# layouts only: flat ones have no intra-node phase)
ALGOS = [("auto", "mpi"), ("ring", "ring"), ("rd", "rd"), ("auto", "gloo"), ("mpi", "rd"),
         ("rd", "mpi")]
SHAPES = ((0,), (1,), (7,), (1000,), (3, 5))
# One dtype per path of pccl's (float, half reduced in float32, integers, bool moved and
# reduced as uint8): what the Gloo intra-node phase is checked with (Gloo's own dtype
# handling is the dist suite's), and every algorithm in larger worlds.
PATH_DTYPES = ("float32", "bfloat16", "int64", "uint8", "bool")
# Larger worlds keep the launch short (8 ranks on 2 cores: 20-30 ms an op): pccl's own
# phases only (Gloo costs 100-300 ms an op there; its intra-node phase is checked at 4
# ranks, and at 6 in the wide sweep, MCRDL_TEST_FULL=1), on one dtype per path (a dtype's
# handling does not depend on the layout; every dtype runs at 2 and 4 ranks).
if os.environ.get("MCRDL_TEST_FULL") != "1":
    # the second mixed pair only in the wide sweep: composing the phases is checked by
    # mpi/rd, and each algorithm alone by the others (5 s of CI's 4-rank launch)
    ALGOS = ALGOS[:-1]
CORE = os.environ.get("PCCL_TEST_ALGOS") == "core"
if CORE:
    # pccl's own algorithms: auto/mpi runs the MPI library's collectives in both phases,
    # composed as at 2 and 4 ranks
    ALGOS = ALGOS[1:3]
    # nor the 2-d shape: flattening does not depend on the layout (its 15 elements split
    # as 7's do), and every shape runs at 2 and 4 ranks
    SHAPES = SHAPES[:-1]


def mixed_order(world_nodes: list[int]) -> list[int]:
    """A permutation of the world that stays hierarchical on even layouts but lists the
    ranks of local index l node by node, reversing the node order for odd l (2 nodes x 2:
    [0, 2, 3, 1]; a node's second rank comes first for node 1): the inter-node ranks must
    follow the node index, not the group order. The reversed world where that is the
    identity (one node, or one rank per node)."""
    world = len(world_nodes)
    by_node: dict[int, list[int]] = {}
    for r, n in enumerate(world_nodes):
        by_node.setdefault(n, []).append(r)
    nodes = sorted(by_node)
    per_node = {len(v) for v in by_node.values()}
    if len(nodes) < 2 or len(per_node) != 1 or per_node == {1}:
        return list(reversed(range(world)))
    out = []
    for loc in range(per_node.pop()):
        for n in (nodes if loc % 2 == 0 else reversed(nodes)):
            out.append(by_node[n][loc])
    return out


@contextlib.contextmanager
def timed(took: dict, phase: str):
    """Record the seconds the block took as took[phase] (rank 0 prints them: where a slow
    run's time went)."""
    start = time.monotonic()
    yield
    took[phase] = time.monotonic() - start


def main() -> int:
    took = {}  # phase -> seconds on this rank
    began = time.monotonic()
    with timed(took, "init"):
        mcrdl.init(["mpi", "gloo", "pccl"])
    rank, world = mcrdl.get_rank(), mcrdl.get_size()
    lay = pccl.initialized().layouts[0]
    hierarchical = lay.hierarchical
    sub_ranks = mixed_order(pccl.initialized().world_nodes)
    groups = [(None, list(range(world))), (mcrdl.new_group(sub_ranks), sub_ranks)]
    if world >= 4:
        # every rank but the last: on an even layout its last node is a rank short, the
        # uneven layout that runs flat (the default run's only uneven one; at 2 nodes x 2
        # also its only flat group of an odd size, 3, where ring and rd have a remainder)
        third = list(range(world - 1))
        groups.append((mcrdl.new_group(third), third))
    # The algorithm pairs that run every dtype and every op on the world (see below).
    one_algo = ALGOS[:3] if world <= 2 else ALGOS[:1]
    checks = 0
    ran = []  # what rank 0 (a member of every group) ran; the launcher checks the set
    for inter, intra in ALGOS:
        if intra == "gloo" and not hierarchical:
            continue
        with timed(took, f"{inter}/{intra}"), use_algorithms(inter, intra):
            for gi, (group, ranks) in enumerate(groups):
                if rank not in ranks:
                    continue
                ran.append(f"{inter}/{intra} group {gi}")
                me, p = ranks.index(rank), len(ranks)
                # Every dtype and every reduce op at every shape on the world with one
                # algorithm in both phases: each of auto/mpi, ring/ring and rd/rd at 2
                # ranks, auto/mpi in larger worlds. Elsewhere (sub-groups, mixed pairs,
                # Gloo's phase, larger worlds' ring and rd) one dtype per path, and every
                # op at one shape (SUM at the others): the handling of a dtype or an op
                # does not depend on the group, the layout or how the phases' algorithms
                # combine, and ring's and rd's reduction loops are the same at any size.
                wide = gi == 0 and (inter, intra) in one_algo and not CORE
                for dtype in R.DTYPES if wide else PATH_DTYPES:
                    for shape in SHAPES:
                        key = (inter, intra, gi)
                        checks += check_all_gather(dtype, shape, group, ranks, me, p, key)
                        every_op = wide or shape == (7,)
                        for op in R.ops_for(dtype) if every_op else ("SUM",):
                            checks += check_reductions(dtype, op, shape, group, ranks, me, p,
                                                       key)
    with timed(took, "wait order"):
        for intra in ("mpi", "gloo") if hierarchical and not CORE else ("mpi",):
            with use_algorithms("auto", intra):
                checks += check_wait_order(rank, world, groups[1][0])
    with timed(took, "half rounding"):
        for gi, (group, ranks) in enumerate(groups):
            if len(ranks) == 3 and rank in ranks:
                ran.append(f"half rounding group {gi}")
                checks += check_half_rounding(group, ranks.index(rank))
    with timed(took, "NaN and signed zeros"):
        checks += check_nan_agreement(rank, world, hierarchical)
    with timed(took, "C++ vs Python"):
        checks += check_cpp_vs_python(rank, world)
    if world >= 4 and hierarchical and rank in groups[2][1]:  # the uneven group ran flat
        assert not pccl.initialized().layouts[groups[2][0].id].hierarchical
    total = torch.tensor([checks])
    mcrdl.all_reduce("mpi", total)
    if rank == 0:
        print(f"pccl OK: world {world}, {lay.nodes} nodes x {lay.per_node} "
              f"({'hierarchical' if lay.hierarchical else 'flat'}), {int(total)} checks")
        print("pccl ran: " + "; ".join(ran))
        took["total"] = time.monotonic() - began
        print("pccl phases on rank 0: " + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
    mcrdl.finalize()
    return 0


def check_all_gather(dtype, shape, group, ranks, me, p, key) -> int:
    x = R.data(dtype, shape, ranks[me], "ag", key)
    expected = torch.cat([R.data(dtype, shape, r, "ag", key).reshape(-1) for r in ranks])
    out = torch.empty((p * shape[0], *shape[1:]), dtype=x.dtype)
    mcrdl.all_gather("pccl", out, x, group=group)
    R.assert_bits(out.reshape(-1), expected, f"all_gather {dtype}{shape} {key}")
    outs = [torch.empty(shape, dtype=x.dtype) for _ in range(p)]
    mcrdl.all_gather("pccl", outs, x, group=group, async_op=True).wait()
    R.assert_bits(torch.cat([t.reshape(-1) for t in outs]), expected,
                  f"all_gather list async {dtype}{shape} {key}")
    return 2


def check_reductions(dtype, op, shape, group, ranks, me, p, key) -> int:
    rop = getattr(mcrdl.ReduceOp, op)
    # reduce_scatter: every rank holds p blocks shaped like `shape`
    ins = {r: R.values(dtype, op, (p * shape[0], *shape[1:]), r, "rs", key) for r in ranks}
    full = R.reduce_ref(dtype, op, [R.as_ref(ins[r]) for r in ranks])
    block = full.reshape(p, -1)[me].reshape(shape) if full.size else full.reshape(shape)
    out = torch.empty(shape, dtype=R.tdtype(dtype))
    # (crc32, not hash(): a string's hash differs per process, and so would the cases)
    async_op = (zlib.crc32(repr((dtype, op, shape)).encode()) & 1) == 1
    w = mcrdl.reduce_scatter("pccl", out, ins[ranks[me]].clone(), op=rop, group=group,
                             async_op=async_op)
    if w is not None:
        w.wait()
    R.check_reduced(out, dtype, op, block)
    # all_reduce in place
    vals = {r: R.values(dtype, op, shape, r, "ar", key) for r in ranks}
    t = vals[ranks[me]].clone()
    w = mcrdl.all_reduce("pccl", t, op=rop, group=group, async_op=not async_op)
    if w is not None:
        w.wait()
    R.check_reduced(t, dtype, op, R.reduce_ref(dtype, op, [R.as_ref(vals[r]) for r in ranks]))
    return 2


def check_half_rounding(group, me: int) -> int:
    """float16/bfloat16 SUM over a 3-rank group of HALF_BIG + 1 + 1 (R.half_sum_inputs):
    reduced in float32 and rounded once, every element is HALF_BIG + 2 with each
    algorithm; adding in the dtype would leave HALF_BIG on some."""
    checks = 0
    for inter, intra in ALGOS[:3]:
        with use_algorithms(inter, intra):
            for dtype, big in R.HALF_BIG.items():
                t = R.half_sum_inputs(dtype, me)
                mcrdl.all_reduce("pccl", t, group=group)
                assert torch.all(t.to(torch.float64) == big + 2), (
                    f"pccl {inter}/{intra} {dtype} sum not rounded once: {t.tolist()}")
                checks += 1
    return checks


def check_nan_agreement(rank, world, hierarchical) -> int:
    """MIN/MAX over a NaN held by one rank and over -0/+0, by each algorithm (the MPI
    library's collectives in a phase too, and 70000 elements past the loops' size, where
    ATen's kernels were used): every rank ends with the same bits, NaN propagated."""
    results = []
    algos = [a for a in ALGOS[:4] if a[1] != "gloo" or hierarchical]
    for inter, intra in algos:
        with use_algorithms(inter, intra):
            for op in (mcrdl.ReduceOp.MIN, mcrdl.ReduceOp.MAX):
                for n in (5, 70000):
                    t = torch.full((n,), float(rank + 1))
                    if rank == world - 1:
                        t[1:4] = float("nan")
                    t[4] = -0.0 if rank % 2 else 0.0
                    mcrdl.all_reduce("pccl", t, op=op)
                    assert torch.isnan(t[1:4]).all() or intra == "gloo", (inter, intra, t[:5])
                    results.append(t[:5].view(torch.int32).tolist())
    everyone = mcrdl.all_gather_object(results)
    assert all(v == everyone[0] for v in everyone), (algos, everyone)
    return len(results)


def check_wait_order(rank, world, group) -> int:
    """Async ops waited in a different order on different ranks (odd ranks newest
    first) still pair up: every rank posts each op's phases in issue order. Then
    synchronize without a wait delivers every result (all_reduce's copy out of its
    padded buffer ran only on wait)."""
    p = world if group is None else group.size
    checks = 0
    for it in range(5):
        a = torch.full((7,), float(rank + 1))
        b = torch.full((5,), 100.0 * (rank + 1))
        gathered = torch.empty(p * 3, dtype=torch.int64)
        mine = torch.arange(3) + 10 * rank
        ws = [mcrdl.all_reduce("pccl", a, group=group, async_op=True),
              mcrdl.all_gather("pccl", gathered, mine, group=group, async_op=True),
              mcrdl.all_reduce("pccl", b, group=group, async_op=True)]
        if rank % 2:
            ws.reverse()
        if it == 4:
            mcrdl.synchronize("pccl")
            ws = []
        elif it % 2:  # polling, then waiting
            # (sleeping between polls: a spinning rank takes the CPU from the ranks it
            # waits for, 4 to 6 ranks sharing 2 cores; spinning took up to 20 s here)
            deadline = time.monotonic() + 60
            while not ws[0].is_completed():
                assert time.monotonic() < deadline, f"polling never completed it ({it})"
                time.sleep(1e-4)
        for w in ws:
            w.wait()
        s = world * (world + 1) / 2
        assert torch.all(a == s) and torch.all(b == 100 * s), (it, a, b)
        ranks = range(world) if group is None else group.ranks
        ref = torch.cat([torch.arange(3) + 10 * r for r in ranks])
        assert torch.equal(gathered, ref), (it, gathered, ref)
        checks += 3
    return checks


def check_cpp_vs_python(rank, world) -> int:
    """Flat C++ algorithms vs the mpi4py reference, bit for bit (NaN included)."""
    MPI = mcrdl.bootstrap.mpi_module()
    comm_c, comm_py = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    lane = _C.Lane("pccl-test")
    flat = _C.PcclComm(comm_c.handle, rank, world, 0, 0, 1, [], "world (test)", lane, 60.0)
    checks = 0
    # 70000 > the C++ plain-loop limit (64K elements): there the reductions are ATen ops
    for dtype in (torch.int64, torch.int8, torch.float32):
        for n in (1, 5, 333, 70000):
            g = np.random.default_rng([rank, n, world])
            if dtype.is_floating_point:
                raw = g.standard_normal(world * n).astype(np.float32)
                if n == 5 and rank == world - 1:
                    raw[::3] = np.nan  # MAX propagates NaN, as numpy's maximum does
            else:
                raw = g.integers(-100, 100, size=world * n).astype(
                    torch.empty((), dtype=dtype).numpy().dtype)
            src = torch.from_numpy(raw)
            for algo in ("ring", "rd"):
                for op_name, code in (("sum", mcrdl.ReduceOp.SUM), ("max", mcrdl.ReduceOp.MAX),
                                      ("product", mcrdl.ReduceOp.PRODUCT)):
                    got = torch.empty(n, dtype=dtype)
                    flat.reduce_scatter(got, src, int(code), algo, "mpi", False)
                    ref = np.empty(n, dtype=raw.dtype)
                    with np.errstate(over="ignore"):
                        pccl_ref.reduce_scatter(comm_py, raw.copy(), ref, n, op_name, algo)
                    R.assert_bits(got, torch.from_numpy(ref),
                                  f"C++ vs Python reduce_scatter {algo} {op_name} {dtype} n={n}")
                    checks += 1
                mine = src[:n].clone()
                got = torch.empty(world * n, dtype=dtype)
                flat.all_gather(got, mine, algo, "mpi", False)
                ref = np.zeros(world * n, dtype=raw.dtype)
                ref[rank * n:(rank + 1) * n] = mine.numpy()
                pccl_ref.all_gather(comm_py, ref, n, algo)
                R.assert_bits(got, torch.from_numpy(ref), f"C++ vs Python all_gather {algo}")
                checks += 1
    lane.shutdown("test done", 10.0)
    comm_c.Free()
    comm_py.Free()
    return checks


if __name__ == "__main__":
    raise SystemExit(main())
