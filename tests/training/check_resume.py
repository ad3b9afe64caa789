"""Resume and checkpoint integrity, under ``mpiexec -n 4`` (G_inter=2 x G_data=2).

1. An uninterrupted 20-step run; a run stopped after step 10 (checkpoint); a resumed
   run: its steps 11..20 equal the uninterrupted run's exactly (both optimizers).
2. The consolidated step-10 checkpoint loads into the serial GPT and gives the resumed
   run's step-11 loss.
3. A truncated shard, a corrupted shard, a missing manifest and a mismatched grid each
   give a CheckpointError on every rank naming the problem, and the intact checkpoints
   are left byte for byte as they were.
"""

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from training import checkpoint as checkpoint_tool  # noqa: E402
from training.core import checkpoint as ckpt  # noqa: E402
from training.core.data import Batches, ByteCorpus  # noqa: E402
from training.models.families import config_from_dict  # noqa: E402
from training.models.gpt import GPT, lm_loss  # noqa: E402
from training.train_gpt import (
    TrainConfig,  # noqa: E402
    run,  # noqa: E402
)


def digests(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def expect_error(cfg, *fragments):
    try:
        run(cfg)
    except ckpt.CheckpointError as e:
        msg = str(e)
        if mcrdl.get_rank() == 0:
            for f in fragments:
                assert f in msg, f"expected {f!r} in: {msg}"
        return msg
    raise AssertionError(f"resume from {cfg.resume} should have failed ({fragments})")


def main():
    mcrdl.init(["mpi"])
    rank = mcrdl.get_rank()
    assert mcrdl.get_size() == 4, "run with mpiexec -n 4"
    root = Path(tempfile.gettempdir()) / f"mcrdl-resume-{os.environ.get('PMI_RANK', '0')}"
    t = torch.tensor([hash(str(root)) % 1000], dtype=torch.int64)
    mcrdl.bcast("mpi", t, src=0)  # everyone uses rank 0's directory (shared file system)
    root = Path(tempfile.gettempdir()) / f"mcrdl-resume-{os.getppid()}-{int(t)}"
    base = dict(model="tiny", steps=20, G_inter=2, G_data=2, micro_batch_size=1,
                global_batch_size=8, seed=11, lr=3e-3, warmup_steps=3, plot=False,
                progress=False, quiet=True, log_interval=10**6, out_dir=str(root / "out"))
    for offload in (False, True):
        ck = root / f"ck-{offload}"
        full = run(TrainConfig(**base, offload_optimizer=offload))
        first = run(TrainConfig(**base, offload_optimizer=offload, checkpoint_dir=str(ck),
                                stop_after=10))
        resumed = run(TrainConfig(**base, offload_optimizer=offload, checkpoint_dir=str(ck),
                                  resume="latest"))
        if rank == 0:
            assert [s for s, _ in first.losses] == list(range(1, 11)), first.losses
            assert resumed.start_step == 10
            assert [s for s, _ in resumed.losses] == list(range(11, 21))
            a = [v for _, v in full.losses[10:]]
            b = [v for _, v in resumed.losses]
            assert a == b, f"offload={offload}: resumed {b} != uninterrupted {a}"
            assert [v for _, v in first.losses] == [v for _, v in full.losses[:10]]
            print(f"resume OK (offload={offload}): steps 11-20 equal the uninterrupted run "
                  f"exactly ({b[0]:.6f} ... {b[-1]:.6f})", flush=True)
    ck = root / "ck-False"
    step10, step20 = ck / "step_000010", ck / "step_000020"
    if rank == 0:
        state, mcfg = checkpoint_tool.consolidate(step10)
        model = GPT(config_from_dict(mcfg))
        model.load_state_dict(state, strict=True)
        data = Batches(ByteCorpus(), mcfg["block_size"], 8, 8, seed=11)
        x, y = data.global_batch_at(10)
        with torch.no_grad():
            loss = lm_loss(model(x), y).item()
        rel = abs(loss - resumed.losses[0][1]) / loss
        assert rel < 1e-5, (loss, resumed.losses[0][1])
        print(f"consolidate OK: {len(state)} tensors; serial loss at step 11 {loss:.6f} vs "
              f"resumed run {resumed.losses[0][1]:.6f} (rel {rel:.1e})", flush=True)
    mcrdl.all_reduce("mpi", torch.zeros(1))
    keep10 = digests(step10)

    bad = ck / "step_000030"

    def damage(kind):
        """A damaged newest checkpoint, step_000030 (a copy of step 20), made latest."""
        mcrdl.all_reduce("mpi", torch.zeros(1))
        if rank == 0:
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(step20, bad)
            shard = bad / "stage_01.pt"
            data = shard.read_bytes()
            if kind == "truncate":
                shard.write_bytes(data[: len(data) // 2])
            elif kind == "corrupt":
                shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
            elif kind == "no-manifest":  # a save that died before its manifest
                (bad / "manifest.json").unlink()
            (ck / "latest").write_text(bad.name + "\n")
        mcrdl.all_reduce("mpi", torch.zeros(1))

    cfg = dict(base, checkpoint_dir=str(ck), steps=30)
    msgs = {}
    damage("truncate")
    msgs["truncate"] = expect_error(TrainConfig(**cfg, resume="latest"), "stage_01.pt",
                                    "truncated", "step_000020")
    damage("corrupt")
    msgs["corrupt"] = expect_error(TrainConfig(**cfg, resume="latest"), "corrupt", "sha256",
                                   "--resume")
    damage("no-manifest")
    msgs["no-manifest"] = expect_error(TrainConfig(**cfg, resume=str(bad)),
                                       "not completely written", "step_000020")
    msgs["grid"] = expect_error(TrainConfig(**dict(cfg, G_inter=4, G_data=1),
                                            resume=str(step10)), "G_inter=2", "G_inter=4")
    # "latest" skips a checkpoint whose save never finished: resumes from step 20
    after = run(TrainConfig(**dict(cfg, stop_after=21), resume="latest"))
    if rank == 0:
        assert after.start_step == 20 and [s for s, _ in after.losses] == [21], after.losses
    if rank == 0:
        assert digests(step10) == keep10, "an intact checkpoint changed"
        for k, m in msgs.items():
            print(f"error ({k}): {m}", flush=True)
        print("checkpoint errors OK: 4 damaged/mismatched cases rejected on every rank, "
              "intact checkpoints unchanged; 'latest' skips an unfinished save", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
