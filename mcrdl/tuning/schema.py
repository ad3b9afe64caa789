"""The JSON document of a tuning table (``tuning_tables/README.md``): its schema and
version, validation with errors that name the file, the JSON path and what was
expected, and reading and writing the file.

A document is decoded into the table's provenance, its measured :class:`Point` s and
the MPI blocking steps it records; the table (``table.py``) stores them. A change to the
layout raises ``VERSION`` and says here how an older document reads, if it still can:

- version 1: no ``variants`` or ``blocking`` keys in an entry. It reads as it is; the
  mpi backends then run the variants of their shipped measurements
  (mcrdl/tuning/mpi_blocking.json).
- version 2: an entry may hold ``variants`` (per backend, the times of the blocking and
  the nonblocking MPI call) and ``blocking`` (per backend, the (largest bytes, blocking)
  steps its blocking calls run). It reads as it is.
- version 3: as 2, and all_gather / reduce_scatter entries may hold the times of the
  "allreduce" variant, which a step then names as ``"allreduce"``.
- version 4 (written now): as 3, and an entry may hold ``confirmed``: the sizes the
  confirmation pass of ``mcrdl-tune run`` re-measured, which a resumed run does not
  re-measure again. Older versions read as having none confirmed.

A version above ``VERSION`` is refused with a message naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import NamedTuple

from ..errors import InvalidArgumentError
from ..ops import ALIASES, OPS

SCHEMA = "mcrdl-tuning-table"
VERSION = 4
#: The versions a reader accepts (see the module docstring for how each reads).
READS = (1, 2, 3, 4)
#: The ways an MPI backend runs a blocking call: the blocking MPI collective, the
#: nonblocking one and a bounded wait, or (ALLREDUCE_OPS only) the blocking MPI_Allreduce
#: of the whole buffer, of which each rank keeps its part (mcrdl/backends/mpi.py).
VARIANTS = ("blocking", "nonblocking", "allreduce")
#: The ops with the "allreduce" variant.
ALLREDUCE_OPS = ("all_gather", "reduce_scatter")
#: A step's variant as written in a file: true, false or the variant's name.
STEP_VALUES = {"blocking": True, "nonblocking": False, "allreduce": "allreduce"}
#: The variant codes of the C++ communicators (mcrdl/csrc/mpi_util.h, Variant).
VARIANT_CODES = {"nonblocking": 0, "blocking": 1, "allreduce": 2}


def op_variants(op: str) -> tuple[str, ...]:
    """The variants a blocking call of `op` may run (the first two for most ops)."""
    return VARIANTS if op in ALLREDUCE_OPS else VARIANTS[:2]


def step_variant(value: bool | str) -> str:
    """The variant name of a step's value (True, False or "allreduce")."""
    return ("allreduce" if value == "allreduce" else "blocking" if value is True
            else "nonblocking")


#: Provenance keys mcrdl writes (all strings); a table may hold others (JSON scalars).
PROVENANCE_KEYS = ("host", "system", "cpu_model", "gpu_model", "mpi", "mpich_coll_selection",
                   "torch", "nccl", "gloo", "date", "command")

_TOP_KEYS = ("schema", "version", "provenance", "ops")
_ENTRY_KEYS = {1: ("sizes", "times", "winners"),
               2: ("sizes", "times", "winners", "variants", "blocking"),
               3: ("sizes", "times", "winners", "variants", "blocking"),
               4: ("sizes", "times", "winners", "variants", "blocking", "confirmed")}
_MISS = object()

#: The measured times of a table: op -> group size -> backend -> {nbytes: seconds}.
Times = dict[str, dict[int, dict[str, dict[int, float]]]]
#: The times of each MPI variant: (op, group size, backend) -> variant -> {nbytes: seconds}.
VariantTimes = dict[tuple[str, int, str], dict[str, dict[int, float]]]
#: (largest bytes, variant) steps in increasing size, -1 bytes: no limit; the variant as
#: STEP_VALUES writes it (True: blocking, False: nonblocking, "allreduce").
Steps = list[tuple[int, bool | str]]


class TuningTableError(InvalidArgumentError):
    """A tuning table that cannot be used: missing or unreadable file, invalid JSON, wrong
    schema or version, or a bad field. The message names the file, the JSON path of the
    problem and what was expected."""


class Point(NamedTuple):
    """One measured time: ``seconds`` per call of ``op`` on ``backend`` over
    ``group_size`` ranks with ``nbytes`` bytes; ``variant`` is "" for the backend's time
    and one of VARIANTS for the time of that MPI variant."""

    op: str
    group_size: int
    backend: str
    nbytes: int
    seconds: float
    variant: str = ""


