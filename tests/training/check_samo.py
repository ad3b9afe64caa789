"""SAMO (training/samo/) under ``mpiexec -n 4``: every grid of the issue in one launch.

Every process pays ~2 s of CPU to import torch, so the grids run side by side on
disjoint ranks of one world of 4 (``ProcessGrid(..., world=group)``): (1,1) on rank 0
beside (3,1) on ranks 1-3, then (2,1) on ranks 0-1 beside (1,2) on ranks 2-3, then (2,2)
on all four. On each grid a pruned tiny GPT (sparsity 0.9; the (1,2) grid prunes per
tensor in two rounds, before steps 0 and 3) trains STEPS steps:

1. fp32 SAMO: every step's loss equals the serial dense masked run
   (tests/training/reference.py: one process, torch.optim.AdamW, the same rounds of
   magnitude pruning) within 1e-5 relative, and each stage's mask equals the serial
   run's (the mask does not depend on the grid).
2. bf16 SAMO and bf16 dense masked training (OffloadedAdamW with the same mask): the
   same loss bits at every step and the same theta16 bits at the end, on every rank.
3. After every step of both SAMO runs, theta16 is exactly zero at the pruned positions
   and equals theta32 (rounded to the training dtype) at the index.
4. The communication log (mcrdl's comm logger, each rank's trace, by group): the
   data-parallel all-reduce bytes of the bf16 runs are, on every rank, 2 B per unpruned
   entry of its stage per step for SAMO and 2 B per entry for dense masked training,
   so SAMO sends kept/phi = (1 - p) of the dense bytes (p phi floored); no pruned
   gradient is ever sent.

Then, on the whole world at (2,2):

5. An iterative schedule (rounds before steps 0, 3, 5) stopped after step 4 with a
   checkpoint and resumed gives the uninterrupted run's losses exactly; the
   consolidated checkpoint is dense with zeros at the pruned positions and gives the
   resumed run's next loss in the serial model.
6. A checkpoint of a different mask (another sparsity), and a pruned checkpoint resumed
   without pruning, are CheckpointErrors on every rank naming the difference.
7. A pruning round on data-parallel replicas that chose different masks raises
   DesyncError on every rank (``replica_agreement_check``).
8. The entry point with --samo (last: it finalizes mcrdl), writing a checkpoint to
   ``$SAMO_CLI_DIR`` that the test consolidates.
9. (before 8) fp32 SAMO of a tiny Llama (``--arch llama``) at (2,2) equals its serial
   dense masked run within 1e-5 relative at every step.
"""

import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from tests.training.reference import serial_index, serial_run  # noqa: E402
from training import checkpoint as checkpoint_tool  # noqa: E402
from training.core import checkpoint as ckpt  # noqa: E402
from training.core.data import Batches, load_dataset  # noqa: E402
from training.core.topology import ProcessGrid  # noqa: E402
from training.models.families import config_from_dict  # noqa: E402
from training.models.gpt import GPT, lm_loss  # noqa: E402
from training.pipeline.trainer import Trainer  # noqa: E402
from training.samo.pruning import kept_count, parse_schedule, pruned_mask  # noqa: E402
from training.train_gpt import (
    TrainConfig,  # noqa: E402
    run,  # noqa: E402
)
from training.train_gpt import main as train_main  # noqa: E402

LAYER_2_ROUNDS = {"prune_scope": "layer", "prune_schedule": "0,3"}
PHASES = [  # runs side by side: (world ranks, G_inter, G_data, options beyond the base)
    [((0,), 1, 1, {}), ((1, 2, 3), 3, 1, {})],
    [((0, 1), 2, 1, {}), ((2, 3), 1, 2, LAYER_2_ROUNDS)],
    [((0, 1, 2, 3), 2, 2, {})],
]
STEPS = 6
TOL = 1e-5
# The token file tests/test_samo.py writes (tests/training/synthetic.py, seed 6): the
# second round of LAYER_2_ROUNDS (step 3) then cuts each tensor >= 9.6e-5 (relative)
# between the last kept and the first pruned magnitude, where a parallel run's rounding
# differs by ~1e-7. Python's own sources (the default) gave 3.3e-6, and change with the
# Python release. The rounds before step 0 cut the initial weights: no data in them.
DATA = os.environ.get("SAMO_DATA", "stdlib")
VOCAB_SIZE = None if DATA == "stdlib" else 256  # a token file's: bytes


