"""How much of its training documents a model reproduces verbatim.

    python -m training.memorization --init-from hf:DIR --data data/mine --docs 100
    python -m training.checkpoint consolidate runs/ckpt/step_000400 -o m.pt
    mpiexec -n 4 python -m training.memorization --init-from m.pt --data data/mine \\
        --docs 100 --suffix 50

The documents are those of ``--data``'s document index (``<split>.docs.npy``, written
by ``python -m training.data prepare``; each distinct document once, however often the
split repeats it): the first ``--docs`` of each bucket (``meta.json``'s "buckets": the
repetition counts of ``prepare --repeat``), in the index's order. For each document the
model continues its prefix (all but the last ``--suffix`` tokens, cut to the model's
context) greedily for ``--suffix`` tokens:

- exact match: the continuation equals the document's last ``--suffix`` tokens, every
  one (the measure of the Goldfish paper and of AxoNN's memorization study);
- token match: the fraction of the continuation's positions holding the document's
  token (greedy decoding goes on from its own tokens after a miss).

Documents of ``--suffix`` tokens or fewer are skipped (counted). ``--split val`` measures
documents held out of training: the control. Under a launcher every rank runs the whole
serial model on its share of the documents (document i on rank i % world) and the
counts are summed. The last line is one JSON object: ``{"exact_match", "token_match",
"documents", "skipped", "suffix", "buckets": {name: {"exact_match", "token_match",
"documents"}}}``.

``--init-from`` is a Hugging Face directory (``hf:DIR``) or a serial state_dict
(``.pt``) with the ``.json`` of its shape that ``python -m training.checkpoint
consolidate`` writes beside it (consolidate a checkpoint's step directory first).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mcrdl.launch import detect as detect_launch

from .core.data import TokenFile, read_meta
from .core.run_options import HF_PREFIX
from .models import families


def load_model(spec: str) -> torch.nn.Module:
    """The whole serial model of `spec` (hf:DIR, or a .pt with its .json), fp32, eval."""
    if spec.startswith(HF_PREFIX):
        from .models.hf import load_hf

        return load_hf(spec.removeprefix(HF_PREFIX), dtype=torch.float32).eval()
    path, sidecar = Path(spec), Path(spec).with_suffix(".json")
    if not path.is_file():
        raise FileNotFoundError(f"--init-from {spec}: no such file; expected hf:DIR or a .pt "
                                "state_dict ('python -m training.checkpoint consolidate "
                                "STEP_DIR -o m.pt' writes one from a checkpoint)")
    if not sidecar.is_file():
        raise FileNotFoundError(f"--init-from {spec}: no {sidecar} with the model's shape "
                                "(consolidate writes it beside the .pt)")
    config = json.loads(sidecar.read_text())
    if "moe" in config:
        raise ValueError(f"--init-from {spec}: an MoE model; this study runs the dense "
                         "families (gpt, llama)")
    if "arch" not in config and "n_kv_head" in config:
        config["arch"] = "llama"
    cfg = families.config_from_dict(config)
    model = families.family_of(cfg).stage(cfg, 0, cfg.n_units - 1)
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.float().eval()


@torch.no_grad()
def greedy(model: torch.nn.Module, prefix: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n]: the greedy continuation of the prefixes [B, P] (the last block_size
    tokens as context at each step)."""
    context = model.cfg.block_size
    seq = prefix
    for _ in range(n):
        out = model(seq[:, -context:])
        logits = out[0] if isinstance(out, tuple) else out
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prefix.shape[1]:]


def select(index: np.ndarray, buckets: list[str], docs: int | None) -> list[tuple[int, int, int]]:
    """(start, end, bucket) of the first `docs` documents of each bucket."""
    chosen = []
    for b in range(max(1, len(buckets))):
        rows = index[index[:, 2] == b]
        chosen.extend(tuple(int(v) for v in r) for r in rows[:docs])
    return sorted(chosen)


