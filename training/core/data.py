"""Training data that works offline on any machine.

- ``ByteCorpus``: byte-level text (vocabulary 256) built from the Python standard
  library's own source files, present wherever Python is. Files are read in sorted
  order up to ``max_bytes``; the last ``val_fraction`` is held out.
- ``TokenFile``: nanoGPT-style ``.bin`` memmaps of uint16 token ids (``train.bin``,
  ``val.bin`` from nanoGPT's prepare scripts) for users' own data.

Batches are a pure function of (seed, step): the global batch of step s is
``global_batch`` windows at offsets drawn from a generator seeded by (seed, s), and
data-parallel rank r takes rows ``r*B/G_data .. (r+1)*B/G_data``. A serial run and any
parallel layout therefore see exactly the same samples, and resuming needs no state.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch


class ByteCorpus:
    vocab_size = 256

    def __init__(self, max_bytes: int = 4 << 20, val_fraction: float = 0.1,
                 root: str | None = None):
        root = Path(root or sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise FileNotFoundError(f"ByteCorpus: no standard library sources at {root}; "
                                    "pass root= a directory of text files")
        chunks, total = [], 0
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.parts or "dist-packages" in path.parts:
                continue
            try:
                b = path.read_bytes()
            except OSError:
                continue
            chunks.append(b[: max_bytes - total])
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        if len(data) < 4096:
            raise ValueError(f"ByteCorpus: only {len(data)} bytes of text under {root}")
        n_val = int(len(data) * val_fraction)
        self.splits = {"train": data[: len(data) - n_val], "val": data[len(data) - n_val:]}
        self.source = str(root)
        self.digest = hashlib.sha256(data.tobytes()).hexdigest()[:16]

    def describe(self) -> str:
        n = sum(len(v) for v in self.splits.values())
        return f"bytes of {self.source}/**/*.py ({n / 2**20:.1f} MiB, sha256 {self.digest})"


class TokenFile:
    """``<dir>/train.bin`` and ``<dir>/val.bin``: uint16 token ids (nanoGPT format)."""

    def __init__(self, directory: str, vocab_size: int, dtype=np.uint16):
        self.splits = {}
        for split in ("train", "val"):
            p = os.path.join(directory, f"{split}.bin")
            if os.path.exists(p):
                self.splits[split] = np.memmap(p, dtype=dtype, mode="r")
        if "train" not in self.splits:
            raise FileNotFoundError(f"TokenFile: {directory}/train.bin not found (nanoGPT "
                                    "memmap of uint16 token ids)")
        self.vocab_size = vocab_size
        self.source = directory

    def describe(self) -> str:
        return f"token memmap {self.source} ({len(self.splits['train'])} train tokens)"


def load_dataset(spec: str | None, vocab_size: int | None = None):
    """``None``/``"stdlib"`` -> ByteCorpus (one per process: reading the sources costs
    ~1 s of CPU, which every Trainer of a test or benchmark launch paid again); a
    directory -> TokenFile."""
    if spec in (None, "", "stdlib"):
        return _stdlib_corpus()
    if os.path.isdir(spec):
        return TokenFile(spec, vocab_size or 50304)
    raise FileNotFoundError(f"--data {spec!r}: expected 'stdlib' or a directory with "
                            "train.bin/val.bin")


@functools.cache
def _stdlib_corpus() -> ByteCorpus:
    """The default corpus, read once: its arrays are never written to."""
    return ByteCorpus()


class Batches:
    """Deterministic global batches, sharded by data-parallel rank, cut into microbatches."""

    def __init__(self, dataset, block_size: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, split: str = "train"):
        if global_batch % (dp_size * micro_batch):
            raise ValueError(
                f"global batch size {global_batch} is not a multiple of data-parallel degree "
                f"{dp_size} x micro-batch size {micro_batch}; choose --global-batch-size as a "
                f"multiple of {dp_size * micro_batch}")
        self.data = dataset.splits[split]
        if len(self.data) <= block_size + 1:
            raise ValueError(f"split {split!r} has {len(self.data)} tokens; need more than "
                             f"block_size + 1 = {block_size + 1}")
        self.block_size, self.global_batch, self.micro_batch = block_size, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.local_batch = global_batch // dp_size
        self.n_micro = self.local_batch // micro_batch

    def offsets(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.data) - self.block_size - 1, size=self.global_batch)

    def _windows(self, offs) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.block_size
        rows = np.stack([np.asarray(self.data[o:o + t + 1], dtype=np.int64) for o in offs])
        rows = torch.from_numpy(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the whole global batch (what a serial run trains on)."""
        return self._windows(self.offsets(step))

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's share of step `step`, as `n_micro` (x, y) pairs."""
        offs = self.offsets(step)[self.dp_rank * self.local_batch:
                                  (self.dp_rank + 1) * self.local_batch]
        x, y = self._windows(offs)
        return list(zip(x.split(self.micro_batch), y.split(self.micro_batch), strict=True))
