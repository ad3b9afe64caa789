"""The alpha-beta cost model by which the "pccl" backend chooses its inter-node
algorithm ("ring" or "rd") per call, fitted with the tuning package's relative
least-squares line fit (``mcrdl.tuning.model.fit_line``)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..tuning.model import fit_line


def _fold(p: int) -> tuple[int, int]:
    """(p2, f) of the cost model: the largest power of two <= p, and 1 when p is not one
    (recursive doubling/halving folds the extra ranks in and out)."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, int(p != p2)


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta model of the inter-node phase over p ranks, b bytes per rank's block:

        ring: (p - 1) (alpha + b beta_ring)
        rd:   (log2 p2 + 2 f) alpha + (p - 1) b beta_rd (1 + f)

    p2 is the largest power of two <= p and f = 1 when p != p2 (the fold and unfold
    steps move the data once more). Fitted by ``benchmarks/pccl.py`` on the 2-core
    machines; ``MCRDL_PCCL_MODEL="alpha,beta_ring,beta_rd"`` (seconds, seconds per byte)
    replaces the coefficients."""

    alpha: float = 6.0e-6
    beta_ring: float = 2.0e-10
    beta_rd: float = 2.6e-10

    @classmethod
    def from_env(cls) -> CostModel:
        text = os.environ.get("MCRDL_PCCL_MODEL")
        if not text:
            return cls()
        try:
            a, br, bd = (float(x) for x in text.split(","))
        except ValueError:
            raise InvalidArgumentError(
                f"MCRDL_PCCL_MODEL={text!r}: expected three numbers 'alpha,beta_ring,beta_rd' "
                "(seconds and seconds per byte)") from None
        return cls(a, br, bd)

    @classmethod
    def fit(cls, p: int, sizes: Sequence[int], ring_s: Sequence[float],
            rd_s: Sequence[float]) -> CostModel:
        """The model of measured flat all_gathers over `p` ranks: seconds `ring_s` and
        `rd_s` at `sizes` bytes per block. alpha and beta_ring come from the ring's line,
        beta_rd from the slope of rd's. The lines are fitted on the relative error: sizes
        span 1 KiB to 16 MiB, and plain least squares would let the largest times set the
        intercept."""
        if p < 2 or not len(sizes) == len(ring_s) == len(rd_s) >= 2:
            raise InvalidArgumentError(
                f"CostModel.fit: need p >= 2 (got {p}) and at least two sizes with a time "
                f"for each algorithm (got {len(sizes)}, {len(ring_s)}, {len(rd_s)})")
        _, f = _fold(p)
        a_ring, b_ring = fit_line(sizes, ring_s)
        _, b_rd = fit_line(sizes, rd_s)
        return cls(alpha=a_ring / (p - 1), beta_ring=b_ring / (p - 1),
                   beta_rd=b_rd / ((p - 1) * (1 + f)))

    def ring(self, p: int, b: float) -> float:
        return (p - 1) * (self.alpha + b * self.beta_ring)

    def rd(self, p: int, b: float) -> float:
        p2, f = _fold(p)
        return (math.log2(p2) + 2 * f) * self.alpha + (p - 1) * b * self.beta_rd * (1 + f)

    def choose(self, p: int, b: float) -> str:
        return "rd" if self.rd(p, b) <= self.ring(p, b) else "ring"

    def crossover(self, p: int) -> float | None:
        """Bytes per block above which ring is predicted faster (None: never)."""
        p2, f = _fold(p)
        slope = (p - 1) * (self.beta_rd * (1 + f) - self.beta_ring)
        gain = self.alpha * ((p - 1) - (math.log2(p2) + 2 * f))
        if slope <= 0:
            return None if gain >= 0 else 0.0
        return max(0.0, gain / slope)
