"""Parity of the 4D engine (training/parallel4d) with the serial PyTorch run.

Run under ``mpiexec -n N``: trains every grid (G_x, G_y, G_z, G_data) of N ranks in
GRIDS (or those named by $GRIDS_4D, e.g. "2,1,1,1;1,2,1,1"), 20 steps of fp32 on CPU
each, and compares every step's loss with the serial reference
(tests/training/reference.py) to 1e-5 relative. Tiny GPT (2 blocks, sequence 16) on a
96-token vocabulary (bytes of Python's sources mod 96, so that G_x = 3 divides it).
Rank 0 prints one line per run and a final "4d parity OK" line.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import mcrdl  # noqa: E402
from tests.training.reference import serial_losses  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.data import ByteCorpus, TokenFile  # noqa: E402
from training.train_gpt import run  # noqa: E402

VOCAB = 96
#: world size -> [(grid, model shape, options)]; shapes: "h4" n_embd 32 / 4 heads,
#: "h3" n_embd 48 / 3 heads. Options vary the optimizer and the micro-batching.
H4 = dict(n_embd=32, n_head=4)
H3 = dict(n_embd=48, n_head=3)
GRIDS = {
    2: [((2, 1, 1, 1), H4, {}), ((1, 2, 1, 1), H4, {}), ((1, 1, 2, 1), H4, {}),
        ((1, 1, 1, 2), H4, {"offload_optimizer": True})],
    3: [((3, 1, 1, 1), H3, {}), ((1, 1, 3, 1), H3, {"offload_optimizer": True})],
    4: [((2, 2, 1, 1), H4, {}), ((2, 1, 2, 1), H4, {"offload_optimizer": True}),
        ((1, 2, 2, 1), H4, {}), ((1, 1, 2, 2), H4, {"micro_batch_size": 1}),
        ((4, 1, 1, 1), H4, {}), ((1, 1, 4, 1), H4, {})],
    8: [((2, 2, 2, 1), H4, {}), ((2, 2, 1, 2), H4, {"offload_optimizer": True})],
}
TOL = 1e-5


def token_data(directory: str) -> TokenFile:
    """A nanoGPT-style token file: bytes of Python's sources mod VOCAB."""
    os.makedirs(directory, exist_ok=True)
    data = ByteCorpus(max_bytes=1 << 19).splits["train"]
    (data % VOCAB).astype(np.uint16).tofile(os.path.join(directory, "train.bin"))
    return TokenFile(directory, VOCAB)


def base_config(directory: str, shape: dict, steps: int, batch: int) -> dict:
    return dict(model="tiny", n_layer=2, block_size=16, **shape, data=directory,
                vocab_size=VOCAB, steps=steps, global_batch_size=batch, seed=7, lr=3e-3,
                warmup_steps=3, plot=False, progress=False, quiet=True,
                out_dir=os.path.join(directory, "out"), log_interval=10**6)


def parse_grids(text: str, n: int):
    out = []
    for item in text.split(";"):
        g = tuple(int(v) for v in item.split(","))
        out.append((g, H3 if g in ((3, 1, 1, 1), (1, 1, 3, 1)) else H4, {}))
    return [e for e in out if np.prod(e[0]) == n]


def main():
    mcrdl.init(["mpi"])
    n, rank = mcrdl.get_size(), mcrdl.get_rank()
    steps = int(os.environ.get("PARITY_STEPS", 20))
    directory = os.path.join(tempfile.gettempdir(), f"mcrdl-4d-{os.getppid()}-{rank}")
    dataset = token_data(directory)
    cases = parse_grids(os.environ["GRIDS_4D"], n) if os.environ.get("GRIDS_4D") else GRIDS[n]
    refs = {}
    worst_all, runs = 0.0, 0
    for grid, shape, options in cases:
        batch = 6 if 3 in grid else 8
        base = base_config(directory, shape, steps, batch)
        key = (tuple(shape.items()), batch)
        if rank == 0 and key not in refs:
            refs[key] = serial_losses(TrainConfig(**base), dataset)
        gx, gy, gz, gd = grid
        mbs = options.get("micro_batch_size", batch // (gz * gd))
        cfg = TrainConfig(**base, G_x=gx, G_y=gy, G_z=gz, G_data=gd, engine="4d",
                          micro_batch_size=mbs,
                          **{k: v for k, v in options.items() if k != "micro_batch_size"})
        res = run(cfg)
        if rank != 0:
            continue
        ref = refs[key]
        got = [loss for _, loss in res.losses]
        assert len(got) == steps, (len(got), steps)
        rel = [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]
        worst = max(rel)
        worst_all = max(worst_all, worst)
        runs += 1
        print(f"4d parity {grid} {shape} {options or ''}: {steps} steps, loss {got[0]:.5f} -> "
              f"{got[-1]:.5f}, max rel diff {worst:.2e}", flush=True)
        if worst > TOL:
            for i, (a, b) in enumerate(zip(got, ref, strict=True)):
                print(f"  step {i + 1}: parallel {a:.8f} serial {b:.8f}")
            raise SystemExit(f"4d parity FAILED on {grid}: max rel diff {worst:.2e} > {TOL}")
        assert got[-1] < got[0] - 0.1, (got[0], got[-1])  # it trains
    if rank == 0:
        print(f"4d parity OK: world {n}, {runs} runs x {steps} steps, max rel diff "
              f"{worst_all:.2e}", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
