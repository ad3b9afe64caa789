"""Set-up traffic between ranks: object exchange for init/new_group and the TCP store
that Gloo (and third-party backends) rendezvous on. Main thread only; never on the
hot path."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys

from .errors import BackendUnavailableError
from .launch import LaunchInfo


def mpi_module():
    """mpi4py's MPI module, initialized with MPI_THREAD_MULTIPLE (lanes need it)."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    if not MPI.Is_initialized():
        raise BackendUnavailableError(
            "mpi4py was imported with rc.initialize=False and MPI is not initialized; "
            "let mcrdl initialize MPI or call MPI.Init_thread(MPI.THREAD_MULTIPLE) first"
        )
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise BackendUnavailableError(
            "MPI was initialized without MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level was "
            "changed before importing mpi4py.MPI); mcrdl's lanes need it: import mcrdl "
            "before mpi4py.MPI or leave rc.thread_level at 'multiple'"
        )
    return MPI


class Bootstrap:
    """Object collectives over the MPI world when there is one, else over a TCP store."""

    def __init__(self, info: LaunchInfo, timeout: float):
        self.info = info
        self.timeout = timeout
        self._comm = None
        self._store = None
        self._seq = 0
        if info.mpi_world:
            self._comm = mpi_module().COMM_WORLD.Dup()

    @property
    def rank(self) -> int:
        return self._comm.Get_rank() if self._comm is not None else self.info.rank

    @property
    def size(self) -> int:
        return self._comm.Get_size() if self._comm is not None else self.info.size

    def allgather_obj(self, obj: object) -> list:
        if self._comm is not None:
            return self._comm.allgather(obj)
        store = self.store()
        self._seq += 1
        store.set(f"bootstrap/{self._seq}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(store.get(f"bootstrap/{self._seq}/{r}")) for r in range(self.size)]

    def bcast_obj(self, obj: object, root: int = 0) -> object:
        if self._comm is not None:
            return self._comm.bcast(obj, root=root)
        return self.allgather_obj(obj if self.rank == root else None)[root]

    def store(self):
        """A torch.distributed store shared by all ranks (created on first use)."""
        if self._store is None:
            self._store = self._make_store()
        return self._store

    def _make_store(self):
        import torch.distributed as dist

        td = datetime.timedelta(seconds=self.timeout)
        env = os.environ
        if self._comm is not None:
            host = env.get("MASTER_ADDR") or _this_host(self.info)
            store = None
            if self.rank == 0:
                store = dist.TCPStore(host, 0, self.size, True, td, wait_for_workers=False)
                addr = (host, store.port)
            else:
                addr = None
            host, port = self._comm.bcast(addr, root=0)
            if store is None:
                store = dist.TCPStore(host, port, self.size, False, td)
        elif self.info.launcher == "single":
            store = dist.TCPStore("127.0.0.1", 0, 1, True, td, wait_for_workers=False)
        else:
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise BackendUnavailableError(
                    f"launched by {self.info.launcher} without MASTER_ADDR/MASTER_PORT: set both "
                    "(the address and a free port of rank 0's node) or launch with mpiexec"
                )
            agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), self.size,
                                  self.rank == 0 and not agent, td)
        return dist.PrefixStore("mcrdl", store)

    def close(self) -> None:
        """Collective: rank 0 hosts the store, so it leaves only after every rank is done."""
        if self._comm is not None:
            self._comm.Barrier()
            self._comm.Free()
            self._comm = None
        elif self._store is not None and self.size > 1:
            self.allgather_obj(None)
            if self.rank == 0:
                self._store.wait([f"bootstrap/closed/{r}" for r in range(1, self.size)])
            else:
                self._store.set(f"bootstrap/closed/{self.rank}", b"1")
        self._store = None


def _this_host(info: LaunchInfo) -> str:
    if info.local_size >= info.size:
        return "127.0.0.1"  # every rank on this node: loopback
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return socket.gethostname()
