"""The memorization demo: a tiny Llama trained for many epochs on a few documents
reproduces their endings verbatim; the same run with the Goldfish loss does not.

    python benchmarks/memorization.py                   # the README's figures

Documents are random lowercase strings (``--doc-chars`` bytes each, seeded): nothing in
them can be guessed, so a continuation that reproduces a document's last ``--suffix``
bytes was memorized. ``training.data prepare --tokenizer bytes`` writes them (a
quarter held out to val.bin: the control, documents the model never trained on);
``training.train_gpt --arch llama`` trains on the rest serially for ``--steps`` steps,
once without and once with ``--goldfish-k 2 --goldfish-h 13`` (side by side); ``training.checkpoint
consolidate`` and ``training.memorization`` measure exact match and token match on the
trained documents and on the control. Prints one JSON line per run, then a summary
JSON line: the exact-match rates, and whether the demo's claims hold (exact match >= 0.5
without Goldfish; with it, within 0.05 of the control).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def start(args: list[str]) -> subprocess.Popen:
    """`python -m ...` in the repository, started."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    proc.args_text = " ".join(args)
    return proc


def finish(proc: subprocess.Popen) -> str:
    """The stdout of a started command (raises with its stderr on failure)."""
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"python -m {proc.args_text} exited {proc.returncode}:\n"
                           f"{err[-3000:]}")
    return out


def run(args: list[str]) -> str:
    """`python -m ...` in the repository; its stdout."""
    return finish(start(args))


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def write_documents(directory: Path, n: int, chars: int, seed: int) -> list[str]:
    rs = np.random.RandomState(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        text = bytes(rs.randint(ord("a"), ord("z") + 1, size=chars).astype(np.uint8)).decode()
        p = directory / f"doc{i:04d}.txt"
        p.write_text(text)
        paths.append(str(p))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=16, help="documents, a quarter held out")
    ap.add_argument("--doc-chars", type=int, default=120, help="bytes per document")
    ap.add_argument("--suffix", type=int, default=50, help="tokens to reproduce")
    ap.add_argument("--steps", type=int, default=1500, help="training steps per run")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--model", nargs="*", default=["--arch", "llama", "--model", "tiny",
                                                   "--n-layer", "2", "--n-embd", "128",
                                                   "--block-size", "64"],
                    help="train_gpt's model options")
    ap.add_argument("--goldfish", nargs="*", default=["--goldfish-k", "2", "--goldfish-h",
                                                      "13"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/memorization", help="working directory")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    docs = write_documents(out / "text", args.docs, args.doc_chars, args.seed)
    data = out / "data"
    run(["training.data", "prepare", "--tokenizer", "bytes", "--input", *docs, "-o", str(data),
         "--val-fraction", "0.25", "--seed", str(args.seed)])
    runs = {"plain": [], "goldfish": args.goldfish}
    t0 = time.perf_counter()
    training = {name: start(["training.train_gpt", *args.model, "--data", str(data),
                             "--steps", str(args.steps), "--lr", str(args.lr), "--min-lr",
                             str(args.lr / 10), "--warmup-steps", "20", "--weight-decay",
                             "0", "--global-batch-size", str(args.batch),
                             "--micro-batch-size", str(args.batch), "--seed", str(args.seed),
                             "--checkpoint-dir", str(out / f"ckpt_{name}"), "--out-dir",
                             str(out / f"run_{name}"), "--quiet", "--no-plot", *extra])
                for name, extra in runs.items()}  # the two runs train side by side
    for proc in training.values():
        finish(proc)
    train_s = round(time.perf_counter() - t0, 1)
    results = {}
    for name in runs:
        pt = out / f"{name}.pt"
        run(["training.checkpoint", "consolidate", str(out / f"ckpt_{name}"), "-o", str(pt)])
        row = {"run": name, "train_s": train_s,
               "final_loss": json.loads((out / f"run_{name}" / "metrics.jsonl").read_text()
                                        .splitlines()[-1])["loss"]}
        for split in ("train", "val"):
            m = last_json(run(["training.memorization", "--init-from", str(pt), "--data",
                               str(data), "--split", split, "--suffix", str(args.suffix)]))
            row[split] = {k: m[k] for k in ("exact_match", "token_match", "documents")}
        results[name] = row
        print(json.dumps(row), flush=True)
    plain, gold = results["plain"], results["goldfish"]
    summary = {"plain_exact": plain["train"]["exact_match"],
               "goldfish_exact": gold["train"]["exact_match"],
               "control_exact": gold["val"]["exact_match"],
               "memorizes": plain["train"]["exact_match"] >= 0.5,
               "goldfish_near_control": abs(gold["train"]["exact_match"]
                                            - gold["val"]["exact_match"]) <= 0.05}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