def dataset():
    return load_dataset(DATA, VOCAB_SIZE)


def say(*args):
    if mcrdl.get_rank() == 0:
        print(*args, flush=True)


def check_pruned(trainer: Trainer) -> None:
    """theta16 is zero at the pruned positions and theta32 (rounded) at the index."""
    opt = trainer.optimizer
    for name, p, (a, b), index in zip(opt.names, opt.params, opt.slots, opt.index,
                                      strict=True):
        dense = p.detach().view(-1)
        assert not dense.masked_select(pruned_mask(p.numel(), index)).any(), name
        assert torch.equal(dense[index.long()], opt.theta32[a:b].to(p.dtype)), name


def data_parallel_bytes(trainer: Trainer, trace: Path) -> int:
    """Bytes of the all-reduces this rank issued on its data-parallel group since the
    log was reset, from its comm-logger trace (events name their group)."""
    if trainer.data_group is None:
        return 0
    mcrdl.export_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    return sum(e["args"]["bytes"] for e in events
               if e.get("ph") == "X" and e["name"] == "all_reduce"
               and e["args"]["group"] == trainer.data_group.id)


def train_grid(opts: dict, grid: ProcessGrid, root: Path) -> dict:
    """Checks 1-4 on this rank's grid; returns this rank's record for world rank 0."""
    rank = mcrdl.get_rank()
    cfg32 = TrainConfig(**opts, samo=True)
    trainer = Trainer(cfg32, grid=grid)
    fp32 = []
    for _ in range(STEPS):
        fp32.append(trainer.train_step()[0])
        check_pruned(trainer)
    if cfg32.prune_schedule is None:  # the mask of a grid is the serial run's
        want = serial_index(cfg32)
        opt = trainer.optimizer
        assert all(torch.equal(i, want[n]) for n, i in zip(opt.names, opt.index,
                                                           strict=True)), opts
    runs = {}
    for samo in (True, False):
        trainer = Trainer(TrainConfig(**opts, samo=samo, dtype="bf16"), grid=grid)
        mcrdl.reset_log()
        losses, kept = [], 0
        for _ in range(STEPS):
            losses.append(trainer.train_step()[0])
            kept += trainer.pruning.kept()  # the entries of this step (rounds come first)
            if samo:
                check_pruned(trainer)
        # minus the mask agreement of each round run while logged (before steps > 0):
        # one all-reduce of two int64 over the data-parallel group (training/samo/pruning.py)
        agreement = 16 * sum(r.step > 0 for r in trainer.pruning.done)
        sent = data_parallel_bytes(trainer, root / f"trace-{rank}-{samo}.json")
        sent -= agreement if trainer.data_group is not None else 0
        theta16 = [p.detach().clone() for p in trainer.model_stage.parameters()]
        runs[samo] = (losses, theta16, sent, kept, trainer)
    (s_loss, s_theta, s_sent, kept, s_tr), (d_loss, d_theta, d_sent, _, d_tr) = \
        runs[True], runs[False]
    phi = sum(p.numel() for p in d_tr.model_stage.parameters())
    return {"rank": rank, "grid": (opts["G_inter"], opts["G_data"]),
            "extra": {k: opts[k] for k in LAYER_2_ROUNDS if opts[k] != BASE.get(k)},
            "stage": s_tr.stage_index, "data_rank": s_tr.data_rank, "fp32": fp32,
            "bf16_same_losses": s_loss == d_loss, "bf16_losses": s_loss,
            "bf16_same_theta16": all(torch.equal(a, b) for a, b in zip(s_theta, d_theta,
                                                                       strict=True)),
            "samo_bytes": s_sent, "dense_bytes": d_sent, "kept_steps": kept,
            "kept": s_tr.optimizer.kept(), "phi": phi, "dense_trainer": d_tr}


