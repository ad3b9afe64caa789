"""The "nccl" and "rccl" backends: torch.distributed's ProcessGroupNCCL (CUDA / ROCm).

Stream-aware: an async op runs on the process group's own CUDA stream, which first waits
on an event of the caller's current stream; ``Work.wait()`` makes the caller's current
stream wait on the op's end event, so there is no host synchronisation on the hot path.
A blocking call runs on the caller's current stream (c10d's ``asyncOp=False``): the same
order without the events and the tensor stashing (1-2 us of host time a call).
The finish steps mcrdl adds (AVG division, list copy-back) are enqueued after that wait,
on the caller's stream. One GPU per rank: the device of the local rank.

The op mapping is shared with Gloo (c10d.py) and tested there on the CPU. Timeouts are
NCCL's: its watchdog aborts the communicator (and, by default, the process) when an op
exceeds the init timeout.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..errors import BackendUnavailableError
from .base import Capabilities, InitContext
from .c10d import C10dBackend


class NCCLBackend(C10dBackend):
    name = "nccl"
    capabilities = Capabilities(devices=frozenset({"cuda"}), stream_aware=True)
    native_reduce_scatter = True
    native_avg = True
    #: the torch build this library comes with: "cuda" (NCCL) or "rocm" (RCCL)
    platform = "cuda"

    @classmethod
    def availability(cls, launch) -> str | None:
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        rocm = bool(getattr(torch.version, "hip", None))
        if cls.platform == "cuda" and rocm:
            return "this torch is a ROCm build: use backend 'rccl'"
        if cls.platform == "rocm" and not rocm:
            return "this torch is not a ROCm build: use backend 'nccl' on NVIDIA GPUs"
        if not dist.is_nccl_available() or not hasattr(dist, "ProcessGroupNCCL"):
            return f"this torch build has no {cls.name.upper()} (a CPU-only build?)"
        if not torch.cuda.is_available():
            return "no GPU is visible to this process (torch.cuda.is_available() is False)"
        return None

    def __init__(self, ctx: InitContext):
        info = ctx.bootstrap.info
        self.device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        super().__init__(ctx)

    def _new_pg(self, store, rank: int, size: int):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=self.ctx.timeout)
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    def _barrier_options(self, async_op: bool):
        return self._opts(dist.BarrierOptions, async_op, device_ids=(self.device.index,))

    def _check_device(self, op: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise BackendUnavailableError(
                f"{op}: backend '{self.name}' of this rank uses {self.device}, got a tensor on "
                f"{t.device}; move it with .to('{self.device}') or use 'mpi'/'gloo' for CPU "
                "tensors"
            )


class RCCLBackend(NCCLBackend):
    name = "rccl"
    platform = "rocm"