class Document(NamedTuple):
    """A decoded table: provenance, measured points, and the blocking steps recorded
    per (op, group size, backend)."""

    provenance: dict
    points: list[Point]
    steps: dict[tuple[str, int, str], Steps]
    #: (op, group size, bytes) the confirmation pass re-measured (version >= 4).
    confirmed: frozenset = frozenset()


def is_seconds(v: object) -> bool:
    """Whether `v` is a measured time: a finite number >= 0 (not a bool or a string)."""
    if isinstance(v, (bool, str, bytes)):
        return False
    try:
        seconds = float(v)
    except (TypeError, ValueError, OverflowError):
        return False
    return math.isfinite(seconds) and seconds >= 0


def encode(provenance: dict, times: Times,
           winners: Callable[[str, int], list[tuple[int, str]]],
           variants: VariantTimes | None = None,
           steps: dict[tuple[str, int, str], Steps] | None = None,
           confirmed: set[tuple[str, int, int]] | frozenset = frozenset()) -> dict:
    """The JSON document of a table: its `provenance`, its `times`, each curve's
    `winners(op, group_size)` (written for readers; :func:`decode` re-derives them), the
    `variants` times, the blocking `steps` per (op, group size, backend) and the
    `confirmed` (op, group size, bytes) points (those of a measured size)."""
    provenance = check_provenance(provenance, "<provenance>", "$.provenance")
    variants, steps = variants or {}, steps or {}
    curves = {(op, g) for op in times for g in times[op]} | {(op, g) for op, g, _ in steps}
    ops: dict = {}
    for op, g in sorted(curves):
        per_b = times.get(op, {}).get(g, {})
        sizes = sorted({n for pts in per_b.values() for n in pts})
        entry = {
            "sizes": sizes,
            "times": {b: [per_b[b].get(n) for n in sizes] for b in sorted(per_b)},
            "winners": [[n, b] for n, b in winners(op, g)],
        }
        var = {b: {v: [variants[op, g, b].get(v, {}).get(n) for n in sizes]
                   for v in VARIANTS if v in VARIANTS[:2] or v in variants[op, g, b]}
               for b in sorted(per_b) if (op, g, b) in variants}
        if var:
            entry["variants"] = var
        chosen = {b: [[n, v] for n, v in st] for (o, gs, b), st in sorted(steps.items())
                  if (o, gs) == (op, g)}
        if chosen:
            entry["blocking"] = chosen
        done = [n for n in sizes if (op, g, n) in confirmed]
        if done:
            entry["confirmed"] = done
        ops.setdefault(op, {})[str(g)] = entry
    return {"schema": SCHEMA, "version": VERSION, "provenance": provenance, "ops": ops}


def decode(d: object, source: str = "<dict>") -> Document:
    """Validate a JSON document (of a version in READS) and return its provenance,
    measured points and blocking steps; ``source`` names the document in errors.
    ``winners`` is checked for shape only."""
    src = str(source)
    if not isinstance(d, dict):
        _fail(src, "$", "a JSON object with keys " + ", ".join(_TOP_KEYS), d)
    _check_keys(d, _TOP_KEYS, _TOP_KEYS, src, "$")
    if d["schema"] != SCHEMA:
        _fail(src, "$.schema", f'"{SCHEMA}" (not an mcrdl tuning table?)', d["schema"])
    version = _check_version(d["version"], src)
    provenance = check_provenance(d["provenance"], src, "$.provenance")
    ops = d["ops"]
    if not isinstance(ops, dict):
        _fail(src, "$.ops", 'an object {op: {group size: entry}}', ops)
    points: list[Point] = []
    steps: dict[tuple[str, int, str], Steps] = {}
    confirmed: set[tuple[str, int, int]] = set()
    for op, groups in ops.items():
        opath = f"$.ops[{_key(op)}]"
        _check_op(op, src, opath)
        if not isinstance(groups, dict):
            _fail(src, opath, 'an object {"<group size>": entry}', groups)
        for gkey, entry in groups.items():
            points.extend(_read_entry(op, gkey, entry, version, steps, confirmed, src,
                                      f"{opath}[{_key(gkey)}]"))
    return Document(provenance, points, steps, frozenset(confirmed))


