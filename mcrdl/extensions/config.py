"""Settings of the call-path extensions: tensor fusion (its FusionConfig is
mcrdl.fusion.config's), zfp compression, comm logging.

Each extension has a frozen dataclass whose constructor checks its fields and raises
InvalidArgumentError naming the bad field, the value and what is expected.
:func:`coerce` turns what ``mcrdl.configure`` / ``mcrdl.extensions`` accept for one
extension (None, False, True, a dict of fields or the dataclass) into the dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..fusion.config import FusionConfig
from ..layers import op_names, positive_number
from ..ops import COMPRESSIBLE_OPS

COMPRESSION_MODES = ("rate", "precision", "accuracy")


@dataclass(frozen=True)
class CompressionConfig:
    """zfp compression of float32/float64 payloads (see docs/extensions.md).

    ``mode``: "rate" (``rate`` bits per value, fixed size), "precision" (``precision``
    bit planes of the transform coefficients kept) or "accuracy" (absolute error at most
    ``tolerance``). Only the parameter of the chosen mode may be set. ``ops``: which
    operations compress (all of COMPRESSIBLE_OPS by default).
    """

    mode: str = "accuracy"
    rate: float | None = None
    precision: int | None = None
    tolerance: float | None = None
    ops: frozenset = COMPRESSIBLE_OPS

    def __post_init__(self) -> None:
        where = "CompressionConfig"
        if self.mode not in COMPRESSION_MODES:
            raise InvalidArgumentError(
                f"{where}: 'mode' is {self.mode!r}; expected one of {list(COMPRESSION_MODES)}")
        param = {"rate": "rate", "precision": "precision", "accuracy": "tolerance"}[self.mode]
        for name in ("rate", "precision", "tolerance"):
            value = getattr(self, name)
            if name == param:
                if value is None:
                    raise InvalidArgumentError(
                        f"{where}: mode {self.mode!r} needs '{param}' (e.g. "
                        f"CompressionConfig({self.mode!r}, {param}="
                        f"{ {'rate': 8, 'precision': 16, 'tolerance': 1e-3}[param]!r}))")
                positive_number(where, name, value, integer=name == "precision")
            elif value is not None:
                raise InvalidArgumentError(
                    f"{where}: '{name}' is set but mode is {self.mode!r}, which takes only "
                    f"'{param}'")
        if self.mode == "precision" and self.precision > 64:
            raise InvalidArgumentError(
                f"{where}: 'precision' is {self.precision}; zfp keeps at most 64 bit planes")
        object.__setattr__(self, "ops", op_names(where, self.ops, COMPRESSIBLE_OPS))
        if ("send" in self.ops) != ("recv" in self.ops):
            have, lacks = ("send", "recv") if "send" in self.ops else ("recv", "send")
            raise InvalidArgumentError(
                f"{where}: 'ops' has {have!r} without {lacks!r}: a compressed send is two "
                "messages (size, payload) that only a compressed recv reads; list both or "
                "neither")

    def zfp_args(self) -> dict:
        """Keyword arguments of zfpy.compress_numpy for this mode."""
        if self.mode == "rate":
            return {"rate": float(self.rate)}
        if self.mode == "precision":
            return {"precision": int(self.precision)}
        return {"tolerance": float(self.tolerance)}


@dataclass(frozen=True)
class LoggingConfig:
    """Communication logging: per-call records for ``mcrdl.log_summary`` and exports.

    ``trace``: keep one event per call for ``mcrdl.export_trace`` (Chrome trace);
    ``max_events``: events kept per process before new ones are only counted (the
    summary statistics keep counting). ``wire``: when fusion or compression is on, also
    log what is actually sent to the backends (fused buffers, size exchanges,
    compressed payloads) as level "wire".
    """

    trace: bool = True
    max_events: int = 1_000_000
    wire: bool = True

    def __post_init__(self) -> None:
        for name in ("trace", "wire"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"LoggingConfig: '{name}' is {getattr(self, name)!r}; expected True or False")
        positive_number("LoggingConfig", "max_events", self.max_events, integer=True)


@dataclass(frozen=True)
class ExtensionConfig:
    """Which extensions are on (None: off) and their settings."""

    fusion: FusionConfig | None = None
    compression: CompressionConfig | None = None
    logging: LoggingConfig | None = None

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.fusion, self.compression, self.logging))


_CLASSES = {"fusion": FusionConfig, "compression": CompressionConfig, "logging": LoggingConfig}


def coerce(name: str, value: object, current: object) -> object:
    """The setting of extension `name` from a configure()/extensions() argument:
    None keeps `current`, False turns it off, True takes the defaults (for compression:
    mode "accuracy" needs a tolerance, so True is refused), a dict gives fields."""
    cls = _CLASSES[name]
    if value is None:
        return current
    if value is False:
        return None
    if value is True:
        if cls is CompressionConfig:
            raise InvalidArgumentError(
                "compression=True: say which zfp mode and parameter, e.g. "
                "compression=mcrdl.CompressionConfig('accuracy', tolerance=1e-3) or "
                "compression={'mode': 'rate', 'rate': 8}")
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise InvalidArgumentError(
                f"{name}: unknown setting(s) {unknown}; {cls.__name__} has {sorted(fields)}")
        return cls(**value)
    raise InvalidArgumentError(
        f"'{name}' is {value!r}; expected None (unchanged), False (off), True (defaults), "
        f"a dict of settings or a mcrdl.{cls.__name__}")
