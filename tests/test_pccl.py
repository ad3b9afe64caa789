"""The "pccl" backend: multi-rank conformance (tests/pccl/check_pccl.py) at world sizes
2..8 with simulated node layouts that are not powers of two, plus single-process checks
of its layout logic, cost model and Python reference."""

import math
import os
import re
import sys
import time
import warnings

import pytest

from ._launch import FULL, mpiexec_or_skip, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "pccl")

# (world size, MCRDL_RANKS_PER_NODE, expected layout)
# The default run keeps one of each kind: flat, and hierarchical with a power of two
# nodes (every algorithm pair, Gloo's intra-node phase included), whose third group
# (every rank but the last, 2 + 1) is uneven and runs flat over 3 ranks: ring and rd on
# a group that is not a power of two, through the same flat code as an odd number of
# nodes. The wider sweep adds an uneven world, 3 nodes x 2, 3 per node and the widest.
LAYOUTS = [
    (2, 1, "2 nodes x 1 (flat)"),
    pytest.param(3, 3, "1 nodes x 3 (flat)", marks=FULL),
    (4, 2, "2 nodes x 2 (hierarchical)"),
    # 2 + 2 + 1: uneven, the whole group runs flat
    pytest.param(5, 2, "3 nodes x 0 (flat)", marks=FULL),
    pytest.param(6, 3, "2 nodes x 3 (hierarchical)", marks=FULL),
    pytest.param(6, 2, "3 nodes x 2 (hierarchical)", marks=FULL),
    pytest.param(7, 1, "7 nodes x 1 (flat)", marks=FULL),
    pytest.param(8, 4, "2 nodes x 4 (hierarchical)", marks=FULL),
]


def _layout_id(layout) -> str:
    n, k, _ = layout.values if hasattr(layout, "values") else layout
    return f"{n}ranks-{k}pernode"


def expected_runs(n: int, layout: str, env: dict) -> list[str]:
    """What check_pccl.py runs on rank 0, in order: each algorithm pair (inter/intra) on
    each group (world, mixed order, from 4 ranks every rank but the last), Gloo's
    intra-node phase on hierarchical layouts only, the second mixed pair only in the wide
    sweep, ring/ring and rd/rd alone with PCCL_TEST_ALGOS=core; then the half-precision
    rounding on each 3-rank group."""
    pairs = ["auto/mpi", "ring/ring", "rd/rd", "auto/gloo", "mpi/rd"]
    if env.get("MCRDL_TEST_FULL") == "1":
        pairs.append("rd/mpi")
    if env.get("PCCL_TEST_ALGOS") == "core":
        pairs = ["ring/ring", "rd/rd"]
    if "hierarchical" not in layout:
        pairs = [p for p in pairs if not p.endswith("/gloo")]
    groups = [n, n] + ([n - 1] if n >= 4 else [])  # sizes of groups 0, 1, 2
    runs = [f"{p} group {g}" for p in pairs for g in range(len(groups))]
    return runs + [f"half rounding group {g}" for g, size in enumerate(groups) if size == 3]


SLOW_S = 90  # a launch that took longer says where its time went (a warning)


@pytest.mark.parametrize("n,per_node,expected", LAYOUTS, ids=[_layout_id(x) for x in LAYOUTS])
def test_pccl_conformance(n, per_node, expected):
    env = dict(os.environ, MCRDL_RANKS_PER_NODE=str(per_node), MCRDL_TIMEOUT="120")
    # Every algorithm pair (Gloo's intra-node phase included) at up to 4 ranks; at 6
    # (3 per node, 3 nodes) only in the wide sweep, which keeps CI within its budget.
    wide = os.environ.get("MCRDL_TEST_FULL") == "1" and (n, per_node) in ((6, 3), (6, 2))
    if n >= 5 and not wide:
        env["PCCL_TEST_ALGOS"] = "core"
    cmd = [mpiexec_or_skip(), "-n", str(n), sys.executable, os.path.join(HERE, "check_pccl.py")]
    start = time.monotonic()
    out = run_launcher(cmd, env=env, timeout=400)
    took = time.monotonic() - start
    m = re.search(r"pccl OK: world (\d+), (.*), (\d+) checks", out)
    assert m, out
    assert int(m.group(1)) == n and m.group(2) == expected, m.group(0)
    ran = re.search(r"pccl ran: (.*)", out)
    assert ran, out[-2000:]
    assert ran.group(1).split("; ") == expected_runs(n, expected, env), ran.group(0)
    if took > SLOW_S:
        # not a failure (the machine may be busy), but CI's log shows where the time went
        # (one CI run took 117 s at 4 ranks, 27-45 s otherwise)
        phases = re.search(r"pccl phases on rank 0: .*", out)
        warnings.warn(f"pccl at {n} ranks took {took:.0f} s; "
                      f"{phases.group(0) if phases else out[-1500:]}", stacklevel=1)


