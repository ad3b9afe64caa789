"""The extension chain: which extensions are on, and the wrapper backends that do them.

``mcrdl.api`` keeps one dict, ``_active``, from backend name to the object whose
methods run the operations; the hot path is one lookup in it. With no extension on,
it holds the backends themselves, so the path is exactly as without this package.
Turning an extension on (:func:`configure`, or :func:`extensions` for a block of code)
puts, for every initialized backend, a chain of wrapper backends in front of it::

    Logged(level "call") -> Fused -> Compressed -> Logged(level "wire") -> backend

(each link only when its extension is on; the "wire" logger only when fusion or
compression changes what is sent). "auto" is rebuilt over the wrapped backends, so it
first resolves the call to a concrete backend and the chain of that backend then runs:
fusion keys, logs and ``Work.backend`` name the resolved backend.

Every rank must turn the same extensions on and off at the same points of its calls of
each (backend, group), like any other collective call sequence. Changing the
configuration first posts every call the old chain still holds (a blocking step).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from ..errors import InvalidArgumentError
from .config import CompressionConfig, ExtensionConfig, FusionConfig, LoggingConfig, coerce

log = logging.getLogger("mcrdl")

_lock = threading.RLock()
_global = ExtensionConfig()  # set by configure()
_stack: list[ExtensionConfig] = []  # extensions() blocks, innermost last
_applied: ExtensionConfig | None = None  # what the installed wrappers do
_wrappers: list = []  # every wrapper of the installed chain, outermost first


def current() -> ExtensionConfig:
    """The extensions in effect now (the innermost ``extensions()`` block, else the
    ``configure()`` settings)."""
    return _stack[-1] if _stack else _global


def _merge(base: ExtensionConfig, fusion, compression, logging_) -> ExtensionConfig:
    config = ExtensionConfig(
        fusion=coerce("fusion", fusion, base.fusion),
        compression=coerce("compression", compression, base.compression),
        logging=coerce("logging", logging_, base.logging),
    )
    if config.compression is not None:
        try:
            import zfpy  # noqa: F401
        except ImportError:
            raise InvalidArgumentError(
                "compression: zfpy is not installed in this environment; pip install zfpy "
                "(it is in mcrdl's 'test' extra)") from None
    return config


def configure(*, fusion: bool | dict | FusionConfig | None = None,
              compression: bool | dict | CompressionConfig | None = None,
              logging: bool | dict | LoggingConfig | None = None) -> ExtensionConfig:
    """Turn call-path extensions on or off for every later call (before or after init).

    Each argument: None leaves that extension as it is, False turns it off, True turns
    it on with default settings (compression needs a mode: pass a CompressionConfig or a
    dict such as ``{"mode": "accuracy", "tolerance": 1e-3}``), a dict or config object
    turns it on with those settings. Returns the new configuration. Call it at the same
    point on every rank; turning an extension off posts the calls it still holds.
    """
    global _global
    with _lock:
        _global = _merge(_global, fusion, compression, logging)
        if not _stack:
            _apply()
        return _global


@contextlib.contextmanager
def extensions(*, fusion: bool | dict | FusionConfig | None = None,
               compression: bool | dict | CompressionConfig | None = None,
               logging: bool | dict | LoggingConfig | None = None
               ) -> Iterator[ExtensionConfig]:
    """Extensions for the calls made inside a ``with`` block (from any thread), relative
    to the configuration outside it (same arguments as :func:`configure`)::

        with mcrdl.extensions(fusion=True):
            works = [mcrdl.all_reduce("mpi", g, async_op=True) for g in grads]
        for w in works:
            w.wait()

    Entering and leaving swap the chain in front of the backends, so calls outside the
    block take the unchanged path; leaving posts every call the block's chain holds.
    """
    with _lock:
        config = _merge(current(), fusion, compression, logging)
        _stack.append(config)
        _apply()
    try:
        yield config
    finally:
        with _lock:
            _stack.pop()
            _apply()


def _apply() -> None:
    """Install the chain of current() in mcrdl.api (when initialized)."""
    from .. import api

    if current() == _applied or not api.is_initialized():
        return
    api._install_extensions()


def wrap(backends: dict, ext) -> dict:
    """Hook of mcrdl.api: the objects to put in ``_active`` for `backends` (name ->
    backend). Posts what the previous chain holds first. With no extension on, returns
    `backends` itself."""
    global _applied
    with _lock:
        _retire(ext.timeout_of())
        config = current()
        _applied = config
        if not config.enabled:
            return backends
        return {name: _chain(backend, config, ext) for name, backend in backends.items()}


def _chain(backend, config: ExtensionConfig, ext):
    obj = backend
    if config.logging is not None:
        from .comm_logger import Logged, logger

        log_ = logger()
        log_.configure(config.logging, ext)
        wire = config.logging.wire and (config.fusion is not None
                                        or config.compression is not None)
        if wire:
            obj = Logged(obj, log_, "wire", ext)
    if config.compression is not None:
        from .compression import Compressed

        obj = Compressed(obj, ext, config.compression)
        _wrappers.insert(0, obj)
    if config.fusion is not None:
        from .tensor_fusion import Fused

        obj = Fused(obj, ext, config.fusion)
        _wrappers.insert(0, obj)
    if config.logging is not None:
        obj = Logged(obj, log_, "call", ext)
    return obj


def _retire(timeout: float) -> None:
    """Post every call the installed wrappers hold, then stop their threads."""
    global _wrappers
    wrappers, _wrappers = _wrappers, []
    errors = []
    for w in wrappers:  # outermost first: fusion's rounds may post through compression
        try:
            w.drain(timeout)
        except Exception as exc:  # noqa: BLE001 - reported below, the others still drain
            errors.append(exc)
    for w in wrappers:
        w.close(timeout)
    if errors:
        raise errors[0]


def shutdown(timeout: float) -> None:
    """Hook of mcrdl.finalize: post what the chain holds (best effort) and stop its
    threads. The configuration stays for a later init."""
    global _applied
    with _lock:
        try:
            _retire(timeout)
        except Exception as exc:  # noqa: BLE001 - finalize goes on
            log.warning("mcrdl: finalize: calls held by the extension chain could not all be "
                        "posted: %s", exc)
        _applied = None
        from .comm_logger import logger

        logger().finish_pending()