def side_by_side(layouts, base: dict, root: Path) -> list[dict]:
    """Train `layouts` at once, each on its own ranks; every rank's record, on every rank.
    Groups are created on every rank of the world, in the same order (collective)."""
    rank = mcrdl.get_rank()
    mine = None
    for ranks, gi, gd, extra in layouts:
        opts = dict(base, G_inter=gi, G_data=gd, **extra)
        cfg = TrainConfig(**opts)
        grid = ProcessGrid(cfg.degrees(), order=cfg.axis_order(),
                           world=mcrdl.new_group(list(ranks)))
        grid.make_groups()
        if rank in ranks:
            mine = (opts, grid)
    record = train_grid(*mine, root)
    phase_trainer = record.pop("dense_trainer")
    records = mcrdl.all_gather_object(record)
    if len(layouts) == 1:  # the whole world: its dense masked checkpoint for check 6
        phase_trainer.cfg.checkpoint_dir = str(root / "dense-masked")
        phase_trainer.save_checkpoint()
    return records


def serial_references(records: list[dict], base: dict) -> dict[str, tuple[list, list]]:
    """The serial dense masked losses of each set of pruning options in `records`, by
    its JSON, with the margin of each pruning round's cut (reference.serial_run), on
    every rank; rank i computes the i-th (collective)."""
    keys = sorted({json.dumps(r["extra"], sort_keys=True) for r in records})
    mine = {}
    for i, k in enumerate(keys):
        if i % mcrdl.get_size() == mcrdl.get_rank():
            gaps = []
            losses, _ = serial_run(TrainConfig(**dict(base, **json.loads(k)), samo=True),
                                   dataset(), prune_gaps=gaps)
            mine[k] = (losses, gaps)
    return {k: v for part in mcrdl.all_gather_object(mine) for k, v in part.items()}


def report(records: list[dict], refs: dict[str, tuple[list, list]], base: dict) -> None:
    """On world rank 0: checks 1, 2 and 4 of every grid, from every rank's record."""
    by_grid: dict[tuple, list[dict]] = {}
    for r in records:
        by_grid.setdefault(r["grid"], []).append(r)
    for (gi, gd), rows in by_grid.items():
        extra = rows[0]["extra"]
        name = f"G_inter={gi} G_data={gd}{' ' + str(extra) if extra else ''}"
        (ref, gaps), got = refs[json.dumps(extra, sort_keys=True)], rows[0]["fp32"]
        assert all(r["fp32"] == got for r in rows), name  # one loss per step, everywhere
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
        # the rounds after step 0 choose from trained weights: their cut can be a near tie
        cuts = ", ".join(f"{g:.1e} at step {step}" for step, g in gaps if step > 0)
        print(f"samo fp32 {name}: loss {got[0]:.5f} -> {got[-1]:.5f}, max rel diff vs "
              f"serial dense masked {rel:.2e}{f'; serial cut margin {cuts}' if cuts else ''}",
              flush=True)
        assert rel <= TOL, (name, got, ref, "serial cut margins (step, relative gap) "
                            f"{gaps}: a few ulps is a near tie, which another rounding may "
                            "break the other way (see DATA)")
        assert got[-1] < got[0] - 0.01, (name, got)  # it trains
        assert all(r["bf16_same_losses"] and r["bf16_same_theta16"] for r in rows), name
        losses = rows[0]["bf16_losses"]
        print(f"samo bf16 {name}: {STEPS} steps, losses and theta16 bit-identical to dense "
              f"masked training ({losses[0]:.6f} -> {losses[-1]:.6f})", flush=True)
        for r in rows:  # 2 B per entry sent per step; G_data = 1 sends nothing
            dp = gd > 1
            assert r["samo_bytes"] == 2 * r["kept_steps"] * dp, (name, r)
            assert r["dense_bytes"] == 2 * STEPS * r["phi"] * dp, (name, r)
        first = [r for r in rows if r["data_rank"] == 0]  # one rank per stage
        kept, phi = sum(r["kept"] for r in first), sum(r["phi"] for r in first)
        if extra.get("prune_scope", "global") == "global":
            assert kept == kept_count(phi, base["prune_sparsity"]), (name, kept, phi)
        if gd > 1:
            s, d = sum(r["samo_bytes"] for r in rows), sum(r["dense_bytes"] for r in rows)
            if "prune_schedule" not in extra:
                assert s * phi == d * kept, (name, s, d, kept, phi)
            rounds = " over its rounds" if "prune_schedule" in extra else ""
            print(f"communication OK {name}: data-parallel all_reduce bytes SAMO {s} / dense "
                  f"{d} = {s / d:.6f}{rounds}; kept/phi after the last round = "
                  f"{kept}/{phi} = {kept / phi:.6f} (1 - p = {1 - base['prune_sparsity']:.2f}, "
                  "p phi floored)", flush=True)


