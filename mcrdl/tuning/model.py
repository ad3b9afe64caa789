"""The alpha-beta (latency-bandwidth) cost model of one (backend, operation).

A call of ``op`` over ``p`` ranks on a buffer of ``n`` bytes costs

    t(p, n) = alpha * A(op, p) + beta * B(op, p) * n          (seconds)

``alpha`` is the latency of one communication step (seconds), ``beta`` the inverse
bandwidth (seconds per byte); both are fitted per (backend, op) from a tuning table's
measurements. ``n`` is the size column of ``mcrdl-bench`` and of the tuning tables: the
bytes of the largest buffer one rank touches (the reduced buffer; the gathered output of
all_gather/gather; the input of reduce_scatter/scatter; the send buffer of all_to_all).

The coefficients are the operation specs' (``mcrdl.ops.OPS[op].latency_steps`` and
``.bus_factor``). Chosen (``L = ceil(log2 p)``): the textbook costs of MPICH's algorithms
(Thakur, Rabenseifner and Gropp 2005). Other libraries' algorithms differ (Gloo's ring
all_reduce has A = 2 (p - 1)): alpha absorbs constant factors but not a different shape
in p, which is why a tuning table uses the model only beyond its measured points and
anchors it there (``TuningTable.predict``):

    op                                            A(op, p)   B(op, p)
    all_reduce (recursive doubling/Rabenseifner)  2 L        2 (p - 1) / p
    reduce, bcast, broadcast (binomial tree)      L          1
    gather(v), scatter(v) (binomial tree)         L          (p - 1) / p
    all_gather(v), reduce_scatter (ring)          p - 1      (p - 1) / p
    all_to_all, all_to_all_single, all_to_allv    p - 1      (p - 1) / p
    barrier (dissemination)                       L          0
    send, recv (point to point)                   1          1

``A`` is at least 1: a call costs at least one latency even on one rank, which keeps
the model positive at ``p = 1``. Ops measured with several copies in flight (the tuning
suite's ``"<op>@overlap<K>"`` rows) use the coefficients of ``<op>``.

The fit minimises the *relative* error (each least-squares row divided by its measured
time), so 8-byte and 64-MiB messages weigh the same, under ``alpha, beta >= 0``; the
two-parameter non-negative least squares is solved exactly (the unconstrained optimum
when it is feasible, else the best point on the faces ``alpha = 0`` / ``beta = 0``).
``fit_line`` fits a plain line ``a + b x`` the same way.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from ..ops import ALIASES, OPS, OpSpec

Sample = tuple[int, int, float]  # (group size, bytes, seconds)


def base_op(op: str) -> str:
    """The operation a table row measures: ``"all_reduce@overlap4"`` -> ``"all_reduce"``."""
    return op.split("@", 1)[0]


def _spec(op: object) -> OpSpec | None:
    if not isinstance(op, str):
        return None
    name = base_op(op)
    return OPS.get(ALIASES.get(name, name))


def is_modelled(op: str) -> bool:
    """Whether :func:`coefficients` knows ``op`` (or its base op)."""
    return _spec(op) is not None


def coefficients(op: str, group_size: int) -> tuple[float, float]:
    """``(A, B)`` of ``op`` at ``group_size`` ranks (see the module docstring)."""
    spec = _spec(op)
    if spec is None:
        raise InvalidArgumentError(
            f"no alpha-beta model for operation {op!r}; expected one of {sorted(OPS)} "
            "(optionally with an '@...' suffix)")
    p = _check_group_size(group_size)
    return max(float(spec.latency_steps(p)), 1.0), float(spec.bus_factor(p))


@dataclass(frozen=True)
class AlphaBeta:
    """``t(p, n) = alpha * A(op, p) + beta * B(op, p) * n``: alpha in seconds, beta in
    seconds per byte. ``op`` picks the coefficients; the default (point to point) is the
    plain Hockney model ``alpha + beta * n``."""

    alpha: float
    beta: float
    op: str = "send"

    def predict(self, group_size: int, nbytes: int) -> float:
        """Predicted seconds of one call over ``group_size`` ranks on ``nbytes`` bytes."""
        a, b = coefficients(self.op, group_size)
        return self.alpha * a + self.beta * b * nbytes


def fit(op: str, samples: Iterable[Sample]) -> AlphaBeta:
    """Fit alpha, beta >= 0 of ``op`` to ``samples`` ``(group_size, nbytes, seconds)``,
    minimising the sum of squared relative errors. Samples of 0 seconds carry no relative
    error and are skipped; with no usable sample the model is ``alpha = beta = 0``."""
    rows = [(a, b * n, t) for a, b, n, t in _check_samples(op, samples) if t > 0]
    if not rows:
        return AlphaBeta(0.0, 0.0, op)
    alpha, beta = _fit_relative(rows)
    return AlphaBeta(alpha, beta, op)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)``, both >= 0, of the line ``y = a + b x`` through the points ``(xs, ys)``
    minimising the sum of squared relative errors (``fit`` with ``A = B = 1``). With one
    distinct ``x`` there is no slope to fit: the best constant, ``b = 0``. Every ``y``
    must be positive (a relative error needs it)."""
    if len(xs) != len(ys) or not ys:
        raise InvalidArgumentError(
            f"fit_line: expected as many xs as ys, at least one (got {len(xs)} and {len(ys)})")
    if any(y <= 0 for y in ys):
        raise InvalidArgumentError(f"fit_line: times must be positive, got {list(ys)}")
    if len(set(xs)) == 1:
        return _fit_relative([(1.0, 0.0, y) for y in ys])
    return _fit_relative([(1.0, x, y) for x, y in zip(xs, ys, strict=True)])


