"""The pipeline is message-driven: with 3 stages and 4 microbatches, the middle stage's
processing order follows message arrival, which holding one stage back changes. The
held stage waits for a flag that stage 1 sets when it has sent a given message (an
explicit order, not a delay that a busy machine can outlast):

- last stage held until stage 1 has sent every activation it may (pipeline_limit 4: F3):
  every activation reaches stage 1 before any gradient comes back, so stage 1 runs
  F0 F1 F2 F3 B0 B1 B2 B3;
- first stage held, before each microbatch after the first, until stage 1 has sent the
  previous one's gradient: each gradient returns before the next activation arrives, so
  stage 1 alternates F0 B0 F1 B1 ...;
- pipeline_limit=2, last stage's F_k held until stage 1 has sent F_(k+1): stage 0 never
  has more than 2 microbatches in flight, and stage 1 runs F0 F1 B0 F2 B1 F3 B2 B3.

A fixed schedule gives one order whatever the arrivals (GPipe: all F then all B; 1F1B at
stage 1 of 3: F0 F1 B0 F2 B1 F3 B2 B3 in every case), and where it waits for a message
that the held stage is not allowed to send, the flag's wait ends after FLAG_WAIT_S and
the order check fails. Run under ``mpiexec -n 3``.
"""

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from training.pipeline.engine import FWD, PipelineEngine  # noqa: E402
from training.train_gpt import (
    TrainConfig,  # noqa: E402
    run,  # noqa: E402
)

N_MICRO = 4
FLAG_WAIT_S = 60.0  # a hang guard: the flags come within a few steps' compute
CASES = [  # name, held stage, pipeline_limit, expected order at stage 1
    ("last stage held", 2, 4, "F0 F1 F2 F3 B0 B1 B2 B3"),
    ("first stage held", 0, 4, "F0 B0 F1 B1 F2 B2 F3 B3"),
    ("last stage held, limit 2", 2, 2, "F0 F1 B0 F2 B1 F3 B2 B3"),
]


class Flags:
    """Flags shared by the ranks of one node: files in one directory."""

    def __init__(self, directory: str):
        self.directory = directory

    def set(self, name: str) -> None:
        open(os.path.join(self.directory, name), "w").close()

    def wait(self, name: str) -> None:
        deadline = time.monotonic() + FLAG_WAIT_S
        while not os.path.exists(os.path.join(self.directory, name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"flag {name!r} not set within {FLAG_WAIT_S:.0f} s: "
                                   "stage 1 never sent that message")
            time.sleep(1e-3)


def held_until(held: int, limit: int, mb: int) -> str | None:
    """The message stage 1 must have sent before the held stage computes microbatch mb's
    forward (None: no wait)."""
    if held == 0:
        return f"B{mb - 1}" if mb > 0 else None
    return f"F{min(mb + limit - 1, N_MICRO - 1)}"


@contextlib.contextmanager
def ordered(flags: Flags, held: int, limit: int):
    """Stage 1 sets a flag per message it sends; stage `held` waits, before each forward,
    for the flag held_until names."""
    forward, send = PipelineEngine._forward, PipelineEngine._send

    def gated_forward(self, mb, x, target):
        name = held_until(held, limit, mb) if self.stage_index == held else None
        if name is not None:
            flags.wait(name)
        return forward(self, mb, x, target)

    def flagged_send(self, t, mb, direction):
        send(self, t, mb, direction)
        if self.stage_index == 1:
            flags.set(f"{'F' if direction == FWD else 'B'}{mb}")

    PipelineEngine._forward, PipelineEngine._send = gated_forward, flagged_send
    try:
        yield
    finally:
        PipelineEngine._forward, PipelineEngine._send = forward, send


def main():
    mcrdl.init(["mpi"])
    assert mcrdl.get_size() == 3, "run with mpiexec -n 3"
    orders = {}
    root = mcrdl.broadcast_object(scratch_dir("mcrdl-md-flags-") if mcrdl.get_rank() == 0
                                  else None)
    for i, (name, held, limit, expected) in enumerate(CASES):
        flags = Flags(os.path.join(root, str(i)))
        if mcrdl.get_rank() == 0:
            os.mkdir(flags.directory)
        mcrdl.barrier("mpi")
        cfg = TrainConfig(model="tiny", steps=1, G_inter=3, micro_batch_size=2,
                          global_batch_size=2 * N_MICRO, pipeline_limit=limit, plot=False,
                          progress=False, quiet=True,
                          out_dir=scratch_dir("mcrdl-md-"), log_interval=10**6)
        with ordered(flags, held, limit):
            res = run(cfg, record=True)
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
        print("message-driven OK: stage 1 order follows arrival in 3 cases", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
