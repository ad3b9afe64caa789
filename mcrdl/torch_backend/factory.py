"""The creator torch calls for a process group of the "mcrdl" backend
(``init_process_group("mcrdl")``, ``new_group(backend="mcrdl")``): it initializes mcrdl
when needed and makes the :class:`~mcrdl.torch_backend.process_group.ProcessGroupMCRDL`."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from .. import launch
from ..errors import BackendUnavailableError, InvalidArgumentError
from .convert import explicit_timeout
from .process_group import ProcessGroupMCRDL, group_routes, group_timeout
from .routing import describe
from .work import watchdog

log = logging.getLogger("mcrdl")


def _runtime_timeout(front) -> float:
    runtime = front.current_runtime()
    return runtime.timeout if runtime is not None else front.DEFAULT_TIMEOUT


def _default_group_is_mcrdl() -> bool:
    """Whether torch's default group is an mcrdl one (False before init_process_group)."""
    return isinstance(dist.distributed_c10d._world.default_pg, ProcessGroupMCRDL)


def _launch_of(options, ranks: list[int]):
    """The launch mcrdl initializes from for torch's world (`ranks` empty): where no
    launcher started the processes (the launch discovery finds a plain ``python``) and
    torch describes a world of several ranks (spawned processes given rank and world
    size), the world torch describes, rendezvousing on the store torch hands the
    backend; otherwise the launcher's, which must agree with torch's (checked after
    init, naming both). A runtime made before (``mcrdl.init``) keeps its own launch."""
    found = launch.detect()
    if ranks or found.launcher != "single" \
            or (options.group_rank, options.group_size) == (found.rank, found.size):
        return contextlib.nullcontext(found)
    return launch.given(launch.torch_given(options.group_rank, options.group_size,
                                           options.store))


def create(front, options: dist.distributed_c10d._DistributedBackendOptions,
           pg_options: object) -> ProcessGroupMCRDL:
    """The creator torch calls for ``init_process_group("mcrdl")`` (the world) and for
    ``new_group(backend="mcrdl")`` under another default backend (then only the
    members call it, so only a group of every rank can be made). Initializes mcrdl with
    every usable backend unless it is initialized already; the world's explicit
    ``timeout`` becomes mcrdl's, a sub-group's is its own."""
    ranks = list(options.global_ranks_in_group)
    world_timeout = explicit_timeout(options.timeout) if not ranks else None
    owns = not front.is_initialized()
    where = f"new_group({ranks})" if ranks else "init_process_group('mcrdl')"
    if owns:
        with _launch_of(options, ranks):
            # the routes checked against what init() initializes, before it: refused
            # routes leave mcrdl uninitialized (a retry starts clean) with no collective
            # cleanup, which a failure on some ranks only would hold for the whole timeout
            group_routes(pg_options, front, where, front.available_backends())
            front.init(timeout=world_timeout)
    elif world_timeout is not None:
        front.init(front.get_backends(), timeout=world_timeout)
    world_rank, world_size = front.get_rank(), front.get_size()
    if not ranks:
        if (options.group_rank, options.group_size) != (world_rank, world_size):
            launcher = front.current_runtime().launch.launcher
            raise BackendUnavailableError(
                f"init_process_group('mcrdl'): torch's rank {options.group_rank} of "
                f"{options.group_size} differs from mcrdl's launch discovery (rank "
                f"{world_rank} of {world_size}, launcher {launcher!r}); under mpiexec, "
                "torchrun or srun leave rank and world_size to the launcher; without a "
                "launcher let init_process_group initialize mcrdl (no mcrdl.init before it)")
    elif sorted(ranks) != list(range(world_size)):
        # torch called the creator on the members only: a sub-group cannot be made
        if _default_group_is_mcrdl():
            # torch before 2.13 has no new_group hook: it calls the creator on the members
            raise InvalidArgumentError(
                f"new_group(ranks={ranks}): torch {torch.__version__} calls a backend only on "
                "the members of a new group, also when 'mcrdl' is the default group, and mcrdl "
                "creates groups collectively over every rank. Sub-groups of an mcrdl world "
                "need torch >= 2.13, which hands new_group to the default group on every rank: "
                "upgrade torch, or use groups of every rank, or mcrdl's own API "
                "(mcrdl.new_group on every rank) for the sub-group's communication")
        raise InvalidArgumentError(
            f"new_group(ranks={ranks}, backend='mcrdl'): mcrdl creates groups collectively "
            "over every rank, but torch calls a backend only on the members of a new "
            "group when the default group is another backend's. Make 'mcrdl' the default "
            "(init_process_group('mcrdl'): its new_group runs on every rank, torch >= "
            "2.13), or use a group of every rank")
    # checked before the group's collective creation, so that every rank raises alike
    routes = group_routes(pg_options, front, where)
    group = front.new_group(ranks) if ranks else None
    watchdog.default_timeout = lambda: _runtime_timeout(front)
    pg = ProcessGroupMCRDL(front, options.group_rank, options.group_size, group, routes,
                           None if group is None else group_timeout(front, options.timeout),
                           finalize_on_shutdown=owns, store=options.store)
    log.info("mcrdl torch backend: %s on %s: %s", where, front.get_backends(),
             describe(routes))
    return pg
