"""The pipeline engine over each p2p backend: the same losses, equal to the serial run.

Run under ``mpiexec -n 3``: three stages (the inner one waits for either of two
receives, the outer ones for one), 4 microbatches per step, six steps (the receive
buffers' pool is reused across steps), with pipeline_limit 2 (forwards and backwards
interleave, buffers return to the pool while others are in flight) and the default
limit, once over "mpi" (its lane's Works, polled by the engine) and once over "gloo"
(whose waits the engine blocks in). Every step's loss must equal the serial reference
(tests/training/reference.py) to 1e-5 relative, and the two backends' losses must agree
bitwise: a message is an exact copy whichever backend carries it. Rank 0 prints one
line per run and "pipeline p2p OK".
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mcrdl  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from tests.training.reference import serial_losses  # noqa: E402
from training.core.data import ByteCorpus  # noqa: E402
from training.train_gpt import TrainConfig, run  # noqa: E402

TOL = 1e-5
STEPS = 6


def main():
    mcrdl.init(["mpi", "gloo"])
    assert mcrdl.get_size() == 3, "run with mpiexec -n 3"
    rank = mcrdl.get_rank()
    base = dict(model="tiny", steps=STEPS, micro_batch_size=2, global_batch_size=8, seed=3,
                lr=3e-3, warmup_steps=2, plot=False, progress=False, quiet=True,
                out_dir=scratch_dir("mcrdl-pipe-p2p-"), log_interval=10**6)
    ref = serial_losses(TrainConfig(**base), ByteCorpus()) if rank == 0 else None
    for limit in (2, None):
        by_backend = {}
        for backend in ("mpi", "gloo"):
            cfg = TrainConfig(**base, G_inter=3, pipeline_limit=limit, p2p_backend=backend)
            got = [loss for _, loss in run(cfg).losses]
            if rank != 0:
                continue
            assert len(got) == STEPS, (len(got), STEPS)
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
            print(f"pipeline p2p={backend} limit={limit}: loss {got[0]:.6f} -> "
                  f"{got[-1]:.6f}, max rel diff to serial {worst:.2e}", flush=True)
            assert worst <= TOL, f"p2p {backend}, limit {limit}: {got} against serial {ref}"
            assert got[-1] < got[0] - 0.05, got  # it trains
            by_backend[backend] = got
        if rank == 0:
            assert by_backend["mpi"] == by_backend["gloo"], by_backend
    if rank == 0:
        print("pipeline p2p OK", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
