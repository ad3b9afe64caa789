"""Token files for training: text in, ``train.bin``/``val.bin`` out.

    python -m training.data prepare --tokenizer DIR --input docs/*.txt -o data/mine
    python -m training.data prepare --tokenizer bytes --input a.txt b.txt -o data/bytes \\
        --val-fraction 0.1 --repeat 1,4,16

``--tokenizer`` is a directory holding a Hugging Face ``tokenizer.json`` (read with the
``tokenizers`` library; nothing is downloaded) or ``bytes`` (the ids are the UTF-8
bytes, vocabulary 256). Each input file is one document, or, with ``--separator TEXT``,
the parts between its occurrences are. ``--val-fraction`` of the documents (at least
one, chosen by ``--seed``) go to ``val.bin``, the rest to ``train.bin``; a lone document
is cut instead (its tail goes to val). With ``--eos-token``, its id follows every
document.

The output directory holds:

- ``train.bin``, ``val.bin``: the token ids, uint16, or uint32 when an id may exceed
  65,535 (Llama-3's 128K vocabulary); what ``--data DIR`` of the trainers,
  ``training.evaluate`` and ``training.memorization`` read.
- ``meta.json``: ``dtype``, ``vocab_size``, the tokenizer, the token and document counts
  per split, the ``buckets``.
- ``train.docs.npy``, ``val.docs.npy``: int64 ``[n, 3]``, each distinct document's
  (start, end, bucket): the token range of its first copy in the split, and its index
  in ``buckets``. The memorization study reads them.
- ``tokenizer.json`` copied from ``--tokenizer DIR`` (to decode the ids later).

``--repeat N`` writes each training document N times; ``--repeat 1,4,16`` assigns the
training documents to those counts in turn, one bucket per count ("x1", "x4", "x16"),
as the paper's memorization study inserts articles at several repetition counts. The
copies are shuffled (``--seed``) over the split, so an epoch meets them spread out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .core.data import META, TOKEN_DTYPES

BYTES = "bytes"
TOKENIZER_JSON = "tokenizer.json"


class Tokenizer:
    """``bytes``, or the ``tokenizer.json`` of a directory."""

    def __init__(self, spec: str):
        self.spec = spec
        if spec == BYTES:
            self.vocab_size, self._tok = 256, None
            return
        path = Path(spec) / TOKENIZER_JSON
        if not path.is_file():
            raise FileNotFoundError(f"--tokenizer {spec}: {path} not found; give a directory "
                                    f"holding a Hugging Face {TOKENIZER_JSON} or '{BYTES}'")
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.path = path

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._tok is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def token_id(self, token: str) -> int:
        """The id of special token `token` (ValueError naming it when unknown)."""
        if self._tok is None:
            b = token.encode("utf-8")
            if len(b) != 1:
                raise ValueError(f"--eos-token {token!r}: with --tokenizer bytes, give one "
                                 "byte (e.g. a newline)")
            return b[0]
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"--eos-token {token!r} is not in {self.path}'s vocabulary")
        return i


def width(vocab_size: int) -> str:
    """The narrowest dtype of TOKEN_DTYPES that holds ids below `vocab_size`."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_documents(inputs: Sequence[str], separator: str | None) -> list[str]:
    docs = []
    for name in inputs:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FileNotFoundError(f"--input {name}: cannot read it as UTF-8 text ({e})") \
                from None
        parts = text.split(separator) if separator else [text]
        docs.extend(p for p in parts if p.strip())
    if not docs:
        raise ValueError(f"--input: no document in {len(inputs)} file(s)"
                         + (f" split on --separator {separator!r}" if separator else ""))
    return docs


