"""Training data that works offline on any machine.

- ``ByteCorpus``: byte-level text (vocabulary 256) built from the Python standard
  library's own source files, present wherever Python is. Files are read in sorted
  order up to ``max_bytes``; the last ``val_fraction`` is held out.
- ``TokenFile``: nanoGPT-style ``.bin`` memmaps of token ids (``train.bin``,
  ``val.bin``) for users' own data: uint16 as nanoGPT's prepare scripts write them, or
  the width ``meta.json`` names (``python -m training.data prepare`` writes uint32 when
  the vocabulary exceeds 65,535, as Llama-3's does). A directory without ``meta.json``
  holds uint16 ids.

Batches are a pure function of (seed, step): the global batch of step s is
``global_batch`` windows at offsets drawn from a generator seeded by (seed, s), and
data-parallel rank r takes rows ``r*B/G_data .. (r+1)*B/G_data``. A serial run and any
parallel layout therefore see exactly the same samples, and resuming needs no state.
With a Goldfish mask (training/core/goldfish.py) the dropped targets are -100
(``IGNORE_INDEX``), a function of the token ids alone: the same on every layout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .goldfish import IGNORE_INDEX, Goldfish

#: ``python -m training.data prepare``'s description of a token directory: the ids'
#: dtype, the vocabulary, the token counts, the document index files.
META = "meta.json"
#: The widths a token file may have (meta.json's "dtype").
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


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


def read_meta(directory: str | os.PathLike) -> dict:
    """`directory`'s meta.json ({} when it has none: nanoGPT's uint16 files); ValueError
    naming the file when its dtype is none of TOKEN_DTYPES."""
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        meta = json.load(f)
    if meta.get("dtype", "uint16") not in TOKEN_DTYPES:
        raise ValueError(f"{path}: dtype {meta['dtype']!r}; expected one of "
                         f"{', '.join(TOKEN_DTYPES)}")
    return meta


def token_dtype(directory: str | os.PathLike) -> np.dtype:
    """The width of `directory`'s token ids: meta.json's dtype, else uint16."""
    return np.dtype(TOKEN_DTYPES[read_meta(directory).get("dtype", "uint16")])


class TokenFile:
    """``<dir>/train.bin`` and ``<dir>/val.bin``: token ids, uint16 (nanoGPT format) or
    the dtype of ``<dir>/meta.json``. `vocab_size` None: meta.json's vocabulary, else
    50304 (GPT-2's, padded); a given one below meta.json's is refused (ids would fall
    outside the embedding)."""

    def __init__(self, directory: str, vocab_size: int | None = None, dtype=None):
        self.meta = read_meta(directory)
        dtype = np.dtype(dtype) if dtype is not None else token_dtype(directory)
        self.splits = {}
        for split in ("train", "val"):
            p = os.path.join(directory, f"{split}.bin")
            if os.path.exists(p) and os.path.getsize(p):
                self.splits[split] = np.memmap(p, dtype=dtype, mode="r")
        if "train" not in self.splits:
            raise FileNotFoundError(f"TokenFile: {directory}/train.bin not found or empty "
                                    f"(a memmap of {dtype.name} token ids)")
        known = self.meta.get("vocab_size")
        if vocab_size is not None and known is not None and vocab_size < known:
            raise ValueError(f"--vocab-size {vocab_size} is below the vocabulary of "
                             f"{directory}/{META} ({known}); give at least {known} or leave "
                             "it out")
        self.vocab_size = vocab_size or known or 50304
        self.source = directory

    def documents(self, split: str) -> np.ndarray:
        """int64 [n, 3]: (start, end, bucket) of each distinct document of `split`
        (``<split>.docs.npy``, written by ``python -m training.data prepare``)."""
        path = os.path.join(self.source, f"{split}.docs.npy")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: the document index that 'python -m "
                                    "training.data prepare' writes beside the tokens")
        return np.load(path)

    def describe(self) -> str:
        return f"token memmap {self.source} ({len(self.splits['train'])} train tokens)"


def load_dataset(spec: str | None, vocab_size: int | None = None):
    """``None``/``"stdlib"`` -> ByteCorpus (one per process: reading the sources costs
    ~1 s of CPU, which every Trainer of a test or benchmark launch paid again); a
    directory -> TokenFile."""
    if spec in (None, "", "stdlib"):
        return _stdlib_corpus()
    if os.path.isdir(spec):
        return TokenFile(spec, vocab_size)
    raise FileNotFoundError(f"--data {spec!r}: expected 'stdlib' or a directory with "
                            "train.bin/val.bin")


@functools.cache
def _stdlib_corpus() -> ByteCorpus:
    """The default corpus, read once: its arrays are never written to."""
    return ByteCorpus()


class Batches:
    """Deterministic global batches, sharded by data-parallel rank, cut into microbatches."""

    def __init__(self, dataset, block_size: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, split: str = "train",
                 goldfish: Goldfish | None = None):
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
        self.goldfish = goldfish  # None: every target in the loss
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
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        if self.goldfish is not None:
            y[torch.from_numpy(self.goldfish.mask_rows(self.data, offs, t))] = IGNORE_INDEX
        return x, y

    def kept_fraction(self, step: int) -> float:
        """The fraction of the global batch's targets of `step` in the loss (1.0 without
        a Goldfish mask)."""
        if self.goldfish is None:
            return 1.0
        return 1.0 - float(self.goldfish.mask_rows(self.data, self.offsets(step),
                                                   self.block_size).mean())

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the whole global batch (what a serial run trains on)."""
        return self._windows(self.offsets(step))

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's share of step `step`, as `n_micro` (x, y) pairs."""
        offs = self.offsets(step)[self.dp_rank * self.local_batch:
                                  (self.dp_rank + 1) * self.local_batch]
        x, y = self._windows(offs)
        return list(zip(x.split(self.micro_batch), y.split(self.micro_batch), strict=True))


def eval_windows(data: np.ndarray, windows: int | None, block_size: int,
                 option: str = "--windows") -> torch.Tensor:
    """int64 [W, T+1]: window i is tokens ``[i*T, i*T+T+1)`` of a split (`data`), inputs
    its first T, targets its last T; `windows` None: as many as the split holds.
    ValueError naming `option` when the split is too short."""
    t = block_size
    fit = (len(data) - 1) // t
    if windows is None:
        windows = fit
    if windows < 1 or windows > fit:
        raise ValueError(f"{option} {windows}: the split holds {len(data)} tokens, "
                         f"{fit} windows of --block-size {t} (+1 target); give 1..{fit}"
                         if fit else f"{option}: the split holds {len(data)} tokens, no "
                         f"window of --block-size {t} + 1; give more tokens or a smaller "
                         "--block-size")
    return torch.from_numpy(np.asarray(data[:windows * t + 1], dtype=np.int64)).as_strided(
        (windows, t + 1), (t, 1)).clone()