def _check_op(op: object, src: str, path: str) -> None:
    """A row's name: an operation of mcrdl.ops by its own name (an alias or a misspelling
    would load and never be looked up), optionally ``@overlap<K>``, K >= 2."""
    if not isinstance(op, str) or not op:
        _fail(src, path, "a non-empty operation name", op)
    base, at, mode = op.partition("@")
    if base in ALIASES:
        _fail(src, path, f'the operation\'s own name "{ALIASES[base]}{at}{mode}", not an alias',
              op)
    if base not in OPS:
        _fail(src, path, "an mcrdl operation (" + ", ".join(OPS) + "), optionally with "
              "@overlap<K>", op)
    k = mode[len("overlap"):]
    if at and not (mode.startswith("overlap") and k.isdigit() and int(k) >= 2):
        _fail(src, path, f'"{base}" or "{base}@overlap<K>" with K >= 2', op)


def check_provenance(prov: object, src: str, path: str) -> dict:
    """A copy of provenance `prov` once valid: string keys, JSON scalar values, strings
    for PROVENANCE_KEYS (TuningTableError naming `src` and `path` otherwise)."""
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


def read(path: str | os.PathLike) -> object:
    """The parsed JSON of the file at `path` (TuningTableError when it cannot be read or
    is not JSON); validate it with :func:`decode`."""
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
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TuningTableError(f"{src}: invalid JSON at line {e.lineno}, column {e.colno}: "
                               f"{e.msg}") from None


def write(path: str | os.PathLike, doc: dict) -> None:
    """Write `doc` to `path` atomically: a temporary file in the same directory, flushed
    and fsynced, then renamed over `path` (keeping its file mode). An interrupted write
    leaves the previous file (if any) intact and no temporary file behind."""
    path = os.fspath(path)
    text = _dumps(doc) + "\n"
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


# -- validation -------------------------------------------------------------------------


def _check_version(version: object, src: str) -> int:
    is_int = isinstance(version, int) and not isinstance(version, bool)
    if is_int and version in READS:
        return version
    if is_int and version > VERSION:
        why = ("the table was written by a newer mcrdl: upgrade mcrdl to read it, or re-run "
               "mcrdl-tune run with this one to regenerate it")
    else:
        why = (f"this mcrdl reads versions {', '.join(map(str, READS))}; re-run mcrdl-tune "
               "run to regenerate it")
    listed = ", ".join(map(str, READS[:-1])) + f" or {READS[-1]}"
    _fail(src, "$.version", f"{listed} ({why})", version)


def _read_entry(op: str, gkey: str, entry: object, version: int,
                steps: dict[tuple[str, int, str], Steps],
                confirmed: set[tuple[str, int, int]], src: str,
                path: str) -> Iterator[Point]:
    """The points of one {"sizes", "times", "winners", "variants", "blocking",
    "confirmed"} entry, validated; its blocking steps go to `steps`, its confirmed
    sizes to `confirmed`."""
    if not (isinstance(gkey, str) and gkey.isascii() and gkey.isdigit()
            and str(int(gkey)) == gkey and int(gkey) >= 1):
        _fail(src, path, 'a group size key: a decimal integer >= 1 such as "4"', gkey)
    g = int(gkey)
    if not isinstance(entry, dict):
        _fail(src, path, 'an object with keys "sizes", "times" (and "winners")', entry)
    _check_keys(entry, ("sizes", "times"), _ENTRY_KEYS[version], src, path)
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
        yield from _read_times(op, g, backend, "", sizes, ts, src, bpath)
    variants = entry.get("variants", {})
    if not isinstance(variants, dict):
        _fail(src, f"{path}.variants", 'an object {backend: {"blocking": [...], '
              '"nonblocking": [...]}}', variants)
    for backend, per_v in variants.items():
        bpath = f"{path}.variants[{_key(backend)}]"
        if backend not in times:
            _fail(src, bpath, "a backend of this entry's times", backend)
        if not isinstance(per_v, dict):
            _fail(src, bpath, 'an object {"blocking": [...], "nonblocking": [...]}', per_v)
        _check_keys(per_v, (), op_variants(op) if version >= 3 else VARIANTS[:2], src, bpath)
        for v, ts in per_v.items():
            yield from _read_times(op, g, backend, v, sizes, ts, src, f"{bpath}.{v}")
    blocking = entry.get("blocking", {})
    if not isinstance(blocking, dict):
        _fail(src, f"{path}.blocking", "an object {backend: [[largest bytes, blocking], "
              "...]}", blocking)
    for backend, st in blocking.items():
        steps[op, g, backend] = check_steps(st, src, f"{path}.blocking[{_key(backend)}]",
                                            op if version >= 3 else "")
    done = entry.get("confirmed", [])
    if not isinstance(done, list):
        _fail(src, f"{path}.confirmed", "a list of sizes of this entry", done)
    for i, n in enumerate(done):
        if not isinstance(n, int) or isinstance(n, bool) or n not in sizes:
            _fail(src, f"{path}.confirmed[{i}]", "a size of this entry's sizes", n)
        confirmed.add((op, g, n))
    winners = entry.get("winners", [])
    if not isinstance(winners, list):
        _fail(src, f"{path}.winners", "a list of [from_bytes, backend] pairs", winners)
    for i, w in enumerate(winners):
        if not (isinstance(w, list) and len(w) == 2 and isinstance(w[0], int)
                and not isinstance(w[0], bool) and w[0] >= 0 and isinstance(w[1], str)):
            _fail(src, f"{path}.winners[{i}]", "a [from_bytes, backend] pair", w)


