"""The layout planner: which engine and degrees to run a model on a machine one may not
have, from the engines' memory models and the communication models.

    python -m training.plan --model gpt-20b --world-size 32 --network perlmutter [--top 10]

- ``network``: ``Machine`` (GPUs per node, memory, peak flop rate, alpha-beta per
  level), ``load_machine`` (shipped descriptions in ``networks/``, a JSON file, or
  ``ALPHA_US,GBPS:ALPHA_US,GBPS``).
- ``memory``: bytes per GPU of each engine's layouts (pipeline, 4D, TED).
- ``planner``: ``Problem``, ``plan`` (every layout, feasible ones ranked by predicted
  step time), ``explain_infeasible``.
"""

from .memory import grid_memory, grid_params, parse_bytes, pipeline_memory, stage_params, ted_memory
from .network import Machine, PlanError, load_machine, shipped
from .planner import Candidate, Plan, Problem, Rejected, explain_infeasible, model_flops, plan

__all__ = ["Candidate", "Machine", "Plan", "PlanError", "Problem", "Rejected",
           "explain_infeasible", "grid_memory", "grid_params", "load_machine", "model_flops",
           "parse_bytes", "pipeline_memory", "plan", "shipped", "stage_params", "ted_memory"]
