"""The call path's layers, their one order, and the one place they are installed.

Every call the front makes goes to ``runtime.dispatch[name]``: for a backend, the top of
that backend's layers; for "auto", a router that resolves the call to a backend and
hands it to that backend's layers. From the front down::

    auto -> log calls -> fuse -> compress -> log wire -> debug -> validate -> backend

- ``auto`` (mcrdl.extensions.auto): picks the backend; fusion keys, logs and
  ``Work.backend`` name the resolved one.
- ``log calls`` / ``log wire`` (comm_logger.Logged): what the program called, and, with
  fusion or compression on, what went to the backend.
- ``fuse`` (mcrdl.fusion.Fused), ``compress`` (compression.Compressed): the
  extensions of :func:`configure` / :func:`extensions`.
- ``debug`` (debug.Debugged, MCRDL_DEBUG=1), ``validate`` (validation.Validated, for
  backends that do not validate): made with the backend by the runtime, once.

With no extension on, the dispatch table holds the bases (the backends themselves for
the built-in ones), so the path is exactly as without this package. Every rank must
turn the same extensions on and off at the same points of its calls of each (backend,
group), like any other collective call sequence. Changing the configuration first posts
every call the old layers still hold (a blocking step).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from ..errors import InvalidArgumentError
from ..fusion import Fused, FusionConfig
from .comm_logger import Logged, logger
from .compression import Compressed
from .config import CompressionConfig, ExtensionConfig, LoggingConfig, coerce

log = logging.getLogger("mcrdl")

_lock = threading.RLock()
_global = ExtensionConfig()  # set by configure()
_stack: list[ExtensionConfig] = []  # extensions() blocks, innermost last
_applied: ExtensionConfig | None = None  # what the installed layers do
_runtime = None  # the runtime whose dispatch table holds the installed layers
_installed: list = []  # the extension layers installed, outermost first


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
            # this block's own entry: blocks of other threads may have begun after it
            del _stack[max(i for i, c in enumerate(_stack) if c is config)]
            _apply()


def _apply() -> None:
    """Rebuild the installed runtime's dispatch table for current() (when initialized)."""
    if current() == _applied or _runtime is None or not _runtime.backends:
        return
    _runtime.install()


def build(runtime) -> dict:
    """Hook of the runtime: backend name -> the top of its layers for current(). Posts
    what the previous layers hold first. With no extension on, the bases themselves."""
    global _applied, _runtime
    with _lock:
        _retire(runtime.timeout)
        config = current()
        _applied, _runtime = config, runtime
        logger().attach(runtime)
        if not config.enabled:
            return dict(runtime.bases)
        return {name: _layers(base, config, runtime, runtime.backends[name].capabilities)
                for name, base in runtime.bases.items()}


def _layers(base, config: ExtensionConfig, runtime, capabilities):
    # Fusion buffers CPU tensors only: a backend that takes none gets no fusion layer
    # (its calls would only pass through one, and a CPU call buffered there would fail in
    # the round's agreement on the backend, not at the backend's own device check).
    fuses = config.fusion is not None and "cpu" in capabilities.devices
    top = base
    if config.logging is not None:
        log_ = logger()
        log_.configure(config.logging, runtime.rank)
        if config.logging.wire and (fuses or config.compression is not None):
            top = Logged(top, log_, "wire", runtime.world_size)
    if config.compression is not None:
        top = Compressed(top, runtime, config.compression)
        _installed.insert(0, top)
    if fuses:
        top = Fused(top, runtime, config.fusion)
        _installed.insert(0, top)
    if config.logging is not None:
        top = Logged(top, log_, "call", runtime.world_size)
    return top


def _retire(timeout: float) -> None:
    """Post every call the installed layers hold, then stop their threads."""
    global _installed
    installed, _installed = _installed, []
    errors = []
    for layer in installed:  # outermost first: fusion's rounds may post through compression
        try:
            layer.drain(timeout)
        except Exception as exc:  # noqa: BLE001 - reported below, the others still drain
            errors.append(exc)
    for layer in installed:
        layer.close(timeout)
    if errors:
        raise errors[0]


def retire(runtime) -> None:
    """Hook of the runtime's finalize: post what the layers hold (best effort) and stop
    their threads. The configuration stays for a later init."""
    global _applied, _runtime
    with _lock:
        try:
            _retire(runtime.timeout)
        except Exception as exc:  # noqa: BLE001 - finalize goes on
            log.warning("mcrdl: finalize: calls held by the extensions could not all be "
                        "posted: %s", exc)
        _applied = _runtime = None
        logger().finish_pending()
        logger().attach(None)
