"""The serial GPT ``state_dict`` from a 4D checkpoint: every tensor rank's pieces put back
where their splits say (undoing the Z flattening and c_attn's head permutation)."""

from __future__ import annotations

import os

from ..core.checkpoint import load_shard, shard_weights
from ..core.sharding import Split


def consolidate(directory: str | os.PathLike, manifest: dict, *,
                masters: bool = False) -> tuple[dict, dict]:
    """(state_dict of the whole model, model config dict) from the tensor ranks' shards
    of the checkpoint `directory` (its `manifest`)."""
    grid = manifest["grid"]
    sizes = {"x": grid.get("G_x", 1), "y": grid.get("G_y", 1), "z": grid.get("G_z", 1),
             "data": 1}
    n = sizes["x"] * sizes["y"] * sizes["z"]
    shards = [load_shard(directory, manifest, i) for i in range(n)]
    splits = {name: Split(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in spec.items()})
              for name, spec in shards[0]["splits"].items()}
    weights = [shard_weights(s, manifest, directory, masters) for s in shards]
    state = {}
    for name, split in splits.items():
        pieces = {(s["coords"]["x"], s["coords"]["y"], s["coords"]["z"]): w[name]
                  for s, w in zip(shards, weights, strict=True)}
        state[name] = split.assemble(pieces, sizes)
    return state, manifest["model"]
