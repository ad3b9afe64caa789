"""The machine as the model sees it: latency per collective, bandwidth per grid axis.

One call of ``op`` over ``p`` ranks on ``n`` bytes (the log's size convention) costs

    t = alpha(op) * A(op, p) + B(op, p) * n / (beta(axis) * rate(op))      (seconds)

with ``A``, ``B`` the latency steps and bandwidth factors of ``mcrdl.tuning.model``
(all_reduce: 2 ceil(log2 p) and 2 (p-1)/p; all_gather, reduce_scatter: p - 1 and
(p-1)/p), so that with alpha = 0 and rate = 1 the terms are the dissertation's Eq.
5.1-5.5. ``rate(op)`` (default 1, as on GPUs where every op runs at the ring's speed)
is the op's speed relative to all_reduce where the library's algorithm or the
reduction's arithmetic differ: CPU MPI here reduce-scatters at ~0.6 of its all_reduce
rate.

``beta(axis)``, the bandwidth of one group's ring while every group of that axis runs
at once, is Eq. 5.7: the axes nest X (innermost), Y, Z, data over nodes of
``ranks_per_node`` consecutive ranks. With ``inner`` the product of the degrees inside
axis i, the groups of axis i stay within nodes when ``inner * G_i`` divides
``ranks_per_node``; then beta comes from ``intra_node_table[(inner, G_i)]`` (measured
concurrent collectives) or ``intra_node_bandwidth``. Otherwise each node sends the
traffic of ``min(ranks_per_node, inner)`` groups through its network links at once:
``beta = inter_node_bandwidth / min(ranks_per_node, inner)``.

Where the degrees divide the node size this is the paper's rule (an axis is
intra-node when ``inner * G_i <= ranks_per_node``). Elsewhere it departs from it on
purpose: with nodes of 8, groups of 3 consecutive ranks straddle node boundaries
(ranks 6-8), and the straddling group's ring runs at the network's speed, which the
paper's rule would price at the node's. The nesting is ``--grid-order``'s default (X
the fastest-varying rank index); a ranking is for that order only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mcrdl.tuning.model import coefficients
from mcrdl.tuning.table import TuningTable

from .collectives import OPS, Collective
from .step import AXES, WORLD, Grid4D

#: Defaults: a GPU node with 4 GPUs on NVLink and 4 x 25 GB/s network links (Perlmutter's
#: shape), NCCL-like latency. Absolute times scale with these; rankings mostly do not.
DEFAULT_INTRA_NODE_BANDWIDTH = 100e9
DEFAULT_INTER_NODE_BANDWIDTH = 100e9
DEFAULT_LATENCY = 5e-6


@dataclass(frozen=True)
class Network:
    """Latency and bandwidths of the machine (see the module docstring). Bandwidths in
    bytes per second (``inter_node_bandwidth``: out of one node, all its links together);
    ``latency``: seconds per latency step, one number for every op or one per op
    (all_reduce, all_gather, reduce_scatter); ``op_rate``: each op's bandwidth relative
    to the axis's, one number or one per op; ``intra_node_table``: ``{(inner, G_i):
    bytes per second}``. ``latency`` and ``op_rate`` are stored as mappings by op."""

    ranks_per_node: int
    intra_node_bandwidth: float = DEFAULT_INTRA_NODE_BANDWIDTH
    inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH
    latency: float | Mapping[str, float] = DEFAULT_LATENCY
    op_rate: float | Mapping[str, float] = 1.0
    intra_node_table: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.ranks_per_node, int) or isinstance(self.ranks_per_node, bool) \
                or self.ranks_per_node < 1:
            raise ValueError(f"Network: ranks_per_node={self.ranks_per_node!r}; expected a "
                             "positive integer")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            _check_positive(f"Network: {name}", getattr(self, name))
        latency = _by_op("latency", self.latency)
        for op, alpha in latency.items():
            if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) \
                    or not 0 <= alpha < float("inf"):
                raise ValueError(f"Network: latency of {op} is {alpha!r}; expected seconds >= 0")
        rate = _by_op("op_rate", self.op_rate)
        for op, r in rate.items():
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r < float("inf"):
                raise ValueError(f"Network: op_rate of {op} is {r!r}; expected a number > 0 "
                                 "(1: the axis's bandwidth)")
        table = dict(self.intra_node_table)
        for key, bandwidth in table.items():
            if not (isinstance(key, tuple) and len(key) == 2
                    and all(isinstance(k, int) and k >= 1 for k in key)):
                raise ValueError(f"Network: intra_node_table key {key!r}; expected (product of "
                                 "the inner degrees, the axis degree), positive integers")
            _check_positive(f"Network: intra_node_table[{key}]", bandwidth)
        object.__setattr__(self, "latency", MappingProxyType(latency))
        object.__setattr__(self, "op_rate", MappingProxyType(rate))
        object.__setattr__(self, "intra_node_table", MappingProxyType(table))

    @classmethod
    def from_tuning_table(cls, table: TuningTable, ranks_per_node: int, *,
                          intra_node_bandwidth: float = DEFAULT_INTRA_NODE_BANDWIDTH,
                          inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH,
                          intra_node_table: Mapping[tuple[int, int], float] | None = None
                          ) -> Network:
        """Latency and op rates from a tuning table's alpha-beta fits
        (``TuningTable.model``), the best over its backends as ``"auto"`` picks the
        fastest per call: alpha(op) the smallest alpha, rate(op) the largest bandwidth
        1 / beta relative to all_reduce's. Ops the table lacks keep DEFAULT_LATENCY and
        rate 1. The bandwidths are arguments: a table, measured on one system at a few
        group sizes, says nothing about nodes."""
        latency, speed = {}, {}
        for op in OPS:
            fits = [table.model(op, b) for b in table.backends(op)]
            latency[op] = min((f.alpha for f in fits), default=DEFAULT_LATENCY)
            speed[op] = max((1 / f.beta for f in fits if f.beta > 0), default=None)
        if speed["all_reduce"] is None:
            rate = dict.fromkeys(OPS, 1.0)
        else:
            rate = {op: 1.0 if s is None else s / speed["all_reduce"] for op, s in speed.items()}
        return cls(ranks_per_node, intra_node_bandwidth, inter_node_bandwidth, latency, rate,
                   {} if intra_node_table is None else intra_node_table)

    def axis_bandwidths(self, grid: Grid4D) -> dict[str, float]:
        """Eq. 5.7: bytes per second of one group's ring on each axis (and the world)."""
        out = {}
        inner = 1
        for axis in AXES:
            out[axis] = self._bandwidth(inner, grid.degree(axis))
            inner *= grid.degree(axis)
        out[WORLD] = self._bandwidth(1, grid.size)
        return out

    def _bandwidth(self, inner: int, degree: int) -> float:
        if self.ranks_per_node % (inner * degree) == 0:
            return self.intra_node_table.get((inner, degree), self.intra_node_bandwidth)
        return self.inter_node_bandwidth / min(self.ranks_per_node, inner)

    def seconds(self, c: Collective, grid: Grid4D,
                bandwidths: Mapping[str, float] | None = None) -> float:
        """Predicted seconds of all ``c.count`` calls of ``c`` on ``grid`` (pass
        ``axis_bandwidths(grid)`` when pricing many entries of one grid)."""
        if bandwidths is None:
            bandwidths = self.axis_bandwidths(grid)
        a, b = coefficients(c.op, grid.degree(c.axis))
        return c.count * (self.latency[c.op] * a
                          + b * c.nbytes / (bandwidths[c.axis] * self.op_rate[c.op]))


def _by_op(name: str, value) -> dict[str, float]:
    """``value`` as {op: number}: one number for every op, or a mapping naming each."""
    out = dict(value) if isinstance(value, Mapping) else dict.fromkeys(OPS, value)
    if sorted(out) != sorted(OPS):
        raise ValueError(f"Network: {name} has ops {sorted(out)}; expected one number or "
                         f"exactly {', '.join(OPS)}")
    return out


def _check_positive(what: str, v) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
        raise ValueError(f"{what} is {v!r}; expected bytes per second > 0")
