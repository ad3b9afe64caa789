"""The communication performance model of the 4D hybrid-parallel GPT (issue 18).

AxoNN's 4D algorithm (Singh's dissertation, Eq. 5.1-5.7) parallelises every Linear layer
over a 3D grid (G_x, G_y, G_z) replicated over G_data data-parallel groups. This package
says which collectives one training step sends on a grid (``collectives``, the contract
the 4D engine is written against), predicts their time on a machine (``Network``: latency
per op, bandwidth per axis by Eq. 5.7) and ranks every grid of a world before anyone runs
it (``rank_grids``; ``python -m training.parallel4d.perf_model`` prints the ranking).

- ``step``: ``Grid4D``, ``TrainingStep``, the GPT's ``linear_layers``, feasibility
  (``constraint_violations``, ``check_grid``), ``grids(ranks)``.
- ``collectives``: the step's collectives with sizes and counts, ``call_counts``.
- ``network``: ``Network`` (Eq. 5.7 bandwidths, alpha-beta time of a collective).
- ``ranking``: ``predict``, ``rank_grids``.
"""

from .collectives import Collective, call_counts, collectives, linear_collectives
from .network import Network
from .ranking import Prediction, Ranking, Skipped, predict, rank_grids
from .step import (
    AXES,
    WORLD,
    Grid4D,
    LinearLayer,
    TrainingStep,
    check_grid,
    constraint_violations,
    grids,
    linear_layers,
)

__all__ = ["AXES", "WORLD", "Collective", "Grid4D", "LinearLayer", "Network", "Prediction",
           "Ranking", "Skipped", "TrainingStep", "call_counts", "check_grid", "collectives",
           "constraint_violations", "grids", "linear_collectives", "linear_layers", "predict",
           "rank_grids"]