def expect_error(cfg: TrainConfig, *fragments) -> str:
    try:
        run(cfg)
    except ckpt.CheckpointError as e:
        for f in fragments:
            assert f in str(e), f"expected {f!r} in: {e}"
        return str(e)
    raise AssertionError(f"resume from {cfg.resume} should have failed ({fragments})")


def resume_checks(base: dict, root: Path) -> None:
    opts = dict(base, G_inter=2, G_data=2, samo=True, prune_schedule="0,3,5")
    ck = root / "ck-samo"
    full = run(TrainConfig(**opts))
    first = run(TrainConfig(**opts, checkpoint_dir=str(ck), stop_after=4))
    resumed = run(TrainConfig(**opts, checkpoint_dir=str(ck), resume="latest"))
    a = [v for _, v in full.losses]
    assert [v for _, v in first.losses] == a[:4], (first.losses, a)
    assert resumed.start_step == 4 and [v for _, v in resumed.losses] == a[4:], \
        (resumed.losses, a)
    say(f"resume OK: rounds before steps 0, 3, 5; stopped after 4, resumed: steps 5-6 equal "
        f"the uninterrupted run exactly ({a[4]:.6f}, {a[5]:.6f})")
    if mcrdl.get_rank() == 0:
        state, mcfg = checkpoint_tool.consolidate(ck / "step_000004")
        model = GPT(config_from_dict(mcfg))
        model.load_state_dict(state, strict=True)
        phi = sum(t.numel() for t in state.values())
        zeros = sum(int((t == 0).sum()) for t in state.values())
        rounds = parse_schedule(opts["prune_schedule"], opts["prune_sparsity"])
        kept = kept_count(phi, rounds[1].sparsity)  # the rounds before steps 0 and 3 ran
        assert zeros >= phi - kept, (zeros, phi, kept)
        x, y = Batches(dataset(), mcfg["block_size"], 8, 8, seed=opts["seed"]) \
            .global_batch_at(4)
        with torch.no_grad():
            loss = lm_loss(model(x), y).item()
        rel = abs(loss - a[4]) / a[4]
        assert rel < TOL, (loss, a[4])
        say(f"consolidate OK: dense state_dict, {zeros} zeros >= {phi - kept} pruned after "
            f"two rounds; serial loss at step 5 {loss:.6f} vs resumed {a[4]:.6f} "
            f"(rel {rel:.1e})")
    errors = [
        expect_error(TrainConfig(**dict(opts, prune_sparsity=0.8), checkpoint_dir=str(ck),
                                 resume=str(ck / "step_000004")), "different mask", "0.9",
                     "0.8"),
        expect_error(TrainConfig(**dict(base, G_inter=2, G_data=2, dtype="bf16",
                                        prune_sparsity=None),
                                 resume=str(root / "dense-masked" / f"step_{STEPS:06d}")),
                     "holds a model pruned toward sparsity 0.9", "--prune-sparsity"),
    ]
    for e in errors:
        say(f"error: {e}")
    say("checkpoint errors OK: a different mask and a pruned checkpoint without pruning "
        "are rejected on every rank")


def llama_check(base: dict) -> None:
    """9. fp32 SAMO of a pruned tiny Llama (--arch llama: grouped-query attention,
    SwiGLU, RMSNorm) at (2,2): every step's loss equals the serial dense masked run
    within 1e-5 relative, and theta16 stays zero at the pruned positions."""
    cfg = TrainConfig(**dict(base, arch="llama", G_inter=2, G_data=2), samo=True)
    trainer = Trainer(cfg)
    got = []
    for _ in range(STEPS):
        got.append(trainer.train_step()[0])
        check_pruned(trainer)
    if mcrdl.get_rank() == 0:
        ref, _ = serial_run(cfg, dataset())
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
        assert rel <= TOL and got[-1] < got[0] - 0.01, (got, ref)
        say(f"samo fp32 llama G_inter=2 G_data=2: loss {got[0]:.5f} -> {got[-1]:.5f}, max "
            f"rel diff vs serial dense masked {rel:.2e}")