def test_layout():
    from mcrdl.backends.pccl_layout import Layout

    nodes = [r // 3 for r in range(6)]  # 2 nodes x 3, blocked
    lay = Layout.of(tuple(range(6)), nodes)
    assert (lay.nodes, lay.per_node, lay.hierarchical) == (2, 3, True)
    # perm[l * N + j] = group rank of (node j, local l)
    assert lay.perm() == [0, 3, 1, 4, 2, 5]
    # a permuted group: nodes in order of first appearance, locals in group order
    lay = Layout.of((5, 0, 4, 1, 3, 2), nodes)
    assert lay.node_of == (0, 1, 0, 1, 0, 1) and lay.local_of == (0, 0, 1, 1, 2, 2)
    assert lay.perm() == [0, 1, 2, 3, 4, 5]
    uneven = Layout.of(tuple(range(5)), [r // 2 for r in range(5)])
    assert not uneven.hierarchical and uneven.nodes == 3
    assert not Layout.of((0, 1, 2), [0, 0, 0]).hierarchical  # one node


def test_cost_model():
    from mcrdl.backends.pccl_cost_model import CostModel

    m = CostModel(alpha=10e-6, beta_ring=1e-10, beta_rd=2e-10)
    p = 16
    assert m.ring(p, 0) == pytest.approx(15 * 10e-6)
    assert m.rd(p, 0) == pytest.approx(4 * 10e-6)
    x = m.crossover(p)  # alpha (15 - 4) = 15 b (2e-10 - 1e-10)
    assert x == pytest.approx(10e-6 * 11 / (15 * 1e-10))
    assert m.choose(p, x / 2) == "rd" and m.choose(p, 2 * x) == "ring"
    # non-power of two: fold + unfold cost two more latency terms and the data once more
    assert m.rd(6, 0) == pytest.approx((2 + 2) * 10e-6)
    assert m.rd(6, 100) == pytest.approx(4 * 10e-6 + 5 * 100 * 2e-10 * 2)
    assert CostModel(1e-6, 1e-10, 1e-10).crossover(16) is None  # rd never loses
    assert math.isclose(CostModel().crossover(2) or 0.0, 0.0)  # p = 2: the same single step


def test_cost_model_fit():
    from mcrdl import InvalidArgumentError
    from mcrdl.backends.pccl_cost_model import CostModel
    from mcrdl.tuning.model import fit_line

    true = CostModel(alpha=20e-6, beta_ring=1.2e-9, beta_rd=1.5e-9)
    sizes = [1024 * 4**i for i in range(8)]  # 1 KiB .. 16 MiB
    for p in (8, 6):  # power of two, and folded
        got = CostModel.fit(p, sizes, [true.ring(p, b) for b in sizes],
                            [true.rd(p, b) - true.rd(p, 0) + 5e-6 for b in sizes])
        assert got.alpha == pytest.approx(true.alpha, rel=1e-9)
        assert got.beta_ring == pytest.approx(true.beta_ring, rel=1e-9)
        assert got.beta_rd == pytest.approx(true.beta_rd, rel=1e-9)
    # 10% noise on the 16 MiB time: the intercept stays near alpha (plain least squares
    # gives 0 or milliseconds), and the slopes within a few percent
    times = [true.ring(8, b) for b in sizes]
    times[-1] *= 1.1
    a, b = fit_line(sizes, times)
    assert a / 7 == pytest.approx(true.alpha, rel=0.05)
    assert b / 7 == pytest.approx(true.beta_ring, rel=0.05)
    assert fit_line([1, 2, 3], [3.0, 2.0, 1.0]) == (pytest.approx(1.3469, rel=1e-3), 0.0)
    assert fit_line([1, 2], [1.0, 2.0]) == (pytest.approx(0.0, abs=1e-12), pytest.approx(1.0))
    xs, ys = [1, 2, 4], [0.5, 2.0, 4.5]  # the free line's intercept is negative
    r = [x / y for x, y in zip(xs, ys, strict=True)]
    through_origin = sum(r) / sum(v * v for v in r)
    assert fit_line(xs, ys) == (0.0, pytest.approx(through_origin))
    with pytest.raises(InvalidArgumentError, match="positive"):
        fit_line([1, 2], [0.0, 1.0])
    with pytest.raises(InvalidArgumentError, match="at least two sizes"):
        CostModel.fit(8, [1024], [1e-5], [1e-5])


def test_model_and_env_errors(monkeypatch):
    from mcrdl import InvalidArgumentError
    from mcrdl.backends.pccl_cost_model import CostModel
    from mcrdl.backends.pccl_layout import node_ids

    monkeypatch.setenv("MCRDL_PCCL_MODEL", "1e-6,2e-10")
    with pytest.raises(InvalidArgumentError, match="MCRDL_PCCL_MODEL"):
        CostModel.from_env()
    monkeypatch.setenv("MCRDL_PCCL_MODEL", "1e-6,2e-10,3e-10")
    assert CostModel.from_env() == CostModel(1e-6, 2e-10, 3e-10)
    monkeypatch.setenv("MCRDL_RANKS_PER_NODE", "zero")
    with pytest.raises(InvalidArgumentError, match="MCRDL_RANKS_PER_NODE"):
        node_ids(None, 4)
    monkeypatch.setenv("MCRDL_RANKS_PER_NODE", "2")
    assert node_ids(None, 5) == [0, 0, 1, 1, 2]


def test_mpi_algorithm_blocking_variant():
    """The "mpi" algorithm's MPI collectives follow MCRDL_MPI_BLOCKING like the "mpi"
    backend's: with "always" the blocking collective runs in both phases of a
    hierarchical group, on the caller's thread for blocking calls and on the issue thread
    for async ones; with "never" the nonblocking one. Results are checked either way. One
    launch: each mode is an init/finalize session."""
    env = dict(os.environ, MCRDL_RANKS_PER_NODE="2", MCRDL_TIMEOUT="60")
    cmd = [mpiexec_or_skip(), "-n", "4", sys.executable, os.path.join(HERE, "blocking_variant.py"),
           "always,never"]
    out = run_launcher(cmd, env=env, timeout=120)
    for mode in ("always", "never"):
        found = re.findall(rf"rank \d mode={mode} ok=(\w+) blocking_steps=(\d+) layout=2x2", out)
        assert len(found) == 4 and all(ok == "True" for ok, _ in found), out
        assert all((int(steps) > 0) == (mode == "always") for _, steps in found), out


def test_timeouts_and_a_failed_op():
    """tests/pccl/failures.py on a 2 x 2 world: a second init's timeout reaches every C++
    communicator (the inter-node one of hierarchical groups' delegated phases too), and
    after an op fails (a truncated receive: ranks passed different counts) the ops of its
    communicator behind it fail at once with its error instead of waiting out their
    timeout (7.5 s), while other communicators still work. Last, an async op queued
    behind one that timed out fails when waited, not after its own timeout."""
    env = dict(os.environ, MCRDL_RANKS_PER_NODE="2")
    cmd = [mpiexec_or_skip(), "-n", "4", sys.executable, os.path.join(HERE, "failures.py")]
    out = run_launcher(cmd, env=env, timeout=120)
    lines = re.findall(r"rank \d: timeouts .*", out)
    assert len(lines) == 4, out
    assert all(line.endswith("before=[60.0] after=[7.5] hierarchical=1, later 2 "
                             "after_new_group=[7.5]") for line in lines), out
    assert "rank 0: first op completed" in out, out
    first = re.search(r"rank 1: first op raised MCRDLError after ([\d.]+) s: (pccl all_gather "
                      r"failed: (?i:.*truncat).*)", out)
    assert first, out
    for which in ("behind", "later"):
        m = re.search(rf"rank 1: {which} op raised MCRDLError after ([\d.]+) s: pccl all_gather "
                      r"\(group 2 \[0, 1\]\) was not run: an earlier op of this communicator "
                      r"failed.*The first error: (.*)", out)
        assert m and float(m.group(1)) < 2.0 and m.group(2) == first.group(2), out
    assert len(re.findall(r"rank \d: world all_reduce ok=True", out)) == 4, out
    # an op behind one that timed out (2 s): refused when waited, not after 2 s more
    first = re.search(r"rank 1: timed-out first op raised CommTimeoutError after ([\d.]+) s: "
                      r"(all_gather on backend 'pccl' \(group 3 \[0, 1\], sequence number 1\) "
                      r"did not complete within 2 s.*)", out)
    behind = re.search(r"rank 1: timed-out behind op raised BackendUnavailableError after "
                       r"([\d.]+) s: all_gather: backend 'pccl' is unusable since an earlier "
                       r"operation timed out.*Earlier: (.*)", out)
    assert first and behind and float(behind.group(1)) < 1.0, out
    assert behind.group(2) == first.group(2), out
    assert len(re.findall(r"rank \d: finalized", out)) == 4, out
