"""What every engine's run does around its model: pick the device, initialize mcrdl,
and the collective parts of checkpointing (a save through its staging directory, errors
raised together on every rank, a resume's checks and load). ``--init-from``'s weights:
training/models/init_source.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import torch

import mcrdl

from . import checkpoint as ckpt


def pick_device(device: str) -> torch.device:
    """`device` (--device), or for "auto" this rank's GPU if there is one, else cpu. The GPU is the
    one the nccl backend takes: the node-local rank as the launcher gives it (mpiexec of
    MPICH or Open MPI, srun, torchrun; mcrdl.launch.detect) modulo the visible GPUs."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        local = mcrdl.launch.detect().local_rank
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def init_comm(given: list[str], device: torch.device, timeout: float | None, *,
              nccl_with_given: bool = False) -> None:
    """Initialize mcrdl with the backends `given` (default mpi, else gloo; plus nccl on a
    GPU when mcrdl has it, also beside the given ones with `nccl_with_given`), unless
    the caller did."""
    if mcrdl.is_initialized():
        return
    usable = mcrdl.available_backends()
    names = list(given) or [n for n in ("mpi",) if n in usable] or ["gloo"]
    if (device.type == "cuda" and "nccl" in usable and "nccl" not in names
            and (nccl_with_given or not given)):
        names.append("nccl")
    mcrdl.init(names, **({"timeout": timeout} if timeout else {}))


def save_checkpoint(root: str, step: int, *, write_shard: Callable[[Path], dict | None],
                    manifest: Callable[[list[dict]], dict],
                    group: mcrdl.Group | None = None) -> Path:
    """Collective over `group` (None: the world): a checkpoint of `step` under `root`.
    Each rank's ``write_shard(directory)`` writes its file(s) into the save's staging
    directory and returns its manifest entry (None: it writes none); then the group's
    rank 0 writes ``manifest(entries)`` (the entries of every rank, in rank order),
    which publishes the checkpoint. Returns the step directory once the manifest is on
    disk; a failed write on any rank raises CheckpointError on every rank."""
    token = mcrdl.broadcast_object(uuid.uuid4().hex[:12], group=group)
    final = ckpt.step_dir(root, step)
    directory = ckpt.staging_dir(final, token)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # a rank's own write reports it, together (raise_together)
    entry, error = None, None
    try:
        entry = write_shard(directory)
    except (OSError, RuntimeError) as e:
        error = e
    raise_together(error, f"cannot save checkpoint {final}", group)
    entries = [e for e in mcrdl.all_gather_object(entry, group=group) if e is not None]
    if mcrdl.get_rank(group=group) == 0:
        try:
            ckpt.write_manifest(directory, manifest(entries), publish_as=final)
        except OSError as e:
            error = e
    raise_together(error, f"cannot save checkpoint {final}", group)  # after the manifest
    return final


def raise_together(error: Exception | None, context: str,
                   group: mcrdl.Group | None = None) -> None:
    """Collective over `group` (None: the world): when any rank has an `error`, every
    rank raises CheckpointError with the message of the lowest failing rank, so that no
    rank is left waiting for the others. Errors other than CheckpointError are prefixed with
    `context` and their type."""
    message = None
    if error is not None:
        message = (str(error) if isinstance(error, ckpt.CheckpointError)
                   else f"{context}: {type(error).__name__}: {error}")
    messages = mcrdl.all_gather_object(message, group=group)
    failed = [rank for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    text = messages[failed[0]]
    error = ckpt.CheckpointError(text if len(messages) == 1 else f"(rank {failed[0]}) {text}")
    error.agreed = True
    error.reporter = mcrdl.get_rank(group=group) == 0  # the run's rank 0, in a sub-group too
    raise error


def load_for_resume(spec: str, root: str | None, *, engine: str, dtype: str, shard: int,
                    check: Callable[[dict, Path], None],
                    check_shard: Callable[[dict, dict, Path], None] | None = None,
                    group: mcrdl.Group | None = None,
                    trust: bool = False) -> tuple[dict, dict]:
    """Collective over `group` (None: the world): the manifest of the checkpoint
    ``--resume`` `spec` names (``"latest"``: the newest under `root`) and this rank's
    shard number `shard` of it, once it is known to fit the run: written by `engine`,
    passing `check(manifest, path)` (the engine's model, grid and optimizer), of
    ``--dtype`` `dtype`, its shard intact and passing `check_shard(shard, manifest,
    path)`. The shard is read with ``ckpt.load_file`` (nothing in it runs); `trust`
    (``--trust-checkpoint``) also admits a checkpoint of an earlier format, read with
    pickle's full unpickler. A problem on any rank raises CheckpointError on all of them
    before any state changes."""
    error, path, manifest, state = None, None, None, None
    try:
        path = ckpt.resume_path(spec, root)
        manifest = ckpt.read_manifest(path, trust=trust)
        ckpt.check_engine(manifest, path, engine)
        check(manifest, path)
        ckpt.check_dtype(manifest, path, dtype)
        state = ckpt.load_shard(path, manifest, shard)
        if check_shard is not None:
            check_shard(state, manifest, path)
    except (ckpt.CheckpointError, OSError, RuntimeError, KeyError, ValueError) as e:
        error = e
    raise_together(error, f"cannot load checkpoint {path}", group)
    return manifest, state
