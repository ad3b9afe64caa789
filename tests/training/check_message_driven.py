"""The pipeline is message-driven: with 3 stages and 4 microbatches, the middle stage's
processing order follows message arrival, which an artificially slow stage changes.

- last stage slow: every activation reaches stage 1 before any gradient comes back,
  so stage 1 runs F0 F1 F2 F3 B0 B1 B2 B3;
- first stage slow: each gradient returns before the next activation arrives, so
  stage 1 alternates F0 B0 F1 B1 ...;
- pipeline_limit=2 with the last stage slow: stage 0 never has more than 2
  microbatches in flight, and stage 1 runs F0 F1 B0 F2 B1 F3 B2 B3.

A fixed schedule gives one order whatever the timing (GPipe: all F then all B; 1F1B at
stage 1 of 3: F0 F1 B0 F2 B1 F3 B2 B3 in every case). Run under ``mpiexec -n 3``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from training.train_gpt import (
    TrainConfig,  # noqa: E402
    run,  # noqa: E402
)

DELAY = 0.25
CASES = [  # name, slow stage, pipeline_limit, expected order at stage 1
    ("last stage slow", 2, 4, "F0 F1 F2 F3 B0 B1 B2 B3"),
    ("first stage slow", 0, 4, "F0 B0 F1 B1 F2 B2 F3 B3"),
    ("last stage slow, limit 2", 2, 2, "F0 F1 B0 F2 B1 F3 B2 B3"),
]


def main():
    mcrdl.init(["mpi"])
    assert mcrdl.get_size() == 3, "run with mpiexec -n 3"
    orders = {}
    for name, slow, limit, expected in CASES:
        cfg = TrainConfig(model="tiny", steps=1, G_inter=3, micro_batch_size=2,
                          global_batch_size=8, pipeline_limit=limit, plot=False, progress=False,
                          quiet=True,
                          out_dir=scratch_dir("mcrdl-md-"), log_interval=10**6)
        res = run(cfg, compute_delay={slow: DELAY}, record=True)
        order = " ".join(f"{e.kind}{e.microbatch}" for e in res.events)
        # each rank reports its order to rank 0
        got = [None] * 3
        for s in range(3):
            t = torch.zeros(64, dtype=torch.int64)
            if res.stage == s:
                b = order.encode()
                t[: len(b)] = torch.tensor(list(b))
            mcrdl.bcast("mpi", t, src=s)
            got[s] = bytes(x for x in t.tolist() if x).decode()
        orders[name] = got
        if mcrdl.get_rank() == 0:
            print(f"{name}: stage orders {got}", flush=True)
            assert got[1] == expected, f"{name}: stage 1 ran {got[1]!r}, expected {expected!r}"
            # stage 0 keeps at most pipeline_limit microbatches in flight
            in_flight = peak = 0
            for ev in got[0].split():
                in_flight += 1 if ev[0] == "I" else -1 if ev[0] == "B" else 0
                peak = max(peak, in_flight)
            assert peak == limit, f"{name}: stage 0 peaked at {peak} in flight, limit {limit}"
            assert got[2].split() == [f"F{i}" for i in range(4)], got[2]
    if mcrdl.get_rank() == 0:
        assert orders[CASES[0][0]][1] != orders[CASES[1][0]][1]
        print("message-driven OK: stage 1 order follows arrival in 3 timing cases", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