def _read_times(op: str, g: int, backend: str, variant: str, sizes: list, ts: object,
                src: str, path: str) -> Iterator[Point]:
    """The points of one list of times (one per size, null: not measured)."""
    if not isinstance(ts, list) or len(ts) != len(sizes):
        if isinstance(ts, list):
            _fail(src, path, f"a list of {len(sizes)} times (one per size)",
                  got_text=f"{len(ts)} entries")
        _fail(src, path, f"a list of {len(sizes)} times (one per size)", ts)
    for i, t in enumerate(ts):
        if t is None:
            continue
        if not is_seconds(t):
            _fail(src, f"{path}[{i}]", "a finite time in seconds >= 0, or null", t)
        yield Point(op, g, backend, sizes[i], float(t), variant)


def check_steps(steps: object, src: str, path: str, op: str = "") -> Steps:
    """Steps once valid: [largest bytes, variant] pairs, largest bytes >= 0 and increasing,
    -1 (no limit) only last, the variant true (blocking), false (nonblocking) or, for the
    ALLREDUCE_OPS `op`, "allreduce" (TuningTableError naming `src` and `path` otherwise)."""
    if not isinstance(steps, (list, tuple)) or not steps:
        _fail(src, path, "a non-empty list of [largest bytes, blocking] pairs", steps)
    allreduce = op in ALLREDUCE_OPS
    out: Steps = []
    for i, step in enumerate(steps):
        if not (isinstance(step, (list, tuple)) and len(step) == 2
                and isinstance(step[0], int) and not isinstance(step[0], bool)
                and (isinstance(step[1], bool) or (allreduce and step[1] == "allreduce"))):
            _fail(src, f"{path}[{i}]", "a [largest bytes, blocking] pair: an integer and a "
                  "boolean" + (' or "allreduce"' if allreduce else ""), step)
        hi = step[0]
        if hi < -1 or (out and (out[-1][0] == -1 or (hi != -1 and hi <= out[-1][0]))):
            _fail(src, f"{path}[{i}][0]", "sizes >= 0 in increasing order, -1 (no limit) "
                  "only last", hi)
        out.append((hi, step[1]))
    return out


def _check_keys(d: dict, required: tuple, allowed: tuple, src: str, path: str) -> None:
    for key in d:
        if key not in allowed:
            _fail(src, path, "only the keys " + ", ".join(allowed),
                  got_text=f"unknown key {key!r}")
    for key in required:
        if key not in d:
            _fail(src, path, f"a key {key!r} (required: {', '.join(required)})",
                  got_text="none")


def _key(k: object) -> str:
    """A key as written in a JSON path: ``"all_reduce"``."""
    return json.dumps(k) if isinstance(k, str) else repr(k)


def _show(v: object) -> str:
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)
    return f"{text} ({kind})"


def _fail(source: str, path: str, expected: str, got: object = _MISS, *, got_text: str = ""):
    """Raise the TuningTableError of a bad field: file, JSON path, expectation, value."""
    msg = f"{source}: {path}: expected {expected}"
    if got is not _MISS:
        msg += f", got {_show(got)}"
    elif got_text:
        msg += f", got {got_text}"
    raise TuningTableError(msg)


def _dumps(obj: object, level: int = 0) -> str:
    """JSON with objects indented and lists on one line (one curve per line)."""
    if isinstance(obj, dict) and obj:
        pad = "  " * (level + 1)
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * level + "}"
    return json.dumps(obj, allow_nan=False)
