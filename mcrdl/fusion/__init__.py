"""Tensor fusion: small calls of one (backend, group) combined into one buffer.

Calls of all_reduce, all_gather, bcast and reduce_scatter on CPU tensors smaller than
B bytes are buffered per (backend, group) in issue order; a *flush* posts the buffered
calls as few backend calls as it can: one per fusion key (operation, dtype, reduce op
or root) and B bytes; each caller's Work completes when its slice was copied back into
its own tensors.

Each (backend, group) has its own buffer, flushed by its own rounds on its queue's
worker thread: a buffer flushed when its oldest call is T old posts its fused calls like
any async call, overlapping with the other backends' calls and with the caller.

The calls themselves live in C++ (``_C.FusionQueue``, csrc/fusion.cpp): buffering a call
(validated, recorded, its Work returned) and a flush's per-call work (cutting, packing,
copying back, marking posted) cost a fraction of a microsecond each; the rounds, the
timer and the posting are Python (``buffer.py``, ``calls.py``).

Inputs are read when the round posts (as a backend reads them when it runs the op): do
not change a tensor before its Work completes, and do not pass one tensor to two
outstanding fused calls. The data reaches your tensors when the Work is waited or
polled, or at synchronize.

The package, from the call path down:

- ``config.py``: :class:`FusionConfig`, B (``buffer_bytes``) and T (``wait_us``) and the
  operations that fuse;
- ``layer.py``: :class:`Fused`, the layer on the call path (mcrdl.extensions.stack puts
  it under "log calls"): which calls it buffers and which pass through, in order;
- ``buffer.py``: :class:`FusionBuffer`, the buffer of one (backend, group): its flushes,
  each a round that starts with the agreement of the ranks on the calls it flushes, and
  the completion of the fused calls; :func:`fusion_stats`;
- ``calls.py``: one fused backend call per fusion key, and the copy of its results back
  into the callers' tensors.
"""

from .buffer import FusionBuffer, fusion_stats
from .config import FusionConfig
from .layer import Fused

__all__ = ["Fused", "FusionBuffer", "FusionConfig", "fusion_stats"]
