"""Tuning tables: measured times per (op, group size, backend, bytes), and the lookup
``"auto"`` routes by.

A table holds what ``mcrdl-tune run`` measured, with the provenance of the measurement
(host, CPU/GPU model, library versions, date, command). Its JSON layout is documented
in ``tuning_tables/README.md``. Lookups predict each backend's time for a call and pick
the fastest:

- at a measured size and group size: the measured time;
- between measured sizes: log-log interpolation (linear on a segment starting at 0 B);
- between measured group sizes: log-log interpolation in the group size of the
  predictions at the two neighbouring measured group sizes;
- outside the measured sizes or group sizes: the alpha-beta model of (backend, op)
  (``model.py``, fitted to all of that backend's points of the op), anchored at the
  nearest measured point: ``t = t_edge * model(query) / model(edge)``, so predictions
  are continuous at the edge and follow the model's growth beyond it.

``lookup`` caches its answers (bounded dict), so a repeated call costs a dict lookup.
Nothing here does I/O except ``load``, ``save`` and ``find_shipped_table``.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import json
import logging
import math
import operator
import os
import pathlib
import platform
import socket
import sys
import tempfile
from collections.abc import Iterable

from ..errors import InvalidArgumentError
from . import model as _model

SCHEMA = "mcrdl-tuning-table"
VERSION = 1

#: Provenance keys mcrdl writes (all strings); a table may hold others (JSON scalars).
PROVENANCE_KEYS = ("host", "system", "cpu_model", "gpu_model", "mpi", "torch", "nccl",
                   "gloo", "date", "command")
#: Provenance keys whose difference makes a table stale (library versions).
VERSION_KEYS = (("mpi", "MPI library"), ("torch", "torch"), ("nccl", "NCCL"), ("gloo", "Gloo"))

_TOP_KEYS = ("schema", "version", "provenance", "ops")
_ENTRY_KEYS = ("sizes", "times", "winners")
_CACHE_MAX = 1 << 14  # lookup cache entries
_TINY = 1e-15  # seconds: floor of measured times in log space
_MISS = object()

log = logging.getLogger("mcrdl")


class TuningTableError(InvalidArgumentError):
    """A tuning table that cannot be used: missing or unreadable file, invalid JSON, wrong
    schema or version, or a bad field. The message names the file, the JSON path of the
    problem and what was expected."""


class TuningTable:
    """Measured seconds per (op, group size, backend, bytes), plus provenance.

    ``op`` is an operation name of API.md (the tuning suite also stores
    ``"<op>@overlap<K>"`` rows), ``group_size`` the number of ranks, ``nbytes`` the size
    column of ``mcrdl-bench`` (bytes of the largest buffer one rank touches).
    """

    def __init__(self, provenance: dict | None = None):
        self.provenance: dict = _check_provenance(
            {} if provenance is None else provenance, "<provenance>", "$.provenance")
        # op -> group size -> backend -> {nbytes: seconds}
        self._times: dict[str, dict[int, dict[str, dict[int, float]]]] = {}
        self._curves: dict[tuple[str, int, str], tuple[list[int], list[float]]] = {}
        self._gsizes: dict[tuple[str, str], list[int]] = {}
        self._models: dict[tuple[str, str], _model.AlphaBeta] = {}
        self._lookup_cache: dict[tuple, str | None] = {}

    # -- building -------------------------------------------------------------------

    def add(self, op: str, group_size: int, backend: str, nbytes: int, seconds: float) -> None:
        """Record one measured point (seconds per call); re-adding a point replaces it."""
        where = f"add({op!r}, {group_size!r}, {backend!r}, {nbytes!r}, {seconds!r})"
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
        if not _is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
            raise TuningTableError(f"{where}: seconds must be a finite number >= 0")
        self._set(op, g, backend, n, float(seconds))

    def _set(self, op: str, g: int, backend: str, n: int, seconds: float) -> None:
        self._times.setdefault(op, {}).setdefault(g, {}).setdefault(backend, {})[n] = seconds
        self._curves.clear()
        self._gsizes.clear()
        self._models.clear()
        self._lookup_cache.clear()

    # -- queries --------------------------------------------------------------------

    def has(self, op: str, group_size: int, backend: str, nbytes: int) -> bool:
        """Whether this point was measured (the tuning suite skips it when resuming)."""
        return nbytes in self._times.get(op, {}).get(group_size, {}).get(backend, {})

    def times(self, op: str, group_size: int, backend: str) -> dict[int, float]:
        """``{bytes: seconds}`` measured for ``op`` on ``backend`` over ``group_size``
        ranks (a copy; empty when none)."""
        return dict(self._times.get(op, {}).get(group_size, {}).get(backend, {}))

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
        provenance = _check_provenance(self.provenance, "<provenance>", "$.provenance")
        ops: dict = {}
        for op in sorted(self._times):
            groups = {}
            for g in sorted(self._times[op]):
                per_b = self._times[op][g]
                sizes = sorted({n for pts in per_b.values() for n in pts})
                groups[str(g)] = {
                    "sizes": sizes,
                    "times": {b: [per_b[b].get(n) for n in sizes] for b in sorted(per_b)},
                    "winners": [[n, b] for n, b in self.winners(op, g)],
                }
            ops[op] = groups
        return {"schema": SCHEMA, "version": VERSION, "provenance": provenance, "ops": ops}

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> TuningTable:
        """Validate a JSON document and build its table; ``source`` names it in errors.
        ``winners`` is checked for shape only and re-derived from the times."""
        src = str(source)
        if not isinstance(d, dict):
            _fail(src, "$", "a JSON object with keys " + ", ".join(_TOP_KEYS), d)
        _check_keys(d, _TOP_KEYS, _TOP_KEYS, src, "$")
        if d["schema"] != SCHEMA:
            _fail(src, "$.schema", f'"{SCHEMA}" (not an mcrdl tuning table?)', d["schema"])
        version = d["version"]
        if not isinstance(version, int) or isinstance(version, bool) or version != VERSION:
            _fail(src, "$.version", f"{VERSION} (this mcrdl reads version {VERSION} tables; "
                  "re-run mcrdl-tune to regenerate it)", version)
        table = cls(_check_provenance(d["provenance"], src, "$.provenance"))
        ops = d["ops"]
        if not isinstance(ops, dict):
            _fail(src, "$.ops", 'an object {op: {group size: entry}}', ops)
        for op, groups in ops.items():
            opath = f"$.ops[{_key(op)}]"
            if not isinstance(op, str) or not op:
                _fail(src, opath, "a non-empty operation name", op)
            if not isinstance(groups, dict):
                _fail(src, opath, 'an object {"<group size>": entry}', groups)
            for gkey, entry in groups.items():
                table._read_entry(op, gkey, entry, src, f"{opath}[{_key(gkey)}]")
        return table

    def _read_entry(self, op: str, gkey: str, entry, src: str, path: str) -> None:
        if not (isinstance(gkey, str) and gkey.isascii() and gkey.isdigit()
                and str(int(gkey)) == gkey and int(gkey) >= 1):
            _fail(src, path, 'a group size key: a decimal integer >= 1 such as "4"', gkey)
        g = int(gkey)
        if not isinstance(entry, dict):
            _fail(src, path, 'an object with keys "sizes", "times" (and "winners")', entry)
        _check_keys(entry, ("sizes", "times"), _ENTRY_KEYS, src, path)
        sizes = entry["sizes"]
        if not isinstance(sizes, list):
            _fail(src, f"{path}.sizes", "a list of sizes in bytes", sizes)
        for i, n in enumerate(sizes):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                _fail(src, f"{path}.sizes[{i}]", "an integer number of bytes >= 0", n)
            if i and n <= sizes[i - 1]:
                _fail(src, f"{path}.sizes[{i}]", "sizes in strictly increasing order (sorted, "
                      f"no duplicates), i.e. above {sizes[i - 1]}", n)
        times = entry["times"]
        if not isinstance(times, dict):
            _fail(src, f"{path}.times", 'an object {backend: [seconds or null, ...]}', times)
        for backend, ts in times.items():
            bpath = f"{path}.times[{_key(backend)}]"
            if not isinstance(backend, str) or not backend:
                _fail(src, bpath, "a non-empty backend name", backend)
            if not isinstance(ts, list) or len(ts) != len(sizes):
                if isinstance(ts, list):
                    _fail(src, bpath, f"a list of {len(sizes)} times (one per size)",
                          got_text=f"{len(ts)} entries")
                _fail(src, bpath, f"a list of {len(sizes)} times (one per size)", ts)
            for i, t in enumerate(ts):
                if t is None:
                    continue
                if not _is_number(t) or not math.isfinite(t) or t < 0:
                    _fail(src, f"{bpath}[{i}]", "a finite time in seconds >= 0, or null", t)
                self._set(op, g, backend, sizes[i], float(t))
        winners = entry.get("winners", [])
        if not isinstance(winners, list):
            _fail(src, f"{path}.winners", "a list of [from_bytes, backend] pairs", winners)
        for i, w in enumerate(winners):
            if not (isinstance(w, list) and len(w) == 2 and isinstance(w[0], int)
                    and not isinstance(w[0], bool) and w[0] >= 0 and isinstance(w[1], str)):
                _fail(src, f"{path}.winners[{i}]", "a [from_bytes, backend] pair", w)

    def save(self, path) -> None:
        """Write the table to ``path`` atomically: a temporary file in the same directory,
        flushed and fsynced, then renamed over ``path``. An interrupted save leaves the
        previous file (if any) intact and no temporary file behind."""
        path = os.fspath(path)
        text = _dumps(self.to_dict()) + "\n"
        directory = os.path.dirname(os.path.abspath(path))
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                os.fchmod(f.fileno(), mode)
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # make the rename durable where possible
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @classmethod
    def load(cls, path) -> TuningTable:
        """Read and validate the table at ``path`` (TuningTableError when unusable)."""
        src = os.fspath(path)
        try:
            with open(src, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise TuningTableError(f"{src}: no such tuning table; expected a JSON file written "
                                   "by mcrdl-tune run (see tuning_tables/README.md)") from None
        except UnicodeDecodeError as e:
            raise TuningTableError(f"{src}: not UTF-8 text (byte offset {e.start}); expected a "
                                   "JSON tuning table") from None
        except OSError as e:
            raise TuningTableError(f"{src}: cannot read the tuning table: "
                                   f"{e.strerror or e}") from None
        if not text.strip():
            raise TuningTableError(f"{src}: empty file; expected a JSON tuning table")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TuningTableError(f"{src}: invalid JSON at line {e.lineno}, column {e.colno}: "
                                   f"{e.msg}") from None
        return cls.from_dict(data, source=src)

    # -- provenance -----------------------------------------------------------------

    def stale_reasons(self, current: dict) -> list[str]:
        """How the library versions of this table's provenance differ from ``current``
        (e.g. :func:`current_provenance`); [] when they match. Keys missing or empty on
        either side are not compared."""
        reasons = []
        for key, what in VERSION_KEYS:
            have, now = self.provenance.get(key), current.get(key)
            if have and now and have != now:
                reasons.append(f"{what}: table measured with {have!r}, running {now!r}")
        return reasons

    def __eq__(self, other) -> bool:
        if not isinstance(other, TuningTable):
            return NotImplemented
        return self.provenance == other.provenance and self._times == other._times

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        npoints = sum(len(pts) for groups in self._times.values() for per_b in groups.values()
                      for pts in per_b.values())
        return (f"TuningTable({len(self._times)} ops, {npoints} points, "
                f"host={self.provenance.get('host', '?')!r})")


def current_provenance(command: str = "") -> dict:
    """The provenance of a table measured now, in this process (keys PROVENANCE_KEYS).
    Does not import mpi4py.MPI (that would initialise MPI): ``mpi`` is the library
    version's first line only if it is already imported, else ""."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    mpi = ""
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is not None:
        with contextlib.suppress(Exception):
            mpi = mpi_mod.Get_library_version().strip().splitlines()[0].strip()
    nccl = ""
    if cuda:
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "host": socket.gethostname(),
        "system": platform.platform(),
        "cpu_model": _cpu_model(),
        "gpu_model": torch.cuda.get_device_name(0) if cuda else "",
        "mpi": mpi,
        "torch": str(torch.__version__),
        "nccl": nccl,
        "gloo": (f"torch {torch.__version__}"
                 if dist.is_available() and dist.is_gloo_available() else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def find_shipped_table(directory, current: dict) -> pathlib.Path | None:
    """Among ``directory/*.json``, the table measured on this kind of system: the same
    ``gpu_model`` and ``cpu_model`` as ``current``; among several, one from the same
    host first, then the newest (by provenance date). None if none matches. Tables that
    do not load are skipped with a warning on the ``mcrdl`` logger."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        return None
    matches = []
    for path in sorted(d.glob("*.json")):
        try:
            prov = TuningTable.load(path).provenance
        except TuningTableError as e:
            log.warning("mcrdl: skipping unusable shipped tuning table: %s", e)
            continue
        if all(k in prov and k in current and prov[k] == current[k]
               for k in ("cpu_model", "gpu_model")):
            same_host = bool(current.get("host")) and prov.get("host") == current.get("host")
            matches.append((same_host, str(prov.get("date", "")), path))
    return max(matches)[2] if matches else None


# -- helpers ------------------------------------------------------------------------


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


def _is_number(v) -> bool:
    if isinstance(v, bool):
        return False
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return not isinstance(v, (str, bytes))


def _key(k) -> str:
    """A key as written in a JSON path: ``"all_reduce"``."""
    return json.dumps(k) if isinstance(k, str) else repr(k)


def _show(v) -> str:
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)
    return f"{text} ({kind})"


def _fail(source: str, path: str, expected: str, got=_MISS, *, got_text: str = ""):
    """Raise the TuningTableError of a bad field: file, JSON path, expectation, value."""
    msg = f"{source}: {path}: expected {expected}"
    if got is not _MISS:
        msg += f", got {_show(got)}"
    elif got_text:
        msg += f", got {got_text}"
    raise TuningTableError(msg)


def _check_keys(d: dict, required: tuple, allowed: tuple, src: str, path: str) -> None:
    for key in d:
        if key not in allowed:
            _fail(src, path, "only the keys " + ", ".join(allowed),
                  got_text=f"unknown key {key!r}")
    for key in required:
        if key not in d:
            _fail(src, path, f"a key {key!r} (required: {', '.join(required)})",
                  got_text="none")


def _check_provenance(prov, src: str, path: str) -> dict:
    if not isinstance(prov, dict):
        _fail(src, path, "an object of strings (host, cpu_model, mpi, torch, ...)", prov)
    for key, value in prov.items():
        kpath = f"{path}[{_key(key)}]"
        if not isinstance(key, str):
            _fail(src, kpath, "string keys", key)
        if key in PROVENANCE_KEYS and not isinstance(value, str):
            _fail(src, kpath, "a string", value)
        if not (value is None or isinstance(value, (str, bool, int))
                or (isinstance(value, float) and math.isfinite(value))):
            _fail(src, kpath, "a string, number, boolean or null", value)
    return dict(prov)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor()


def _dumps(obj, level: int = 0) -> str:
    """JSON with objects indented and lists on one line (one curve per line)."""
    if isinstance(obj, dict) and obj:
        pad = "  " * (level + 1)
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * level + "}"
    return json.dumps(obj, allow_nan=False)