def replica_agreement_check() -> None:
    """7. A pruning round whose data-parallel replicas choose different masks (one
    replica's weights perturbed) raises DesyncError on every rank of the (2,2) grid, the
    other stage's ranks included; equal replicas pass."""
    from training.core.topology import Axis
    from training.samo.pruning import Pruning

    grid = ProcessGrid({Axis.PIPE: 2, Axis.DATA: 2})
    pipe, data = grid.group(Axis.PIPE), grid.group(Axis.DATA)
    me = grid.coords_of(grid.rank)
    for perturb in (False, True):
        torch.manual_seed(11)
        stage = torch.nn.Linear(16, 8)
        if perturb and me[Axis.PIPE] == 1 and me[Axis.DATA] == 1:
            with torch.no_grad():  # the smallest-magnitude weight becomes the largest
                w = stage.weight.view(-1)
                w[w.abs().argmin()] = 100.0
        try:
            Pruning(stage.named_parameters(), 0.5, parse_schedule(None, 0.5), "layer",
                    pipe, data)
        except mcrdl.DesyncError as e:
            assert perturb, f"equal replicas raised: {e}"
            where = "this pipeline stage" if me[Axis.PIPE] == 1 else "another pipeline stage"
            assert where in str(e) and "different masks" in str(e), str(e)
            assert "pruning round before step 0" in str(e), str(e)
            continue
        assert not perturb, "replicas with different masks passed the round"
    say("replica masks OK: equal replicas pass; one perturbed replica raises DesyncError on "
        "every rank of the (2,2) grid")


BASE = dict(model="tiny", steps=STEPS, micro_batch_size=1, global_batch_size=8, seed=7,
            lr=3e-3, warmup_steps=2, plot=False, progress=False, quiet=True,
            log_interval=10**6, prune_sparsity=0.9, prune_scope="global", data=DATA,
            vocab_size=VOCAB_SIZE, prune_schedule=None, bucket_mib=0.01, coarsening=2)


def main():
    mcrdl.init(["mpi"])
    if mcrdl.get_size() != 4:
        raise SystemExit("run under mpiexec -n 4")
    root = Path(mcrdl.broadcast_object(
        tempfile.mkdtemp(prefix="mcrdl-samo-") if mcrdl.get_rank() == 0 else None))
    base = dict(BASE, out_dir=str(root))
    mcrdl.configure(logging=True)  # check 4 reads each rank's log
    records = [r for layouts in PHASES for r in side_by_side(layouts, base, root)]
    mcrdl.configure(logging=False)
    refs = serial_references(records, base)
    failure = None
    if mcrdl.get_rank() == 0:
        try:
            report(records, refs, base)
        except AssertionError:
            failure = traceback.format_exc()
    # every rank stops at once on a failed check, instead of timing out waiting for rank 0
    failure = mcrdl.broadcast_object(failure)
    if failure:
        raise SystemExit(f"samo FAILED on world rank 0:\n{failure}" if mcrdl.get_rank() == 0
                         else 1)
    resume_checks(base, root)
    replica_agreement_check()
    llama_check(base)
    if mcrdl.get_rank() == 0:  # every rank is past its last use of the files
        shutil.rmtree(root)
    say(f"samo OK: world 4, grids {sorted({tuple(r['grid']) for r in records})}")
    cli_dir = os.environ["SAMO_CLI_DIR"]
    vocab = [] if VOCAB_SIZE is None else ["--vocab-size", str(VOCAB_SIZE)]
    rc = train_main(["--model", "tiny", "--data", DATA, *vocab, "--steps", "2", "--G-inter",
                     "2", "--G-data", "2", "--dtype", "bf16", "--samo", "--prune-sparsity", "0.9",
                     "--checkpoint-dir", cli_dir, "--out-dir", cli_dir, "--no-plot",
                     "--no-progress"])
    assert rc == 0


if __name__ == "__main__":
    main()
