"""The serial MoEGPT ``state_dict`` from a TED checkpoint (train_moe: one file per rank),
and the version of its tensor-parallel layout that a resume or consolidation reads."""

from __future__ import annotations

import os

import torch

from ..core.checkpoint import CheckpointError, load_shard
from ..core.sharding import Split

#: How a shard's tensor-parallel pieces are cut (``layout`` of each rank file): the 4D
#: engine's ``Split`` per parameter. Earlier checkpoints (Megatron layers, no such key)
#: do not load.
LAYERS = "parallel4d-split"


def check_layers(manifest: dict, path) -> None:
    """CheckpointError unless `manifest` was written with this version's LAYERS."""
    if manifest.get("layers") != LAYERS:
        raise CheckpointError(
            f"checkpoint {path} was written by an earlier TED (its tensor-parallel layers "
            f"are {manifest.get('layers')!r}, this version reads {LAYERS!r}); resume or "
            "consolidate it with the mcrdl version that wrote it, then start from the "
            "consolidated state_dict with --init-from")


def consolidate(directory: str | os.PathLike, manifest: dict, *,
                masters: bool = False) -> tuple[dict, dict]:
    """(the serial MoEGPT state_dict, {"model": ..., "moe": ...}) from the TED checkpoint
    `directory` (its `manifest`): each tensor-parallel parameter reassembled from its
    tensor ranks' pieces by its ``Split``, each expert taken from the rank holding it."""
    if masters:
        raise CheckpointError(f"{directory}: --masters: train_moe's optimizer shards "
                              "its master weights (ZeRO-1); consolidate without it")
    check_layers(manifest, directory)
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    splits: dict[str, Split] = {}
    for entry in manifest["shards"]:
        shard = load_shard(directory, manifest, entry["stage"])
        for name, t in shard["model"].items():
            pieces.setdefault(name, {}).setdefault(shard["tensor_rank"], t)
            splits[name] = Split(**shard["layout"][name]["split"])
    g_tensor = manifest["grid"]["G_tensor"]
    sizes = {"x": g_tensor, "y": 1, "z": 1, "data": 1}
    out = {}
    for name in sorted(pieces):
        split, by_rank = splits[name], pieces[name]
        if "x" in split.split_axes and sorted(by_rank) != list(range(g_tensor)):
            raise CheckpointError(f"{directory}: {name} lacks tensor ranks "
                                  f"{sorted(set(range(g_tensor)) - set(by_rank))}")
        out[name] = split.assemble({(t, 0, 0): piece for t, piece in by_rank.items()}, sizes)
    return out, {"model": manifest["model"], "moe": manifest["moe"]}
