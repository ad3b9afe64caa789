"""Per-phase wall-clock accounting: compute, p2p, bubble, collective, optimizer, other."""

from __future__ import annotations

import time
from contextlib import contextmanager

PHASES = ("compute", "p2p", "bubble", "collective", "optimizer", "other")


class PhaseTimers:
    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)

    def add(self, phase: str, seconds: float) -> None:
        """Add to `phase` (PHASES, or an engine's own, e.g. the 4D engine's "exposed x")."""
        self.totals[phase] = self.totals.get(phase, 0.0) + seconds

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0.0

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


class NullTimers(PhaseTimers):
    """Timers that record nothing (for code used outside a training loop)."""

    def add(self, phase: str, seconds: float) -> None:
        pass
