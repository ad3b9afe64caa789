"""Tuning tables: measured times per (op, group size, backend, bytes), and the lookup
``"auto"`` routes by.

A table holds what ``mcrdl-tune run`` measured, with the provenance of the measurement
(host, CPU/GPU model, library versions, date, command: ``provenance.py``). Its JSON
document (``tuning_tables/README.md``) is ``schema.py``'s. Lookups predict each
backend's time for a call and pick the fastest:

- at a measured size and group size: the measured time;
- between measured sizes: log-log interpolation (linear on a segment starting at 0 B);
- between measured group sizes: log-log interpolation in the group size of the
  predictions at the two neighbouring measured group sizes;
- outside the measured sizes or group sizes: the alpha-beta model of (backend, op)
  (``model.py``, fitted to all of that backend's points of the op), anchored at the
  nearest measured point: ``t = t_edge * model(query) / model(edge)``, so predictions
  are continuous at the edge and follow the model's growth beyond it.

``lookup`` caches its answers (bounded dict), so a repeated call costs a dict lookup.
Nothing here does I/O except ``load`` and ``save``.

For the mpi backends a table also records how their blocking calls run (the blocking
MPI collective or the nonblocking one and a bounded wait, ``schema.VARIANTS``): the time
of each variant (``add_variant``; the backend's time is the faster one) and, per (op,
group size), the (largest bytes, variant) steps its communicators run
(``blocking_steps``), derived from the variant times unless set by hand.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import operator
import os
from collections.abc import Iterable

from ..errors import InvalidArgumentError
from . import model as _model
from . import provenance as _provenance
from . import schema
from .schema import TuningTableError

_CACHE_MAX = 1 << 14  # lookup cache entries
_TINY = 1e-15  # seconds: floor of measured times in log space
_MISS = object()


class TuningTable:
    """Measured seconds per (op, group size, backend, bytes), plus provenance.

    ``op`` is an operation name of mcrdl.ops.OPS (the tuning suite also stores
    ``"<op>@overlap<K>"`` rows), ``group_size`` the number of ranks, ``nbytes`` the size
    column of ``mcrdl-bench`` (bytes of the largest buffer one rank touches).
    """

    def __init__(self, provenance: dict | None = None):
        self.provenance: dict = schema.check_provenance(
            {} if provenance is None else provenance, "<provenance>", "$.provenance")
        self._times: schema.Times = {}
        self._curves: dict[tuple[str, int, str], tuple[list[int], list[float]]] = {}
        self._gsizes: dict[tuple[str, str], list[int]] = {}
        self._models: dict[tuple[str, str], _model.AlphaBeta] = {}
        self._lookup_cache: dict[tuple, str | None] = {}
        self._variants: schema.VariantTimes = {}
        self._steps: dict[tuple[str, int, str], schema.Steps] = {}
        self._confirmed: set[tuple[str, int, int]] = set()

    # -- building -------------------------------------------------------------------

    def add(self, op: str, group_size: int, backend: str, nbytes: int, seconds: float) -> None:
        """Record one measured point (seconds per call); re-adding a point replaces it."""
        where = f"add({op!r}, {group_size!r}, {backend!r}, {nbytes!r}, {seconds!r})"
        self._set(op, *_checked(where, op, group_size, backend, nbytes, seconds))

    def add_variant(self, op: str, group_size: int, backend: str, nbytes: int, variant: str,
                    seconds: float) -> None:
        """Record the time of one variant (schema.VARIANTS) of a blocking call of an mpi
        backend. The backend's time at that size becomes the fastest variant measured
        there (what its blocking call runs), and steps set by hand for this curve give way
        to the ones derived from the variant times."""
        where = (f"add_variant({op!r}, {group_size!r}, {backend!r}, {nbytes!r}, {variant!r}, "
                 f"{seconds!r})")
        if variant not in schema.op_variants(op):
            raise TuningTableError(f"{where}: variant must be one of "
                                   f"{', '.join(schema.op_variants(op))} for {op}")
        g, b, n, t = _checked(where, op, group_size, backend, nbytes, seconds)
        per_v = self._variants.setdefault((op, g, b), {})
        per_v.setdefault(variant, {})[n] = t
        self._steps.pop((op, g, b), None)
        self._set(op, g, b, n, min(pts[n] for pts in per_v.values() if n in pts))

    def set_blocking_steps(self, op: str, group_size: int, backend: str, steps) -> None:
        """Fix the (largest bytes, variant) steps of `backend`'s blocking calls of `op` at
        `group_size` (-1 bytes: no limit; larger sizes than the last step run
        nonblocking), instead of deriving them from the variant times."""
        where = f"set_blocking_steps({op!r}, {group_size!r}, {backend!r})"
        g, b, _, _ = _checked(where, op, group_size, backend, 0, 0.0)
        self._steps[op, g, b] = schema.check_steps(steps, where, "steps", op)

    def _set(self, op: str, g: int, backend: str, n: int, seconds: float) -> None:
        self._times.setdefault(op, {}).setdefault(g, {}).setdefault(backend, {})[n] = seconds
        self._curves.clear()
        self._gsizes.clear()
        self._models.clear()
        self._lookup_cache.clear()

    # -- queries --------------------------------------------------------------------

    def mark_confirmed(self, op: str, group_size: int, nbytes: int) -> None:
        """Record that the confirmation pass re-measured (op, group size, nbytes) on every
        backend (``mcrdl-tune run``; a resumed run skips it)."""
        self._confirmed.add((op, group_size, nbytes))

    def is_confirmed(self, op: str, group_size: int, nbytes: int) -> bool:
        return (op, group_size, nbytes) in self._confirmed

    def has(self, op: str, group_size: int, backend: str, nbytes: int) -> bool:
        """Whether this point was measured (the tuning suite skips it when resuming)."""
        return nbytes in self._times.get(op, {}).get(group_size, {}).get(backend, {})

    def times(self, op: str, group_size: int, backend: str) -> dict[int, float]:
        """``{bytes: seconds}`` measured for ``op`` on ``backend`` over ``group_size``
        ranks (a copy; empty when none)."""
        return dict(self._times.get(op, {}).get(group_size, {}).get(backend, {}))

    def has_variant(self, op: str, group_size: int, backend: str, nbytes: int,
                    variant: str) -> bool:
        """Whether this variant's point was measured (the suite skips it when resuming)."""
        return nbytes in self._variants.get((op, group_size, backend), {}).get(variant, {})

    def variant_times(self, op: str, group_size: int, backend: str) -> dict[str, dict[int, float]]:
        """``{variant: {bytes: seconds}}`` measured for the blocking calls of `op` on an
        mpi `backend` (a copy; empty when none)."""
        return {v: dict(pts) for v, pts in self._variants.get((op, group_size, backend),
                                                              {}).items()}

    def blocking_steps(self, op: str, group_size: int, backend: str) -> schema.Steps | None:
        """The (largest bytes, variant) steps of `backend`'s blocking calls of `op` at
        `group_size`: set by hand or read from the file, else derived from the variant
        times (:func:`derive_steps`); None without either."""
        key = (op, group_size, backend)
        steps = self._steps.get(key)
        if steps is None and key in self._variants:
            steps = derive_steps(self._variants[key])
        return None if steps is None else list(steps)

    def blocking_table(self, backend: str) -> dict[str, dict[int, schema.Steps]]:
        """``{op: {group size: steps}}`` of every curve of `backend` with steps: what
        mcrdl.backends.mpi.blocking_steps takes as its table."""
        out: dict[str, dict[int, schema.Steps]] = {}
        for op, g, b in sorted(set(self._steps) | set(self._variants)):
            steps = self.blocking_steps(op, g, b) if b == backend else None
            if steps:
                out.setdefault(op, {})[g] = steps
        return out

    def ops(self) -> list[str]:
        """Operations with at least one measured point, sorted."""
        return sorted(self._times)

    def group_sizes(self, op: str) -> list[int]:
        """Group sizes measured for ``op``, ascending."""
        return sorted(self._times.get(op, {}))

    def backends(self, op: str | None = None) -> list[str]:
        """Backends with measured points (of ``op``, or of any op), sorted."""
        ops = [op] if op is not None else list(self._times)
        return sorted({b for o in ops for per_b in self._times.get(o, {}).values()
                       for b in per_b})

    def points(self, op: str, group_size: int, backend: str) -> tuple[list[int], list[float]]:
        """The measured (sizes in bytes ascending, seconds) of one curve; empty if none."""
        sizes, times = self._curve(op, group_size, backend)
        return list(sizes), list(times)

    def samples(self, op: str, backend: str) -> list[tuple[int, int, float]]:
        """Every measured ``(group_size, nbytes, seconds)`` of (op, backend): the data of
        its alpha-beta model."""
        return [(g, n, t) for g, per_b in sorted(self._times.get(op, {}).items())
                for n, t in sorted(per_b.get(backend, {}).items())]

    def model(self, op: str, backend: str) -> _model.AlphaBeta | None:
        """The alpha-beta model of (backend, op) fitted to all its points (cached); None
        without data. Ops without a model of their own use the point-to-point one."""
        key = (op, backend)
        fitted = self._models.get(key)
        if fitted is None:
            samples = self.samples(op, backend)
            if not samples:
                return None
            fitted = _model.fit(op if _model.is_modelled(op) else "send", samples)
            self._models[key] = fitted
        return fitted

    def winners(self, op: str, group_size: int) -> list[tuple[int, str]]:
        """``[(from_bytes, backend), ...]``: from each measured size on (up to the next
        entry), the backend with the lowest measured time (ties: first name)."""
        per_b = self._times.get(op, {}).get(group_size, {})
        out: list[tuple[int, str]] = []
        for n in sorted({n for pts in per_b.values() for n in pts}):
            _, best = min((pts[n], b) for b, pts in per_b.items() if n in pts)
            if not out or out[-1][1] != best:
                out.append((n, best))
        return out

    def predict(self, op: str, group_size: int, nbytes: int, backend: str) -> float | None:
        """Predicted seconds of ``op`` on ``backend`` over ``group_size`` ranks and
        ``nbytes`` bytes (see the module docstring); None if the backend has no data for
        ``op``."""
        p = _index(group_size)
        n = _index(nbytes)
        if p is None or p < 1 or n is None or n < 0:
            raise InvalidArgumentError(
                f"predict({op!r}, {group_size!r}, {nbytes!r}, {backend!r}): expected a group "
                "size >= 1 and nbytes >= 0 (integers)")
        gs = self._backend_group_sizes(op, backend)
        if not gs:
            return None
        i = bisect.bisect_left(gs, p)
        if i < len(gs) and gs[i] == p:
            return self._at_group(op, p, backend, n)
        if 0 < i < len(gs):
            lo, hi = gs[i - 1], gs[i]
            return _interpolate(lo, self._at_group(op, lo, backend, n),
                                hi, self._at_group(op, hi, backend, n), p)
        edge = gs[0] if i == 0 else gs[-1]
        return self._extrapolate(op, backend, self._at_group(op, edge, backend, n),
                                 edge, n, p, n)

    def lookup(self, op: str, group_size: int, nbytes: int,
               backends: Iterable[str]) -> str | None:
        """The fastest of ``backends`` for this call by :meth:`predict`; None when none
        of them has data for ``op``. Cached: a repeated call is a dict lookup."""
        if backends.__class__ is not tuple and backends.__class__ is not frozenset:
            backends = _as_names(backends)
        key = (op, group_size, nbytes, backends)
        name = self._lookup_cache.get(key, _MISS)
        if name is _MISS:
            name = self._resolve(key)
        return name

    def _resolve(self, key: tuple) -> str | None:
        op, group_size, nbytes, backends = key
        best = None
        for b in backends:
            t = self.predict(op, group_size, nbytes, b)
            if t is not None and (best is None or (t, b) < best):
                best = (t, b)
        name = None if best is None else best[1]
        cache = self._lookup_cache
        if len(cache) >= _CACHE_MAX:
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del cache[next(iter(cache))]  # oldest entry
        cache[key] = name
        return name

    def _curve(self, op: str, g: int, backend: str) -> tuple[list[int], list[float]]:
        key = (op, g, backend)
        curve = self._curves.get(key)
        if curve is None:
            pts = sorted(self._times.get(op, {}).get(g, {}).get(backend, {}).items())
            curve = ([n for n, _ in pts], [t for _, t in pts])
            self._curves[key] = curve
        return curve

    def _backend_group_sizes(self, op: str, backend: str) -> list[int]:
        key = (op, backend)
        gs = self._gsizes.get(key)
        if gs is None:
            gs = sorted(g for g, per_b in self._times.get(op, {}).items() if per_b.get(backend))
            self._gsizes[key] = gs
        return gs

    def _at_group(self, op: str, p: int, backend: str, n: int) -> float:
        """Prediction at a measured group size ``p``."""
        sizes, times = self._curve(op, p, backend)
        j = bisect.bisect_left(sizes, n)
        if j < len(sizes) and sizes[j] == n:
            return times[j]
        if 0 < j < len(sizes):
            return _interpolate(sizes[j - 1], times[j - 1], sizes[j], times[j], n)
        e = 0 if j == 0 else -1
        return self._extrapolate(op, backend, times[e], p, sizes[e], p, n)

    def _extrapolate(self, op: str, backend: str, t_edge: float, p_edge: int, n_edge: int,
                     p: int, n: int) -> float:
        """The model's prediction at (p, n) scaled to pass through the measured edge."""
        m = self.model(op, backend)
        at_edge = m.predict(p_edge, n_edge)
        if not at_edge > 0:
            return t_edge
        return t_edge * m.predict(p, n) / at_edge

    # -- serialisation --------------------------------------------------------------

    def to_dict(self) -> dict:
        """The JSON document of this table (tuning_tables/README.md)."""
        steps = {k: self.blocking_steps(*k) for k in set(self._steps) | set(self._variants)}
        return schema.encode(self.provenance, self._times, self.winners, self._variants,
                             {k: st for k, st in steps.items() if st}, self._confirmed)

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> TuningTable:
        """Validate a JSON document and build its table; ``source`` names it in errors.
        ``winners`` is checked for shape only and re-derived from the times."""
        doc = schema.decode(d, source)
        table = cls(doc.provenance)
        for p in doc.points:
            if p.variant:
                key = (p.op, p.group_size, p.backend)
                table._variants.setdefault(key, {}).setdefault(p.variant, {})[p.nbytes] = p.seconds
            else:
                table._set(p.op, p.group_size, p.backend, p.nbytes, p.seconds)
        table._steps = dict(doc.steps)
        table._confirmed = set(doc.confirmed)
        return table

    def digest(self) -> str:
        """A hash of the table's contents (what :meth:`to_dict` writes): equal tables,
        equal digests, wherever they were loaded from."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self, path) -> None:
        """Write the table to ``path`` atomically (``schema.write``): an interrupted save
        leaves the previous file (if any) intact and no temporary file behind."""
        schema.write(path, self.to_dict())

    @classmethod
    def load(cls, path) -> TuningTable:
        """Read and validate the table at ``path`` (TuningTableError when unusable)."""
        return cls.from_dict(schema.read(path), source=os.fspath(path))

    # -- provenance -----------------------------------------------------------------

    def stale_reasons(self, current: dict) -> list[str]:
        """How the library versions of this table's provenance differ from ``current``
        (e.g. ``provenance.current_provenance()``); [] when they match. Keys missing or
        empty on either side are not compared."""
        return _provenance.stale_reasons(self.provenance, current)

    def __eq__(self, other) -> bool:
        if not isinstance(other, TuningTable):
            return NotImplemented
        return (self.provenance == other.provenance and self._times == other._times
                and self._variants == other._variants and self._confirmed == other._confirmed
                and all(self.blocking_steps(*k) == other.blocking_steps(*k)
                        for k in set(self._steps) | set(other._steps)))

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        npoints = sum(len(pts) for groups in self._times.values() for per_b in groups.values()
                      for pts in per_b.values())
        return (f"TuningTable({len(self._times)} ops, {npoints} points, "
                f"host={self.provenance.get('host', '?')!r})")


# -- helpers ------------------------------------------------------------------------


#: The order in which variants win ties: the nonblocking call first (its waits raise
#: CommTimeoutError), then the blocking call, then the allreduce formulation.
_TIE_ORDER = ("nonblocking", "blocking", "allreduce")


def variant_winners(per_variant: dict[str, dict[int, float]]) -> list[tuple[int, str]]:
    """(size, fastest variant) at each size where the blocking and the nonblocking variant
    were measured, in increasing size (a tie goes to the earlier in ``_TIE_ORDER``);
    empty when no size has both."""
    curves = {v: per_variant[v] for v in _TIE_ORDER if per_variant.get(v)}
    if "blocking" not in curves or "nonblocking" not in curves:
        return []
    sizes = sorted(set(curves["blocking"]) & set(curves["nonblocking"]))
    # `curves` keeps _TIE_ORDER, and min keeps the first of equal times
    return [(n, min((v for v in curves if n in curves[v]), key=lambda v: curves[v][n]))
            for n in sizes]


def derive_steps(per_variant: dict[str, dict[int, float]]) -> schema.Steps | None:
    """The (largest bytes, variant) steps of the fastest variant at each size where the
    blocking and the nonblocking variant were measured (:func:`variant_winners`). Between
    two measured sizes whose winners differ the step ends where the two winners'
    predictions cross (the interpolation of :meth:`TuningTable.predict`); the last step
    has no limit (-1). None when no size has the blocking and the nonblocking variant."""
    steps: schema.Steps = []
    prev = None
    for n, win in variant_winners(per_variant):
        if prev is not None and win != prev[1]:
            lo, a, b = prev[0], per_variant[prev[1]], per_variant[win]
            end = _crossover(lo, a[lo], b[lo], n, a[n], b[n]) if lo in b and n in a else lo
            steps[-1] = (end, steps[-1][1])
        if prev is None or win != prev[1]:
            steps.append((-1, schema.STEP_VALUES[win]))
        prev = (n, win)
    return steps or None


def _crossover(x0: int, b0: float, n0: float, x1: int, b1: float, n1: float) -> int:
    """The largest size in [x0, x1) on the side of x0 of where the interpolations of two
    curves (b, n) cross, their order at x0 and x1 being opposite."""
    if x0 == 0:
        d0, d1 = b0 - n0, b1 - n1
        x = x1 * d0 / (d0 - d1)
    else:
        d0 = math.log(max(b0, _TINY)) - math.log(max(n0, _TINY))
        d1 = math.log(max(b1, _TINY)) - math.log(max(n1, _TINY))
        x = x0 * (x1 / x0) ** (d0 / (d0 - d1)) if d0 != d1 else x0
    return min(max(int(x), x0), x1 - 1)


def _checked(where: str, op, group_size, backend, nbytes, seconds) -> tuple:
    """(group size, backend, bytes, seconds) of a point once valid."""
    if not isinstance(op, str) or not op:
        raise TuningTableError(f"{where}: op must be a non-empty string")
    if not isinstance(backend, str) or not backend:
        raise TuningTableError(f"{where}: backend must be a non-empty string")
    g = _index(group_size)
    if g is None or g < 1:
        raise TuningTableError(f"{where}: group_size must be an integer >= 1")
    n = _index(nbytes)
    if n is None or n < 0:
        raise TuningTableError(f"{where}: nbytes must be an integer >= 0")
    if not schema.is_seconds(seconds):
        raise TuningTableError(f"{where}: seconds must be a finite number >= 0")
    return g, backend, n, float(seconds)


def _interpolate(x0: int, y0: float, x1: int, y1: float, x: int) -> float:
    """Between (x0, y0) and (x1, y1), x0 < x < x1: straight in log-log, or in linear
    space when x0 is 0."""
    if x0 == 0:
        return y0 + (y1 - y0) * x / x1
    ly0, ly1 = math.log(max(y0, _TINY)), math.log(max(y1, _TINY))
    f = math.log(x / x0) / math.log(x1 / x0)
    return math.exp(ly0 + (ly1 - ly0) * f)


def _as_names(backends) -> tuple:
    if isinstance(backends, str):
        return (backends,)
    return tuple(backends)


def _index(v) -> int | None:
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None
