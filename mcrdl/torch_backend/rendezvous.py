"""torch.distributed rendezvous on mcrdl's bootstrap store, for launchers that set none
of the variables torch's ``env://`` needs (mpiexec, srun with PMI, a plain ``python``).

- ``init_method="mcrdl://"``: rendezvous on mcrdl's store, always.
- ``env://`` (torch's default): torch's own handler whenever MASTER_ADDR, MASTER_PORT,
  RANK and WORLD_SIZE are there (torchrun sets them) or the process was not started by
  mpiexec, srun or a plain ``python``; otherwise mcrdl's, so that
  ``init_process_group(backend)`` needs no other argument under mpiexec, whatever the
  backend, and ``new_group(backend="gloo")`` and everything else that needs the default
  store has one.

mcrdl's store: rank 0 opens a TCPStore on a free port of its host and the others learn
the address over MPI (mcrdl.bootstrap); rank and size come from mcrdl's launch
discovery. Making it creates mcrdl's runtime without backends (``init([])``) when there
is none; ``init_process_group("mcrdl")`` then adds the backends.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import itertools
import os
from collections.abc import Iterator
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..launch import detect
from .convert import explicit_timeout

SCHEME = "mcrdl"
_ENV_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")
# Launchers whose processes know their rank and size without torch's variables.
_SELF_DESCRIBED = ("mpi", "slurm", "single")
# torch.distributed.rendezvous is also the name of a function there, which shadows the
# module as an attribute.
torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
# Rendezvous made so far in this process: each gets a store prefix of its own, so that
# a second init_process_group (after destroy_process_group) never reads the keys of the
# first. Every rank makes the same sequence of them.
_count = itertools.count()


def install(front) -> None:
    """Register the ``mcrdl://`` scheme and put the env:// fallback in front of torch's
    env:// handler (once per process). torch has no public way to extend a scheme, so
    the fallback replaces the entry of torch's handler table, keeping the original."""
    handlers = torch_rendezvous._rendezvous_handlers
    if SCHEME not in handlers:
        torch_rendezvous.register_rendezvous_handler(
            SCHEME, functools.partial(_mcrdl_rendezvous, front))
    env = handlers.get("env")
    if env is not None and not isinstance(env, _EnvOrMcrdl):
        handlers["env"] = _EnvOrMcrdl(env, front)


class _EnvOrMcrdl:
    """torch's env:// handler, or mcrdl's rendezvous when its variables are missing and
    mcrdl's launch discovery knows rank and size."""

    def __init__(self, env_handler, front):
        self.env_handler = env_handler
        self.front = front

    def __call__(self, url: str, timeout: datetime.timedelta = default_pg_timeout, **kwargs):
        query = parse_qs(urlparse(url).query)
        described = all(v in os.environ for v in _ENV_VARIABLES) and all(
            name in query or name.upper() in os.environ for name in ("rank", "world_size"))
        if described or detect().launcher not in _SELF_DESCRIBED:
            return self.env_handler(url, timeout=timeout, **kwargs)
        return _mcrdl_rendezvous(self.front, url, timeout=timeout)


def _mcrdl_rendezvous(front, url: str, timeout: datetime.timedelta = default_pg_timeout,
                      **kwargs) -> Iterator[tuple[dist.Store, int, int]]:
    query = parse_qs(urlparse(url).query)
    if front.current_runtime() is None:
        front.init([], timeout=explicit_timeout(timeout))
    runtime = front.current_runtime()
    rank, size = runtime.rank, runtime.world_size
    for name, value in (("rank", rank), ("world_size", size)):
        given = int(query[name][0]) if name in query else -1
        if given not in (-1, value):
            raise ValueError(
                f"init_process_group: {name}={given} differs from what mcrdl's launch "
                f"discovery found ({value}, launcher {runtime.launch.launcher}); leave "
                f"{name} to the launcher")
    store = dist.PrefixStore(f"torch/{next(_count)}", runtime.bootstrap.store())
    yield store, rank, size
    raise RuntimeError("mcrdl:// rendezvous cannot rendezvous again (no elastic restarts)")
