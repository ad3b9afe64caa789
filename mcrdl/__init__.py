"""mcrdl: a mix-and-match communication runtime for deep learning.

One API for every point-to-point and collective operation on PyTorch tensors over
pluggable backends ("mpi", "gloo", ... or "auto"), each on its own execution lane.
See docs/api.md for the contract and docs/architecture.md for the layers::

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
from . import api
from .api import (
    all_gather_object,
    available_backends,
    broadcast_object,
    finalize,
    get_backends,
    get_rank,
    get_size,
    get_world_size,
    init,
    is_initialized,
    new_group,
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
from .extensions import (
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
from .bootstrap import select_mpich_collectives as _select_mpich_collectives
from .ops import ALIASES, OPS, ReduceOp
from . import torch_backend
from .torch_backend import TorchBackendOptions
from .torch_backend import routes as torch_routes
from .torch_backend import set_routes as set_torch_routes
from .work import Work

# Before the program may initialize MPI itself (mpi4py.MPI imported after mcrdl): MPICH
# reads its collective selection in MPI_Init only (mcrdl.bootstrap).
_select_mpich_collectives()

# The operations: mcrdl.all_reduce(backend, tensor, ...) and the others, one function per
# spec of mcrdl.ops.OPS, made in mcrdl.api.
globals().update({name: getattr(api, name) for name in (*OPS, *ALIASES)})

Work.register(_C.Work)
Work.register(_C.FusedCall)

# torch.distributed.init_process_group("mcrdl"): the backend calls mcrdl through the front.
torch_backend.register(api)

__version__ = "0.1.0"

__all__ = [
    "init", "finalize", "is_initialized", "available_backends", "get_backends", "get_rank",
    "get_size", "get_world_size", "new_group", "synchronize",
    *OPS, *ALIASES, "all_gather_object", "broadcast_object",
    "ReduceOp", "Group", "Work", "Backend", "Capabilities", "register_backend",
    "MCRDLError", "BackendUnavailableError", "InvalidArgumentError", "UnsupportedOperationError",
    "CommTimeoutError", "DesyncError",
    "configure", "extensions", "FusionConfig", "CompressionConfig", "LoggingConfig",
    "log_summary", "export_log", "export_trace", "reset_log", "compression_stats",
    "TorchBackendOptions", "set_torch_routes", "torch_routes",
]
