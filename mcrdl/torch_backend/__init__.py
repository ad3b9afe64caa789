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

import torch.distributed as dist

from . import rendezvous
from .process_group import BACKEND_NAME, ProcessGroupMCRDL, create
from .routing import ROUTES_ENV, TorchBackendOptions, process_routes, set_routes

__all__ = ["BACKEND_NAME", "ROUTES_ENV", "ProcessGroupMCRDL", "TorchBackendOptions",
           "register", "routes", "set_routes"]


def register(front) -> None:
    """Register the backend name "mcrdl" for CPU and CUDA tensors and the rendezvous on
    mcrdl's store (rendezvous.py). Cheap: nothing is initialized until torch creates a
    process group. Called by ``import mcrdl``."""
    dist.Backend.register_backend(BACKEND_NAME, functools.partial(create, front),
                                  extended_api=True, devices=["cpu", "cuda"])
    rendezvous.install(front)


def routes() -> dict[str, str]:
    """The process-wide routes: c10d operation family -> mcrdl backend ("auto" where
    none is set); groups made with routes of their own keep theirs."""
    return dict(process_routes())
