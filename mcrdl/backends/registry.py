"""Registry of backend classes: the built-ins, register_backend(), and the
``mcrdl.backends`` entry-point group of installed distributions."""

from __future__ import annotations

import importlib
import logging
from importlib import metadata

from ..errors import BackendUnavailableError
from .base import Backend

log = logging.getLogger("mcrdl")

ENTRY_POINT_GROUP = "mcrdl.backends"

_BUILTIN = {
    "mpi": "mcrdl.backends.mpi:MPIBackend",
    "gloo": "mcrdl.backends.gloo:GlooBackend",
    "nccl": "mcrdl.backends.nccl:NCCLBackend",
    "rccl": "mcrdl.backends.nccl:RCCLBackend",
    "pccl": "mcrdl.backends.pccl:PCCLBackend",
    "cray-mpich": "mcrdl.backends.cray_mpich:CrayMPICHBackend",
}
#: Names whose plug-in failed to load, with the reason shown to users.
_NOT_BUILT: dict[str, str] = {}

_classes: dict[str, type[Backend]] = {}
_entry_points_loaded = False


def _load(path: str) -> type[Backend]:
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


def register_backend(name: str, cls: type[Backend] | str) -> None:
    """Register a Backend subclass (or "module:Class" path) under ``name``."""
    if name == "auto" or not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: {name!r} is not a valid backend name")
    if isinstance(cls, str):
        cls = _load(cls)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"register_backend: {cls!r} is not a subclass of mcrdl.backends.Backend")
    cls.name = name
    _classes[name] = cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _classes or ep.name in _BUILTIN:
            continue
        try:
            register_backend(ep.name, ep.load())
        except Exception as exc:  # a broken plug-in must not break mcrdl
            log.warning("mcrdl: backend entry point %r (%s) failed to load: %s",
                        ep.name, ep.value, exc)
            _NOT_BUILT[ep.name] = f"its entry point {ep.value} failed to load: {exc}"


def backend_class(name: str) -> type[Backend]:
    if name in _BUILTIN and name not in _classes:
        register_backend(name, _load(_BUILTIN[name]))
    _load_entry_points()
    try:
        return _classes[name]
    except KeyError:
        raise BackendUnavailableError(describe_unavailable(name)) from None


def known_names() -> list[str]:
    _load_entry_points()
    names = list(_BUILTIN) + [n for n in _classes if n not in _BUILTIN]
    return names + [n for n in _NOT_BUILT if n not in names]


def availability(launch) -> dict[str, str | None]:
    """name -> None if usable in this process, else why not."""
    out: dict[str, str | None] = {}
    for name in known_names():
        if name in _NOT_BUILT:
            out[name] = _NOT_BUILT[name]
            continue
        try:
            out[name] = backend_class(name).availability(launch)
        except Exception as exc:
            out[name] = f"availability check failed: {exc}"
    return out


def backends_supporting(op: str) -> list[str]:
    names = []
    for name in known_names():
        if name in _NOT_BUILT:
            continue
        cls = backend_class(name)
        if op in cls.supported_ops():
            names.append(name)
    return names


def describe_unavailable(name: object, launch=None, initialized=()) -> str:
    """Message for BackendUnavailableError: what is available and why `name` is not."""
    from ..launch import detect

    launch = launch or detect()
    avail = availability(launch)
    usable = [n for n, why in avail.items() if why is None]
    lines = []
    if not isinstance(name, str):
        lines.append(f"backend must be a name (str), got {type(name).__name__} {name!r}")
    elif name in avail and avail[name] is not None:
        lines.append(f"backend '{name}' is unavailable: {avail[name]}")
    elif name in avail:
        lines.append(f"backend '{name}' is available but not initialized; "
                     f"call mcrdl.init([... '{name}']) first")
    else:
        lines.append(f"unknown backend '{name}'")
    lines.append(f"initialized: {', '.join(initialized) or 'none (call mcrdl.init())'}; "
                 f"usable here: {', '.join(usable) or 'none'}")
    for n, why in avail.items():
        if why is not None and n != name:
            lines.append(f"  {n}: {why}")
    return "\n".join(lines)
