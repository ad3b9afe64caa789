"""Parity of pipeline x data parallel training with the serial PyTorch run.

Run under ``mpiexec -n N``; trains every grid of N ranks listed in GRIDS, with both
optimizers, 20 steps of fp32 on CPU each, and compares every step's loss with the serial
reference (tests/training/reference.py) to 1e-5 relative; then the same grids with
``--arch llama`` (grouped-query attention, rotary, SwiGLU, RMSNorm), one optimizer per
grid (they alternate; the optimizers' code does not depend on the model). Rank 0 prints
one line per run and a final "parity OK" line.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mcrdl  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from tests.training.reference import serial_losses  # noqa: E402
from training.core.data import ByteCorpus  # noqa: E402
from training.train_gpt import (
    TrainConfig,  # noqa: E402
    run,  # noqa: E402
)

GRIDS = {  # world size -> [(G_inter, G_data, layers_per_stage)]
    1: [(1, 1, None)],
    2: [(2, 1, None), (1, 2, None)],
    3: [(3, 1, None), (3, 1, "1,1,2")],       # uneven: 2,1,1 blocks by default
    4: [(2, 2, None), (4, 1, None), (2, 2, "3,1")],
}
TOL = 1e-5
ARCHS = ("gpt", "llama")


def plan(n: int) -> list[tuple[str, int, int, str | None, bool]]:
    """The runs of world size `n`: (arch, G_inter, G_data, layers_per_stage, offload)."""
    runs = [("gpt", gi, gd, lps, offload) for gi, gd, lps in GRIDS[n]
            for offload in (False, True)]
    return runs + [("llama", gi, gd, lps, i % 2 == 1)
                   for i, (gi, gd, lps) in enumerate(GRIDS[n])]


def main():
    mcrdl.init(["mpi"])
    n, rank = mcrdl.get_size(), mcrdl.get_rank()
    steps = int(os.environ.get("PARITY_STEPS", 20))
    base = dict(model="tiny", steps=steps, micro_batch_size=1, global_batch_size=8,
                seed=7, lr=3e-3, warmup_steps=3, plot=False, progress=False,
                quiet=True,
                out_dir=scratch_dir("mcrdl-parity-"), log_interval=10**6)
    data = ByteCorpus()
    refs = {arch: serial_losses(TrainConfig(**base, arch=arch), data) if rank == 0 else None
            for arch in ARCHS}
    worst_all = 0.0
    runs = 0
    for arch, gi, gd, lps, offload in plan(n):
        ref = refs[arch]
        cfg = TrainConfig(**base, arch=arch, G_inter=gi, G_data=gd, layers_per_stage=lps,
                          offload_optimizer=offload, bucket_mib=0.05, coarsening=2)
        res = run(cfg)
        if rank != 0:
            continue
        got = [loss for _, loss in res.losses]
        assert len(got) == steps, (len(got), steps)
        rel = [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]
        worst = max(rel)
        worst_all = max(worst_all, worst)
        runs += 1
        print(f"parity arch={arch} G_inter={gi} G_data={gd} layers={lps or 'even'} "
              f"offload={offload}: {steps} steps, loss {got[0]:.5f} -> {got[-1]:.5f}, "
              f"max rel diff {worst:.2e}", flush=True)
        if worst > TOL:
            for i, (a, b) in enumerate(zip(got, ref, strict=True)):
                print(f"  step {i + 1}: parallel {a:.8f} serial {b:.8f}")
            raise AssertionError(f"parity FAILED: max rel diff {worst:.2e} > {TOL}")
        # the loss must actually go down: a run that trains nothing is not parity
        assert got[-1] < got[0] - 0.1, (got[0], got[-1])
    if rank == 0:
        print(f"parity OK: world {n}, {runs} runs x {steps} steps, max rel diff {worst_all:.2e}",
              flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
