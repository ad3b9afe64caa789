"""SAMO (training/samo.py) under ``mpiexec -n N``, N in 1..4, on the grids of GRIDS[N].

Per grid, a pruned tiny GPT (sparsity 0.9) trains STEPS steps:

1. fp32 SAMO: every step's loss equals the serial dense masked run
   (tests/training/reference.py) within 1e-5 relative, and each stage's mask equals the
   serial run's (the mask does not depend on the grid).
2. bf16 SAMO and bf16 dense masked training (OffloadedAdamW with the same mask): the
   same loss bits at every step and the same theta16 bits at the end.
3. After every step of both SAMO runs, theta16 is exactly zero at the pruned positions
   and equals theta32 (rounded to the training dtype) at the index.

With N = 4, on the (2,2) grid, also:

4. The communication log: the data-parallel all-reduce bytes of SAMO are the unpruned
   entries' (kept x 2 B per step and rank), those of dense masked training every
   entry's, so SAMO sends (1 - p) of the dense bytes, up to the floor in kept.
5. An iterative schedule (rounds before steps 0, 3, 5) stopped after step 4 with a
   checkpoint and resumed gives the uninterrupted run's losses exactly; the
   consolidated checkpoint is dense with zeros at the pruned positions and gives the
   resumed run's next loss in the serial model.
6. A checkpoint of a different mask (another sparsity), and a pruned checkpoint resumed
   without pruning, are CheckpointErrors on every rank naming the difference.
7. The entry point with --samo (last: it finalizes mcrdl), writing a checkpoint to
   ``$SAMO_CLI_DIR`` that the test consolidates.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from tests.training.reference import serial_index, serial_losses  # noqa: E402
from training import checkpoint as ckpt  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.data import Batches, ByteCorpus  # noqa: E402
from training.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from training.pruning import kept_count, parse_schedule, pruned_mask  # noqa: E402
from training.train_gpt import main as train_main  # noqa: E402
from training.train_gpt import run  # noqa: E402
from training.trainer import Trainer  # noqa: E402

GRIDS = {  # world size -> [(G_inter, G_data, extra options)]
    1: [(1, 1, {})],
    2: [(2, 1, {}), (1, 2, {"prune_scope": "layer", "prune_schedule": "0,3"})],
    3: [(3, 1, {})],
    4: [(2, 2, {})],
}
STEPS = 6
TOL = 1e-5


def say(*args):
    if mcrdl.get_rank() == 0:
        print(*args, flush=True)


def all_ok(ok: bool) -> bool:
    """Whether `ok` holds on every rank (collective)."""
    t = torch.tensor([0 if ok else 1], dtype=torch.int32)
    mcrdl.all_reduce("mpi", t, op=mcrdl.ReduceOp.MAX)
    return int(t) == 0


def check_pruned(trainer: Trainer) -> None:
    """theta16 is zero at the pruned positions and theta32 (rounded) at the index."""
    opt = trainer.optimizer
    for name, p, (a, b), index in zip(opt.names, opt.params, opt.slots, opt.index,
                                      strict=True):
        dense = p.detach().view(-1)
        assert not dense.masked_select(pruned_mask(p.numel(), index)).any(), name
        assert torch.equal(dense[index.long()], opt.theta32[a:b].to(p.dtype)), name


def train(cfg: TrainConfig, check=None) -> tuple[list[float], Trainer]:
    trainer = Trainer(cfg)
    losses = []
    for _ in range(cfg.steps):
        losses.append(trainer.train_step()[0])
        if check:
            check(trainer)
    return losses, trainer


def grid_checks(base: dict, data) -> None:
    n = mcrdl.get_size()
    for gi, gd, extra in GRIDS[n]:
        opts = dict(base, G_inter=gi, G_data=gd, **extra)
        if n == 4:
            opts["grad_clip"] = 0.0  # only the data-parallel all-reduce has group size 2
        grid = f"G_inter={gi} G_data={gd} {extra or ''}"
        cfg32 = TrainConfig(**opts, samo=True)
        ref = serial_losses(cfg32, data) if mcrdl.get_rank() == 0 else None
        got, trainer = train(cfg32, check_pruned)
        if extra.get("prune_schedule") is None:  # the mask of a grid is the serial mask
            want = serial_index(cfg32)
            opt = trainer.optimizer
            assert all(torch.equal(i, want[k]) for k, i in zip(opt.names, opt.index,
                                                               strict=True)), grid
        if mcrdl.get_rank() == 0:
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
            say(f"samo fp32 {grid}: loss {got[0]:.5f} -> {got[-1]:.5f}, max rel diff vs "
                f"serial dense masked {rel:.2e}")
            assert rel <= TOL, (got, ref)
        logging = n == 4
        if logging:
            mcrdl.configure(logging=True)
        runs = {}
        for samo in (True, False):
            cfg = TrainConfig(**opts, samo=samo, dtype="bf16")
            trainer = Trainer(cfg)
            if logging:
                mcrdl.reset_log()
            losses = []
            for _ in range(cfg.steps):
                losses.append(trainer.train_step()[0])
                if samo:
                    check_pruned(trainer)
            rows = mcrdl.log_summary(gather=True, quiet=True) if logging else []
            dp_bytes = sum(r["bytes"] for r in rows
                           if r["op"] == "all_reduce" and r["group_size"] == gd)
            runs[samo] = (losses, [p.detach().clone() for p in trainer.model_stage.parameters()],
                          dp_bytes, trainer)
        (s_loss, s_params, s_bytes, s_tr), (d_loss, d_params, d_bytes, d_tr) = \
            runs[True], runs[False]
        same = all(torch.equal(a, b) for a, b in zip(s_params, d_params, strict=True))
        assert all_ok(same and s_loss == d_loss), f"bf16 {grid}: SAMO and dense masked differ"
        say(f"samo bf16 {grid}: {STEPS} steps, losses and theta16 bit-identical to dense "
            f"masked training ({s_loss[0]:.6f} -> {s_loss[-1]:.6f})")
        if logging:
            mcrdl.configure(logging=False)
            kept = torch.tensor([s_tr.optimizer.kept()])
            mcrdl.all_reduce("mpi", kept, group=s_tr.pipe_group)  # over the stages
            phi = s_tr.model_cfg.n_params()
            total_kept = kept_count(phi, base["prune_sparsity"])
            assert int(kept) == total_kept, (int(kept), total_kept)
            if mcrdl.get_rank() == 0:
                assert s_bytes == 2 * STEPS * gd * total_kept, (s_bytes, total_kept)
                assert d_bytes == 2 * STEPS * gd * phi, (d_bytes, phi)
                assert s_bytes * phi == d_bytes * total_kept
                say(f"communication OK: data-parallel all_reduce bytes SAMO {s_bytes} / dense "
                    f"{d_bytes} = {s_bytes / d_bytes:.6f} = kept/phi = {total_kept}/{phi} "
                    f"(1 - p = {1 - base['prune_sparsity']:.6f}, p phi floored)")
            directory = Path(base["out_dir"]) / "dense-masked"
            d_tr.cfg.checkpoint_dir = str(directory)
            d_tr.save_checkpoint()


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
        state, mcfg = ckpt.consolidate(ck / "step_000004")
        model = GPT(GPTConfig(**mcfg))
        model.load_state_dict(state, strict=True)
        phi = sum(t.numel() for t in state.values())
        zeros = sum(int((t == 0).sum()) for t in state.values())
        rounds = parse_schedule(opts["prune_schedule"], opts["prune_sparsity"])
        kept = kept_count(phi, rounds[1].sparsity)  # the rounds before steps 0 and 3 ran
        assert zeros >= phi - kept, (zeros, phi, kept)
        x, y = Batches(ByteCorpus(), mcfg["block_size"], 8, 8, seed=opts["seed"]) \
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
                                 resume=str(root / "dense-masked" / "step_000006")),
                     "holds a model pruned toward sparsity 0.9", "--prune-sparsity"),
    ]
    for e in errors:
        say(f"error: {e}")
    say("checkpoint errors OK: a different mask and a pruned checkpoint without pruning "
        "are rejected on every rank")


def main():
    mcrdl.init(["mpi"])
    n = mcrdl.get_size()
    t = torch.tensor([os.getpid()], dtype=torch.int64)
    mcrdl.bcast("mpi", t, src=0)
    root = Path(tempfile.gettempdir()) / f"mcrdl-samo-{int(t)}"
    base = dict(model="tiny", steps=STEPS, micro_batch_size=1, global_batch_size=8, seed=7,
                lr=3e-3, warmup_steps=2, plot=False, progress=False, quiet=True,
                out_dir=str(root), log_interval=10**6, prune_sparsity=0.9, bucket_mib=0.01,
                coarsening=2)
    data = ByteCorpus()
    grid_checks(base, data)
    if n == 4:
        resume_checks(base, root)
    say(f"samo OK: world {n}, grids {[g[:2] for g in GRIDS[n]]}")
    if n == 4:
        cli_dir = os.environ["SAMO_CLI_DIR"]
        rc = train_main(["--model", "tiny", "--steps", "2", "--G-inter", "2", "--G-data", "2",
                         "--dtype", "bf16", "--samo", "--prune-sparsity", "0.9",
                         "--checkpoint-dir", cli_dir, "--out-dir", cli_dir, "--no-plot",
                         "--no-progress"])
        assert rc == 0
        return
    mcrdl.finalize()


if __name__ == "__main__":
    main()
