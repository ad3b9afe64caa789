"""mcrdl as a torch.distributed backend: ``torch.distributed.init_process_group("mcrdl")``.

Unmodified torch programs (DDP, FSDP2, DeviceMesh/DTensor, functional collectives,
object collectives, DCP) then run every c10d operation through mcrdl: "auto" routing
or the per-operation routes of routing.py, the backends' lanes, timeouts, debug mode
and the call-path extensions. See docs/torch_backend.md.

This package never imports the front: ``mcrdl/__init__.py`` calls :func:`register`
with it (``mcrdl.api``), and the process groups call mcrdl through that.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch.distributed as dist

from . import monitored, rendezvous, routing
from .factory import create
from .process_group import BACKEND_NAME, ProcessGroupMCRDL
from .routing import ROUTES_ENV, TorchBackendOptions, process_routes

__all__ = ["BACKEND_NAME", "ROUTES_ENV", "ProcessGroupMCRDL", "TorchBackendOptions",
           "register", "routes", "set_routes"]


#: The front (mcrdl.api), given by register().
_front = None


def register(front) -> None:
    """Register the backend name "mcrdl" for CPU and CUDA tensors, the rendezvous on
    mcrdl's store (rendezvous.py) and monitored_barrier on mcrdl's groups
    (monitored.py). Cheap: nothing is initialized until torch creates a
    process group. Called by ``import mcrdl``."""
    global _front
    _front = front
    dist.Backend.register_backend(BACKEND_NAME, functools.partial(create, front),
                                  extended_api=True, devices=["cpu", "cuda"])
    rendezvous.install(front)
    monitored.install(ProcessGroupMCRDL)


def routes() -> dict[str, str]:
    """The process-wide routes: c10d operation family -> mcrdl backend ("auto" where
    none is set); groups made with routes of their own keep theirs."""
    return dict(process_routes())


def set_routes(routes: str | Mapping[str, str] | None) -> dict[str, str]:
    """Route c10d operations of every mcrdl process group without routes of its own, for
    every later call: ``"allreduce=mpi,alltoall=gloo"`` or ``{"allreduce": "mpi"}``
    (families not named go to ``"*"``'s backend if given, else "auto"); None goes back
    to ``$MCRDL_TORCH_ROUTES``. Call it at the same point on every rank, as a
    collective. Once mcrdl is initialized, a route to a backend it did not initialize
    raises BackendUnavailableError and changes nothing. Returns the new table."""
    front = _front
    initialized = front.get_backends() if front is not None and front.is_initialized() \
        else None
    return routing.set_routes(routes, initialized)
