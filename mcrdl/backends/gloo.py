"""The "gloo" backend: torch.distributed's ProcessGroupGloo (CPU tensors).

Everything but the process group itself is shared with NCCL/RCCL in c10d.py.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import BackendUnavailableError
from .base import Capabilities, InitContext
from .c10d import C10dBackend


class GlooBackend(C10dBackend):
    name = "gloo"
    capabilities = Capabilities(
        notes={"v variants, all_to_all lists": "built on alltoall_base with packing",
               "reduce_scatter": "all_reduce of the input, then this rank's block"}
    )
    # c10d's Gloo SendWork/RecvWork report is_completed() False until wait() was called.
    p2p_wait_only = True

    @classmethod
    def availability(cls, launch) -> str | None:
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if not dist.is_gloo_available():
            return "this torch build has no Gloo"
        return None

    def __init__(self, ctx: InitContext):
        # One node: loopback. Several: the device of this host's name, or the interface
        # GLOO_SOCKET_IFNAME names.
        self._single_node = ctx.bootstrap.single_node()
        super().__init__(ctx)

    def _new_pg(self, store, rank: int, size: int):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=self.ctx.timeout)
        if os.environ.get("GLOO_SOCKET_IFNAME"):
            device = dist.ProcessGroupGloo.create_device(
                interface=os.environ["GLOO_SOCKET_IFNAME"].split(",")[0])
        elif self._single_node:
            device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        else:
            device = dist.ProcessGroupGloo.create_default_device()
        opts._devices = [device]
        opts._threads = 2
        return dist.ProcessGroupGloo(store, rank, size, opts)

    def _check_device(self, op: str, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            raise BackendUnavailableError(
                f"{op}: backend 'gloo' in mcrdl handles CPU tensors; got a tensor on {t.device}. "
                "Move it to the CPU or use backend 'nccl'"
            )
