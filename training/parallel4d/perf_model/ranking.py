"""Predict one step's communication time on a grid, and rank every grid of a world.

``rank_grids`` prices every (G_x, G_y, G_z, G_data) whose product is the world size and
that fits the step (Eq. 5.6 over the step's collectives, with latency), and orders them
fastest first. Ties are broken deterministically: predicted times equal to 12
significant digits (so that summation order cannot reorder them) go by fewer calls per
step (less latency the model may underrate), then by (G_x, G_y, G_z, G_data) ascending.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .collectives import Collective, collectives
from .network import Network
from .step import Grid4D, TrainingStep, constraint_violations, grids


@dataclass(frozen=True)
class Prediction:
    """Predicted communication of one step on ``grid``: ``seconds`` in all, and each
    collective entry with its seconds (all its calls)."""

    grid: Grid4D
    seconds: float
    entries: tuple[tuple[Collective, float], ...]

    @property
    def calls(self) -> int:
        """Collective calls per step per rank."""
        return sum(c.count for c, _ in self.entries)

    def by_op_axis(self) -> dict[tuple[str, str], float]:
        """Predicted seconds per (op, axis)."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        for c, s in self.entries:
            out[c.op, c.axis] += s
        return dict(out)

    def sort_key(self) -> tuple:
        return (float(f"{self.seconds:.12g}"), self.calls, self.grid.as_tuple())


@dataclass(frozen=True)
class Skipped:
    """A grid that cannot run the step, and every constraint it breaks."""

    grid: Grid4D
    violations: tuple[tuple[str, str], ...]  # (constraint, message)


@dataclass(frozen=True)
class Ranking:
    ranked: tuple[Prediction, ...]  # fastest first
    skipped: tuple[Skipped, ...]    # in grid order


def predict(step: TrainingStep, grid: Grid4D, network: Network) -> Prediction:
    """The predicted communication of one step of ``step`` on ``grid``; a grid the step
    does not fit raises GridError (``check_grid``)."""
    bandwidths = network.axis_bandwidths(grid)
    entries = tuple((c, network.seconds(c, grid, bandwidths)) for c in collectives(step, grid))
    return Prediction(grid, sum(s for _, s in entries), entries)


def rank_grids(step: TrainingStep, ranks: int, network: Network, *,
               min_model_parallel: int = 1) -> Ranking:
    """Every grid of ``ranks`` ranks: those that fit ranked by predicted time (ties as in
    the module docstring), the others with their reasons. ``min_model_parallel``: skip
    grids that shard the model over fewer than this many ranks (G_x G_y G_z), AxoNN's way
    of keeping out grids whose parameters cannot fit in a rank's memory (the model
    prices communication only)."""
    ranked, skipped = [], []
    for grid in grids(ranks):
        violations = constraint_violations(step, grid)
        shards = grid.x * grid.y * grid.z
        if shards < min_model_parallel:
            violations.append(("model parallel", f"G_x*G_y*G_z={shards} is below the minimum "
                                                 f"model-parallel degree {min_model_parallel}"))
        if violations:
            skipped.append(Skipped(grid, tuple(violations)))
        else:
            ranked.append(predict(step, grid, network))
    ranked.sort(key=Prediction.sort_key)
    return Ranking(tuple(ranked), tuple(skipped))
