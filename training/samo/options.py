"""The options of magnitude pruning and SAMO (``--prune-sparsity``, ``--samo``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.options import Options, option
from .pruning import SCOPES, check_sparsity, parse_schedule


@dataclass
class SamoOptions(Options):
    """Magnitude pruning (training/samo/pruning.py) and SAMO's compressed model states
    (training/samo/optimizer.py). Its rules read --offload-optimizer and --steps."""

    section = "samo"
    samo: bool = option(False, "store theta32, the gradients and the Adam states compressed "
                        "over the unpruned entries (needs --prune-sparsity)")
    prune_sparsity: float | None = option(None, "fraction of the parameters pruned by "
                                          "magnitude, in [0, 1); without --samo: dense "
                                          "masked training")
    prune_schedule: str | None = option(None, "steps before which to prune, e.g. 0,100,200; "
                                        "round k of n reaches 1-(1-p)^(k/n) (default 0)")
    prune_scope: str = option("global", "one magnitude threshold for the whole model, or "
                              "one per tensor", choices=SCOPES)

    def check(self) -> None:
        if self.prune_sparsity is None:
            if self.samo or self.prune_schedule is not None:
                raise ValueError(f"{'--samo' if self.samo else '--prune-schedule'} needs "
                                 "--prune-sparsity (the fraction of the parameters pruned, "
                                 "e.g. 0.9)")
            return
        check_sparsity(self.prune_sparsity)
        last = parse_schedule(self.prune_schedule, self.prune_sparsity)[-1].step
        if last >= self.steps:
            raise ValueError(f"--prune-schedule {self.prune_schedule!r}: a round before step "
                             f"{last} never runs in a run of --steps {self.steps}; expected "
                             f"steps below {self.steps}")
        if self.samo and self.offload_optimizer:
            raise ValueError("--samo with --offload-optimizer: SAMO keeps its own compressed "
                             "fp32 master weights and Adam states, and --offload-optimizer "
                             "only picks the dense fp32 optimizers' layout; drop it")
