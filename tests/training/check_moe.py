"""Parity of TED MoE training (training/train_moe.py) with the serial MoE GPT.

Run under ``mpiexec -n N`` (N in 2, 4, 8): trains each layout of N ranks in RUNS (20
steps of fp32, moe-tiny) and compares every step's LM loss and aux loss with the serial
reference (tests/training/reference.py) to 1e-5 relative; runs that differ only in DTD
or CAC must give bitwise identical losses (on mpi). Rank 0 prints one line per run and
"moe parity OK: world N, R runs".
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mcrdl  # noqa: E402
from tests.training.reference import serial_moe_losses  # noqa: E402
from training.data import ByteCorpus  # noqa: E402
from training.train_moe import MoETrainConfig, run  # noqa: E402

TOL = 1e-5
# world -> runs: (G_tensor, G_expert, G_data_nonexp, top_k, options); experts = 4 where
# G_expert = 4, else 2. Runs with the same "twin" key must agree bitwise.
RUNS = {
    2: [(1, 1, 2, 1, {}), (1, 1, 2, 2, {}),
        (2, 1, 1, 1, {}), (2, 1, 1, 1, {"dtd": True}),
        (2, 1, 1, 2, {"dtd": True, "activation_checkpointing": True, "cac": True,
                      "optimizer_tile": 300})],
    4: [(1, 2, 2, 1, {}), (1, 2, 2, 2, {"optimizer_tile": 1000}),
        (1, 4, 4, 1, {}), (1, 4, 4, 2, {"activation_checkpointing": True, "cac": True}),
        (2, 2, 2, 2, {}), (2, 2, 2, 2, {"dtd": True}),
        (2, 2, 2, 1, {"dtd": True, "activation_checkpointing": True}),
        (2, 2, 2, 1, {"dtd": True, "activation_checkpointing": True, "cac": True})],
    8: [(2, 4, 4, 1, {"dtd": True}), (2, 4, 4, 2, {}),
        (2, 4, 4, 2, {"dtd": True, "activation_checkpointing": True, "cac": True,
                      "optimizer_tile": 500})],
}


def main():
    mcrdl.init(["mpi"])
    n, rank = mcrdl.get_size(), mcrdl.get_rank()
    steps = int(os.environ.get("PARITY_STEPS", 20))
    data = ByteCorpus()
    refs, twins, runs, worst_all = {}, {}, 0, 0.0
    for gt, ge, gd, k, opts in RUNS[n]:
        experts = 4 if ge == 4 else 2
        cfg = MoETrainConfig(model="moe-tiny", steps=steps, experts=experts, top_k=k,
                             capacity_factor=1.1, router_group_tokens=32, moe_every=2,
                             micro_batch_size=2, global_batch_size=8, seed=7, lr=3e-3,
                             warmup_steps=3, plot=False, progress=False, quiet=True,
                             comm_log=False, out_dir=f"/tmp/mcrdl-moe-parity-{os.getpid()}",
                             G_tensor=gt, G_expert=ge, G_data=gd, debug_checks=True, **opts)
        res = run(cfg)
        if rank != 0:
            continue
        key = (experts, k)
        if key not in refs:
            refs[key] = serial_moe_losses(cfg, data)
        got = list(zip([loss for _, loss in res.losses], res.aux, strict=True))
        rel = [max(abs(a - b) / abs(b), abs(c - d) / abs(d))
               for (a, c), (b, d) in zip(got, refs[key], strict=True)]
        worst = max(rel)
        worst_all = max(worst_all, worst)
        runs += 1
        label = f"G_tensor={gt} G_expert={ge} G_data={gd} top-{k} {opts or ''}"
        print(f"moe parity {label}: {steps} steps, loss {got[0][0]:.5f} -> {got[-1][0]:.5f}, "
              f"aux {got[-1][1]:.4f}, dropped {res.dropped[-1]:.3f}, max rel diff {worst:.2e}",
              flush=True)
        if worst > TOL:
            for i, ((a, c), (b, d)) in enumerate(zip(got, refs[key], strict=True)):
                print(f"  step {i + 1}: lm {a:.8f} vs {b:.8f}, aux {c:.8f} vs {d:.8f}")
            raise SystemExit(f"moe parity FAILED: max rel diff {worst:.2e} > {TOL}")
        assert got[-1][0] < got[0][0] - 0.1, (got[0], got[-1])  # it trains
        # DTD and CAC move the same bytes to the same places: bitwise equal losses
        twin = (gt, ge, gd, k, opts.get("optimizer_tile"))
        if twin in twins:
            assert twins[twin] == got, f"{label}: losses differ bitwise from its twin"
            print(f"  bitwise identical to the run without {set(opts) - {'optimizer_tile'}}")
        else:
            twins[twin] = got
    if rank == 0:
        print(f"moe parity OK: world {n}, {runs} runs x {steps} steps, max rel diff "
              f"{worst_all:.2e}", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
