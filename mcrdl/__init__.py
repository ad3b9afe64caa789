"""mcrdl: a mix-and-match communication runtime for deep learning.

One API for every point-to-point and collective operation on PyTorch tensors over
pluggable backends ("mpi", "gloo", ... or "auto"), each on its own execution lane.
See API.md for the contract::

    import mcrdl, torch
    mcrdl.init(["mpi", "gloo"])
    t = torch.ones(4)
    mcrdl.all_reduce("mpi", t)
    w = mcrdl.all_gather("gloo", torch.empty(4 * mcrdl.get_size()), t, async_op=True)
    w.wait()
"""

import torch  # noqa: F401, I001  (loads libtorch, which mcrdl._C links against)

from . import errors  # noqa: F401, I001  (before _C: the extension looks the classes up)
from . import _C
from .api import (
    all_gather,
    all_gatherv,
    all_reduce,
    all_to_all,
    all_to_all_single,
    all_to_allv,
    available_backends,
    barrier,
    bcast,
    broadcast,
    finalize,
    gather,
    gatherv,
    get_backends,
    get_rank,
    get_size,
    get_world_size,
    init,
    is_initialized,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    scatterv,
    send,
    synchronize,
)
from .backends import Backend, Capabilities, register_backend
from .errors import (
    BackendUnavailableError,
    CommTimeoutError,
    DesyncError,
    InvalidArgumentError,
    MCRDLError,
    UnsupportedOperationError,
)
from .fusion import (
    CompressionConfig,
    FusionConfig,
    LoggingConfig,
    compression_stats,
    configure,
    export_log,
    export_trace,
    extensions,
    log_summary,
    reset_log,
)
from .groups import Group
from .ops import ReduceOp
from .work import Work

Work.register(_C.Work)
Work.register(_C.FusedCall)

__version__ = "0.1.0"

__all__ = [
    "init", "finalize", "is_initialized", "available_backends", "get_backends", "get_rank",
    "get_size", "get_world_size", "new_group", "synchronize",
    "all_reduce", "reduce", "bcast", "broadcast", "all_gather", "gather", "scatter",
    "reduce_scatter", "all_to_all_single", "all_to_all", "gatherv", "scatterv", "all_gatherv",
    "all_to_allv", "send", "recv", "barrier",
    "ReduceOp", "Group", "Work", "Backend", "Capabilities", "register_backend",
    "MCRDLError", "BackendUnavailableError", "InvalidArgumentError", "UnsupportedOperationError",
    "CommTimeoutError", "DesyncError",
    "configure", "extensions", "FusionConfig", "CompressionConfig", "LoggingConfig",
    "log_summary", "export_log", "export_trace", "reset_log", "compression_stats",
]