def prepare(tokenizer: str, inputs: Sequence[str], out: str | os.PathLike, *,
            val_fraction: float = 0.1, separator: str | None = None,
            eos_token: str | None = None, repeat: Sequence[int] = (1,),
            seed: int = 0) -> dict:
    """Write the token directory `out` (the module's description); returns its meta."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction}: expected 0 <= F < 1")
    if not repeat or min(repeat) < 1:
        raise ValueError(f"--repeat {','.join(map(str, repeat))}: expected counts >= 1")
    tok = Tokenizer(tokenizer)
    eos = [tok.token_id(eos_token)] if eos_token is not None else []
    docs = [ids + eos for ids in tok.encode(read_documents(inputs, separator))]
    rng = np.random.default_rng(seed)
    if len(docs) == 1 and val_fraction > 0:  # one document: its tail is the val split
        cut = len(docs[0]) - max(1, int(len(docs[0]) * val_fraction))
        train_docs, val_docs = [docs[0][:cut]], [docs[0][cut:]]
    else:
        n_val = max(1, round(len(docs) * val_fraction)) if val_fraction > 0 else 0
        held = set(rng.permutation(len(docs))[:n_val].tolist())
        train_docs = [d for i, d in enumerate(docs) if i not in held]
        val_docs = [d for i, d in enumerate(docs) if i in held]
    if not train_docs:
        raise ValueError(f"--val-fraction {val_fraction} leaves no document to train on")
    dtype = width(tok.vocab_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buckets = [f"x{n}" for n in repeat]
    # training copies: document i goes to bucket i % len(repeat), repeated that often
    copies = [(i, i % len(repeat)) for i in range(len(train_docs))
              for _ in range(repeat[i % len(repeat)])]
    order = rng.permutation(len(copies)) if len(repeat) > 1 or repeat[0] > 1 else \
        np.arange(len(copies))
    counts = {}
    for split, split_docs, seq in (("train", train_docs, [copies[j] for j in order]),
                                   ("val", val_docs, [(i, 0) for i in range(len(val_docs))])):
        index = np.zeros((len(split_docs), 3), np.int64)
        seen, pos, parts = set(), 0, []
        for i, bucket in seq:
            if i not in seen:
                seen.add(i)
                index[i] = (pos, pos + len(split_docs[i]), bucket)
            parts.append(split_docs[i])
            pos += len(split_docs[i])
        ids = np.fromiter((t for d in parts for t in d), np.int64, count=pos)
        ids.astype(TOKEN_DTYPES[dtype]).tofile(out / f"{split}.bin")
        np.save(out / f"{split}.docs.npy", index)
        counts[split] = {"tokens": int(pos), "documents": len(split_docs)}
    meta = {"dtype": dtype, "vocab_size": tok.vocab_size,
            "tokenizer": BYTES if tokenizer == BYTES else TOKENIZER_JSON,
            "eos_token": eos_token, "buckets": buckets, "repeat": list(repeat),
            "splits": counts, "seed": seed}
    if tokenizer != BYTES:
        shutil.copyfile(tok.path, out / TOKENIZER_JSON)
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _repeat(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected counts like 1 or 1,4,16") \
            from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into train.bin/val.bin")
    p.add_argument("--tokenizer", required=True,
                   help=f"a directory with {TOKENIZER_JSON}, or '{BYTES}'")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="UTF-8 text files (each one document, or split on --separator)")
    p.add_argument("-o", "--out", required=True, help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="documents held out to val.bin (default 0.1)")
    p.add_argument("--separator", help="text between documents inside a file")
    p.add_argument("--eos-token", help="a token appended to every document")
    p.add_argument("--repeat", type=_repeat, default=[1],
                   help="copies of each training document: N, or N1,N2,... (one bucket each)")
    p.add_argument("--seed", type=int, default=0, help="val documents and copy order")
    args = ap.parse_args(argv)
    try:
        meta = prepare(args.tokenizer, args.input, args.out, val_fraction=args.val_fraction,
                       separator=args.separator, eos_token=args.eos_token,
                       repeat=args.repeat, seed=args.seed)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = meta["splits"]
    print(f"{args.out}: {s['train']['tokens']:,} train tokens ({s['train']['documents']} "
          f"documents), {s['val']['tokens']:,} val tokens ({s['val']['documents']} "
          f"documents), {meta['dtype']}, vocabulary {meta['vocab_size']:,}")
    print(json.dumps({"train_tokens": s["train"]["tokens"], "val_tokens": s["val"]["tokens"],
                      "dtype": meta["dtype"], "vocab_size": meta["vocab_size"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
