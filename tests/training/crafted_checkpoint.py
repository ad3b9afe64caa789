"""Files crafted as an attacker with write access to a checkpoint folder would: each runs
a shell command (``touch MARKER``) when unpickled, and the manifest beside a replaced
shard is updated to its size and sha256, so that only the loader stands in the way.

``Payload`` is the object whose ``__reduce__`` returns ``(os.system, ("touch MARKER",))``:
pickling it stores the global ``posix.system`` (``nt.system`` on Windows) and the
command; unpickling imports and calls it. Used by tests/test_checkpoint_safety.py and
tests/training/crafted_resume.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import torch


class Payload:
    """Runs ``touch marker`` when unpickled."""

    def __init__(self, marker: str | os.PathLike):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def crafted_bytes(marker: str | os.PathLike, kind: str = "torch") -> bytes:
    """A file that creates `marker` when unpickled: "torch", a torch.save archive of a
    state_dict-like dict with the payload beside a tensor (what a shard looks like);
    "pickle", a bare pickle of it (torch.load reads those through its legacy path)."""
    obj = {"model": {"w": torch.zeros(4)}, "step": 1, "optimizer": Payload(marker)}
    if kind == "pickle":
        return pickle.dumps(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def replace_shard(directory: str | os.PathLike, index: int, data: bytes) -> Path:
    """Replace the shard listed `index`-th in checkpoint `directory`'s manifest by `data`
    and update the manifest's size and sha256 of it; returns the shard's path."""
    directory = Path(directory)
    mpath = directory / "manifest.json"
    manifest = json.loads(mpath.read_text())
    entry = sorted(manifest["shards"], key=lambda s: s["stage"])[index]
    path = directory / entry["file"]
    path.write_bytes(data)
    entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    mpath.write_text(json.dumps(manifest, indent=1))
    return path


def set_format(directory: str | os.PathLike, fmt: str) -> None:
    """Rewrite checkpoint `directory`'s manifest as one of format `fmt`."""
    mpath = Path(directory) / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["format"] = fmt
    mpath.write_text(json.dumps(manifest, indent=1))


def to_previous_format(directory: str | os.PathLike) -> None:
    """Rewrite honest checkpoint `directory` as the previous format wrote it: each shard
    the ``torch.save`` of its state, the manifest of format 1 with their sizes."""
    from training.core import checkpoint as ckpt

    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    for index, entry in enumerate(sorted(manifest["shards"], key=lambda s: s["stage"])):
        path = Path(directory) / entry["file"]
        buf = io.BytesIO()
        torch.save(ckpt.load_file(path, path), buf)
        replace_shard(directory, index, buf.getvalue())
    set_format(directory, ckpt.TRUSTED_ONLY[-1])