def measure(model: torch.nn.Module, data: np.ndarray, documents, suffix: int,
            n_buckets: int, batch: int = 16) -> np.ndarray:
    """int64 [n_buckets, 4]: per bucket (documents, exact matches, matching tokens,
    skipped) over `documents`."""
    counts = np.zeros((n_buckets, 4), np.int64)
    keep = max(1, model.cfg.block_size - 1)  # prefix tokens of context at the first step
    by_length: dict[int, list] = {}
    for start, end, bucket in documents:
        if end - start <= suffix:
            counts[bucket, 3] += 1
            continue
        p = min(end - start - suffix, keep)
        by_length.setdefault(p, []).append((start, end, bucket))
    for p, group in sorted(by_length.items()):
        for i in range(0, len(group), batch):
            part = group[i:i + batch]
            rows = np.stack([np.asarray(data[e - suffix - p:e], np.int64) for _, e, _ in part])
            rows = torch.from_numpy(rows)
            hits = greedy(model, rows[:, :p], suffix) == rows[:, p:]
            for (_, _, bucket), h in zip(part, hits, strict=True):
                counts[bucket] += (1, int(h.all()), int(h.sum()), 0)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.memorization", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init-from", required=True, help="hf:DIR or a .pt (with its .json)")
    ap.add_argument("--data", required=True, help="a directory 'training.data prepare' wrote")
    ap.add_argument("--split", default="train", choices=("train", "val"),
                    help="train (the memorized documents) or val (the held-out control)")
    ap.add_argument("--docs", type=int, default=None,
                    help="documents per bucket (default: all)")
    ap.add_argument("--suffix", type=int, default=50, help="tokens to reproduce (default 50)")
    ap.add_argument("--batch", type=int, default=16, help="documents per forward")
    args = ap.parse_args(argv)
    launch = detect_launch()
    try:
        if args.suffix < 1 or (args.docs is not None and args.docs < 1):
            raise ValueError("--suffix and --docs: expected 1 or more")
        dataset = TokenFile(args.data)
        meta = read_meta(args.data)
        buckets = meta.get("buckets") or ["all"]
        if args.split not in dataset.splits:
            raise FileNotFoundError(f"--data {args.data} has no {args.split}.bin")
        index = dataset.documents(args.split)
        model = load_model(args.init_from)
        if dataset.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"--data {args.data}'s vocabulary ({dataset.vocab_size}) exceeds "
                             f"the model's ({model.cfg.vocab_size})")
    except (ValueError, FileNotFoundError) as e:
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    documents = select(index, buckets, args.docs)
    mine = documents[launch.rank::launch.size]
    counts = measure(model, dataset.splits[args.split], mine, args.suffix, len(buckets),
                     args.batch)
    if launch.size > 1:
        import mcrdl

        from .core import runtime

        runtime.init_comm([], torch.device("cpu"), None)
        total = torch.from_numpy(counts)
        mcrdl.all_reduce("auto", total, op=mcrdl.ReduceOp.SUM)
        counts = total.numpy()
        mcrdl.finalize()
    if launch.rank != 0:
        return 0
    result = summary(counts, buckets, args.suffix)
    for name, b in result["buckets"].items():
        print(f"bucket {name}: exact match {b['exact_match']:.3f}, token match "
              f"{b['token_match']:.3f} over {b['documents']} documents")
    print(json.dumps(result), flush=True)
    return 0


def summary(counts: np.ndarray, buckets: list[str], suffix: int) -> dict:
    """The result object of per-bucket `counts` (measure's)."""
    def rates(c) -> dict:
        n = int(c[0])
        return {"exact_match": c[1] / n if n else float("nan"),
                "token_match": c[2] / (n * suffix) if n else float("nan"), "documents": n}

    total = counts.sum(0)
    return {**rates(total), "skipped": int(total[3]), "suffix": suffix,
            "buckets": {name: rates(counts[i]) for i, name in enumerate(buckets)}}


if __name__ == "__main__":
    sys.exit(main())