def holdout_error(op: str, samples: Iterable[Sample],
                  holdout: Iterable[Sample] | Callable[[int, int, float], bool]) -> dict:
    """Fit on ``samples`` minus ``holdout`` and measure the relative error
    ``|predicted - measured| / measured`` on the held-out samples.

    ``holdout`` is either samples (those equal to one of ``samples`` are left out of the
    fit) or a predicate ``(group_size, nbytes, seconds) -> bool`` choosing them among
    ``samples``. Returns ``{"median_rel_err", "max_rel_err", "n", "alpha", "beta"}``
    (errors as fractions, NaN when no held-out sample has a positive time; ``n`` counts
    those evaluated)."""
    samples = [tuple(s) for s in samples]
    if callable(holdout):
        held = [s for s in samples if holdout(*s)]
        train = [s for s in samples if not holdout(*s)]
    else:
        held = [tuple(s) for s in holdout]
        leave_out = set(held)
        train = [s for s in samples if s not in leave_out]
    if not train:
        raise InvalidArgumentError(f"holdout_error({op!r}): every sample is held out; "
                                   "expected at least one sample left to fit")
    model = fit(op, train)
    rows = [(g, n, t) for g, n, t in _check_samples(op, held, raw=True) if t > 0]
    errs = [abs(model.predict(g, n) - t) / t for g, n, t in rows]
    return {
        "median_rel_err": statistics.median(errs) if errs else math.nan,
        "max_rel_err": max(errs) if errs else math.nan,
        "n": len(errs),
        "alpha": model.alpha,
        "beta": model.beta,
    }


def _fit_relative(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(u, v) >= 0`` minimising the sum over rows ``(c, d, t)`` (``t > 0``) of
    ``((u c + v d - t) / t) ** 2``: least squares of the relative error, so that small
    and large times weigh the same."""
    x = np.array([[c / t, d / t] for c, d, t in rows], dtype=np.float64)
    y = np.ones(len(rows))
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale  # unit columns: alpha ~ 1e-6 and beta ~ 1e-10 are solved equally well
    w = _nnls2(xs, y) / scale
    return float(w[0]), float(w[1])


def _nnls2(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x w - y|| over w >= 0 for two columns, exactly."""
    w = np.linalg.lstsq(x, y, rcond=None)[0]
    if (w >= 0).all():
        return w
    candidates = [np.zeros(2)]
    for j in range(2):
        col = x[:, j]
        norm2 = float(col @ col)
        if norm2 > 0:
            c = np.zeros(2)
            c[j] = max(0.0, float(col @ y) / norm2)
            candidates.append(c)
    return min(candidates, key=lambda c: float(np.sum((x @ c - y) ** 2)))


def _check_group_size(group_size, where: str = "") -> int:
    try:
        p = operator.index(group_size)
    except TypeError:
        p = None
    if p is None or isinstance(group_size, bool) or p < 1:
        raise InvalidArgumentError(
            f"{where}group size must be an integer >= 1, got {group_size!r}")
    return p


def _check_samples(op: str, samples: Iterable[Sample], raw: bool = False) -> list:
    """Validated samples as (A, B, nbytes, seconds) rows, or (p, nbytes, seconds) if raw."""
    rows = []
    for i, s in enumerate(samples):
        try:
            p, n, t = s
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"sample {i} of {op!r}: expected (group_size, nbytes, seconds), got {s!r}"
            ) from None
        p = _check_group_size(p, f"sample {i} of {op!r}: ")
        if isinstance(n, bool) or not _is_int(n) or n < 0:
            raise InvalidArgumentError(
                f"sample {i} of {op!r}: nbytes must be an integer >= 0, got {n!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating, np.integer)) \
                or not math.isfinite(t) or t < 0:
            raise InvalidArgumentError(
                f"sample {i} of {op!r}: seconds must be a finite number >= 0, got {t!r}")
        if raw:
            rows.append((p, int(n), float(t)))
        else:
            a, b = coefficients(op, p)
            rows.append((a, b, int(n), float(t)))
    return rows


def _is_int(v) -> bool:
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


__all__: Sequence[str] = ["AlphaBeta", "base_op", "coefficients", "fit", "fit_line",
                          "holdout_error", "is_modelled"]
