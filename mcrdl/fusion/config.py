"""The settings of tensor fusion: B (``buffer_bytes``), T (``wait_us``) and the
operations that fuse. ``mcrdl.configure(fusion=...)`` takes them (mcrdl.extensions.config
turns its argument into a :class:`FusionConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import op_names, positive_number
from ..ops import FUSABLE_OPS

MIB = 1 << 20


@dataclass(frozen=True)
class FusionConfig:
    """Tensor fusion (the paper's Tensor Fusion): small async calls with the same
    (backend, group, operation, dtype, reduce op or root) are combined into one call.

    ``buffer_bytes`` (B): a fused call carries at most this many bytes; a call of B bytes
    or more is not fused. ``wait_us`` (T): a call waits at most this long (microseconds)
    for others to join before its buffer is flushed anyway; waiting on a fused call,
    a blocking call, a call that cannot be fused on the same (backend, group),
    ``synchronize`` and ``finalize`` flush earlier. ``ops``: which operations fuse.
    """

    buffer_bytes: int = 16 * MIB
    wait_us: float = 2000.0
    ops: frozenset = FUSABLE_OPS

    def __post_init__(self) -> None:
        positive_number("FusionConfig", "buffer_bytes", self.buffer_bytes, integer=True)
        positive_number("FusionConfig", "wait_us", self.wait_us)
        object.__setattr__(self, "ops", op_names("FusionConfig", self.ops, FUSABLE_OPS))
