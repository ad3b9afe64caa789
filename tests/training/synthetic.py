"""A byte-level token file that depends on nothing but its seed.

Parity checks compare a parallel run with a serial one to 1e-5 over 20 steps. A router's
top-k choice is discrete: where two experts' probabilities tie to the last bit, the
parallel run's different summation order may pick the other expert, and the losses part
for good. Whether a run meets such a tie depends on its data, so the data of a parity
check must not change when a source file does (the MoE check used to train on this
repository's own sources: an edit to a comment could fail it). The text here comes
from numpy's legacy RandomState, whose stream numpy keeps fixed across releases.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LETTERS = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", np.uint8)


def synthetic_text(n_bytes: int, seed: int = 0) -> bytes:
    """``n_bytes`` of pseudo-English: words of a 500-word vocabulary drawn with Zipf
    frequencies, letters drawn by English frequency, sentences ended by '. ' or '.\\n'.
    Learnable (a tiny GPT's loss falls well below ln 256 in a few steps), fixed by
    ``seed``."""
    rs = np.random.RandomState(seed)
    letter_p = 1.0 / np.arange(1, len(LETTERS) + 1) ** 0.9
    vocab = [bytes(rs.choice(LETTERS, size=rs.randint(1, 9), p=letter_p / letter_p.sum()))
             for _ in range(500)]
    word_p = 1.0 / np.arange(1, len(vocab) + 1)
    word_p /= word_p.sum()
    out, size = [], 0
    while size < n_bytes:
        words = [vocab[i] for i in rs.choice(len(vocab), size=rs.randint(4, 16), p=word_p)]
        words[0] = words[0].capitalize()
        sentence = b" ".join(words) + (b".\n" if rs.rand() < 0.2 else b". ")
        out.append(sentence)
        size += len(sentence)
    return b"".join(out)[:n_bytes]


def write_token_file(directory: str | Path, n_bytes: int = 1 << 19, seed: int = 0) -> Path:
    """``directory``/train.bin (uint16 tokens, vocabulary 256), as training.core.data's
    TokenFile reads it; returns ``directory``."""
    d = Path(directory)
    text = synthetic_text(n_bytes, seed)
    np.frombuffer(text, np.uint8).astype(np.uint16).tofile(d / "train.bin")
    return d
