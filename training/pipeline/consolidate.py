"""The serial GPT ``state_dict`` from a pipeline checkpoint: the stages' shards merged
in unit order (SAMO's compressed shards expanded, ``--masters``: the fp32 masters)."""

from __future__ import annotations

import os

import torch

from ..core.checkpoint import CheckpointError, load_shard, shard_weights


def consolidate(directory: str | os.PathLike, manifest: dict, *,
                masters: bool = False) -> tuple[dict, dict]:
    """(state_dict of the whole model, model config dict) from the stage shards of the
    checkpoint `directory` (its `manifest`)."""
    state: dict[str, torch.Tensor] = {}
    for entry in sorted(manifest["shards"], key=lambda s: s["stage"]):
        model = shard_weights(load_shard(directory, manifest, entry["stage"]), manifest,
                              directory, masters)
        overlap = set(state) & set(model)
        if overlap:
            raise CheckpointError(f"stage {entry['stage']} repeats parameters "
                                  f"{sorted(overlap)[:3]}")
        state.update(model)
    n_units = manifest["model"]["n_layer"] + 2
    present = {int(k.split(".")[1]) for k in state}
    missing = sorted(set(range(n_units)) - present)
    if missing:
        raise CheckpointError(f"{directory}: no shard holds units {missing}")
    order = sorted(state, key=lambda k: (int(k.split(".")[1]), k))
    return {k: state[k] for k in order}, manifest["model"]
