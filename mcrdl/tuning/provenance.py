"""Where and with what a tuning table was measured: the provenance of a measurement made
now (:func:`current_provenance`), whether a table's library versions still match the
running ones (:func:`stale_reasons`), and which shipped table fits this system
(:func:`find_shipped_table`)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import pathlib
import platform
import socket
import sys

from ..bootstrap import MPICH_POSIX_COLL_CVAR, mpich_posix_coll_json
from . import schema

#: Provenance keys whose difference makes a table stale (library versions, and MPICH's
#: collective selection, which changes what its blocking calls cost), with what they name
#: in the reasons.
VERSION_KEYS = (("mpi", "MPI library"), ("mpich_coll_selection", "MPICH collective selection"),
                ("torch", "torch"), ("nccl", "NCCL"), ("gloo", "Gloo"))

log = logging.getLogger("mcrdl")


def current_provenance(command: str = "") -> dict:
    """The provenance of a table measured now, in this process (keys
    ``schema.PROVENANCE_KEYS``). Does not import mpi4py.MPI (that would initialise MPI):
    ``mpi`` is the library version's first line only if it is already imported, else
    ""."""
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
        "mpich_coll_selection": mpich_coll_selection() if "MPICH" in mpi else "",
        "torch": str(torch.__version__),
        "nccl": nccl,
        "gloo": (f"torch {torch.__version__}"
                 if dist.is_available() and dist.is_gloo_available() else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def mpich_coll_selection() -> str:
    """Which shared-memory collective selection MPICH runs with in this process (read
    once MPI is initialized): "mcrdl:<digest>" (the file mcrdl ships, mcrdl/bootstrap.py,
    with the first 12 hex digits of the SHA-256 of its JSON: its size limits change between
    releases, and with them what the blocking calls cost), "mpich" (MPICH's own: the
    variable unset or empty), else the user's file."""
    value = os.environ.get(MPICH_POSIX_COLL_CVAR, "")
    if not value:
        return "mpich"
    shipped = mpich_posix_coll_json()
    if os.path.realpath(value) == os.path.realpath(shipped):
        with open(shipped) as f:  # of its content (key order kept), not its formatting
            canonical = json.dumps(json.load(f), separators=(",", ":"))
        return "mcrdl:" + hashlib.sha256(canonical.encode()).hexdigest()[:12]
    return value


def stale_reasons(provenance: dict, current: dict) -> list[str]:
    """How the library versions of a table's `provenance` differ from `current` (e.g.
    :func:`current_provenance`); [] when they match. Keys missing or empty on either side
    are not compared."""
    reasons = []
    for key, what in VERSION_KEYS:
        have, now = provenance.get(key), current.get(key)
        if have and now and have != now:
            reasons.append(f"{what}: table measured with {have!r}, running {now!r}")
    return reasons


def _shipped_tables_dir() -> pathlib.Path:
    """Where the shipped tables are: the repository's top-level ``tuning_tables/``.
    setup.py maps it into the package as ``mcrdl/tuning_tables/`` (package data), which
    is where an installed copy (a wheel) has it; a source checkout, and an editable
    install (which imports mcrdl from the checkout), read the folder itself, beside the
    ``mcrdl/`` package."""
    package = pathlib.Path(__file__).resolve().parents[1]
    installed = package / "tuning_tables"
    return installed if installed.is_dir() else package.parent / "tuning_tables"


#: The tables shipped with the package, with the format's documentation (README.md there).
SHIPPED_TABLES = _shipped_tables_dir()


def find_shipped_table(directory: str | os.PathLike, current: dict) -> pathlib.Path | None:
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
            prov = schema.decode(schema.read(path), source=os.fspath(path)).provenance
        except schema.TuningTableError as e:
            log.warning("mcrdl: skipping unusable shipped tuning table: %s", e)
            continue
        if all(k in prov and k in current and prov[k] == current[k]
               for k in ("cpu_model", "gpu_model")):
            same_host = bool(current.get("host")) and prov.get("host") == current.get("host")
            matches.append((same_host, str(prov.get("date", "")), path))
    return max(matches)[2] if matches else None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor()
