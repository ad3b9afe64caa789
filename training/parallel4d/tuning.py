"""NN/NT/TN matmul tuning (--tune-matmul): the fastest operand layout per (phase, m, n, k).

Each Linear layer runs three matmuls C = A B: the forward (A = I [t, k], B = W^T), the
input gradient (A = dO, B = W) and the weight gradient (A = dO^T, B = I). A mode names
the memory layout each operand is handed to the kernel in: N, row-major contiguous; T,
a transposed view of a contiguous tensor (column-major). Presenting an operand in the
other layout than it has costs a copy, which is timed with the kernel. TT is left out,
as in AxoNN.

During the first step every (phase, m, n, k) met is computed in its natural layout
(forward NT, input gradient NN, weight gradient TN; what torch does without tuning) for
the result, and each mode is timed on the side (`timer`, replaceable for tests). After
the step ``agree()`` (collective over the run's ranks) sums every rank's timings and
every rank takes the mode with the least total: ranks that compute replicated values
must use the same kernels, so the decision cannot be local. From then on each shape
uses its decided mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import mcrdl

MODES = ("NN", "NT", "TN")
PHASES = ("forward", "input_grad", "weight_grad")
NATURAL = {"forward": "NT", "input_grad": "NN", "weight_grad": "TN"}


def _as(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t` (mathematically the same matrix) in memory layout N or T."""
    if layout == "N":
        return t.contiguous()
    return t.t().contiguous().t()


def matmul(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """a @ b with the operands in `mode`'s layouts; a contiguous result."""
    return (_as(a, mode[0]) @ _as(b, mode[1])).contiguous()


def wall_timer(phase: str, mode: str, fn: Callable[[], torch.Tensor]) -> float:
    """Seconds of the best of 3 runs of `fn` (after one warm-up run)."""
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class MatmulTuner:
    """The kernel chooser layers call through ``TensorComms.kernels`` (module docstring).
    `timer(phase, mode, fn) -> seconds`; `group`: the ranks that agree (None: world)."""

    def __init__(self, timer: Callable = wall_timer, group: mcrdl.Group | None = None):
        self.timer, self.group = timer, group
        self.timings: dict[tuple, dict[str, float]] = {}  # (phase, m, n, k) -> mode -> s
        self.decided: dict[tuple, str] = {}
        self.max_mode_diff = 0.0  # largest |mode - natural| seen while timing

    def _run(self, phase: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        key = (phase, a.shape[0], b.shape[1], a.shape[1])
        mode = self.decided.get(key)
        if mode is not None:
            return matmul(a, b, mode)
        out = matmul(a, b, NATURAL[phase])
        if key not in self.timings:
            times = {}
            with torch.no_grad():
                for m in MODES:
                    times[m] = self.timer(phase, m, lambda m=m: matmul(a, b, m))
                    diff = (matmul(a, b, m) - out).abs().max().item() if out.numel() else 0.0
                    self.max_mode_diff = max(self.max_mode_diff, diff)
            self.timings[key] = times
        return out

    def forward(self, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._run("forward", inp, w.t())

    def input_grad(self, dout: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._run("input_grad", dout, w)

    def weight_grad(self, dout: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        return self._run("weight_grad", dout.t(), inp)

    @property
    def pending(self) -> bool:
        """Whether shapes were timed but not yet decided."""
        return any(k not in self.decided for k in self.timings)

    def agree(self) -> dict[tuple, str]:
        """Collective over the group: decide every timed shape from the sum of all
        ranks' timings (ties: the order of MODES), the same on every rank. The timings
        travel over mcrdl's object channel (bookkeeping, not the backends' lanes)."""
        mine = {k: v for k, v in self.timings.items() if k not in self.decided}
        everyone = mcrdl.all_gather_object(mine, group=self.group)
        keys = sorted(set().union(*everyone))
        for key in keys:
            total = {m: sum(t[key][m] for t in everyone if key in t) for m in MODES}
            self.decided[key] = min(MODES, key=lambda m: total[m])
        return dict(self.decided)
