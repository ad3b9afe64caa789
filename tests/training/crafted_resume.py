"""Crafted shards in real checkpoints of every engine, under ``mpiexec -n 2``.

For the pipeline (G_inter=2), 4D (G_x=2), SAMO (G_data=2, pruned, compressed shards)
and TED (train_moe, G_tensor=2) engines: a one-step run writes a checkpoint; one shard is
replaced by a file that runs ``touch MARKER`` when unpickled (tests/training/
crafted_checkpoint.py), its manifest updated to match. Then, on every rank:

1. ``--resume`` is refused with a CheckpointError naming the shard and the global it
   would call, also with ``--trust-checkpoint`` (the current format never unpickles
   beyond plain data); ``python -m training.checkpoint consolidate`` of it is refused
   the same way; the marker is never created.
2. (pipeline) ``--init-from`` a crafted consolidated state_dict is refused by name.
3. (pipeline) An honest checkpoint rewritten as the previous format wrote it
   (mcrdl-training-checkpoint/1: torch.save shards) is refused naming
   ``--trust-checkpoint``, and resumes with it.

Rank 0 prints one "crafted ... OK" line per check.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from crafted_checkpoint import crafted_bytes, replace_shard, to_previous_format  # noqa: E402

import mcrdl  # noqa: E402
from training import checkpoint as checkpoint_tool  # noqa: E402
from training import train_gpt, train_moe  # noqa: E402
from training.core import checkpoint as ckpt  # noqa: E402

GLOBAL = f"{os.system.__module__}.system"  # the name the crafted pickle stores


def gpt(root: Path, **kw) -> train_gpt.TrainConfig:
    base = dict(model="tiny", n_layer=2, n_embd=32, n_head=2, block_size=16, steps=2,
                micro_batch_size=1, global_batch_size=2, seed=5, lr=3e-3, warmup_steps=1,
                plot=False, progress=False, quiet=True, log_interval=10**6,
                out_dir=str(root / "out"))
    return train_gpt.TrainConfig(**{**base, **kw})


def moe(root: Path, **kw) -> train_moe.MoETrainConfig:
    base = dict(model="moe-tiny", steps=2, experts=2, top_k=1, capacity_factor=0.8,
                router_group_tokens=32, moe_every=2, micro_batch_size=2,
                global_batch_size=4, seed=7, lr=3e-3, warmup_steps=1, plot=False,
                progress=False, quiet=True, comm_log=False, out_dir=str(root / "out"),
                G_tensor=2, G_expert=1, G_data=1)
    return train_moe.MoETrainConfig(**{**base, **kw})


def refused(run, cfg, *fragments) -> str:
    """`run(cfg)` raises CheckpointError on this rank, with every fragment in it."""
    try:
        run(cfg)
    except ckpt.CheckpointError as e:
        for f in fragments:
            assert f in str(e), f"rank {mcrdl.get_rank()}: expected {f!r} in: {e}"
        return str(e)
    raise AssertionError(f"rank {mcrdl.get_rank()}: {cfg.resume or cfg.init_from} loaded")


def main():
    mcrdl.init(["mpi"])
    rank = mcrdl.get_rank()
    assert mcrdl.get_size() == 2, "run with mpiexec -n 2"
    root = Path(mcrdl.broadcast_object(tempfile.mkdtemp(prefix="mcrdl-crafted-")
                                       if rank == 0 else None))
    marker = root / "MARKER"
    engines = {
        "pipeline": (train_gpt.run, lambda **kw: gpt(root, G_inter=2, **kw)),
        "4d": (train_gpt.run, lambda **kw: gpt(root, G_x=2, engine="4d", **kw)),
        "samo": (train_gpt.run, lambda **kw: gpt(root, G_data=2, samo=True,
                                                 prune_sparsity=0.5, **kw)),
        "ted": (train_moe.run, lambda **kw: moe(root, **kw)),
    }
    for name, (run, cfg) in engines.items():
        ck = root / name
        run(cfg(checkpoint_dir=str(ck), stop_after=1))
        step = ck / "step_000001"
        if name == "pipeline" and rank == 0:  # an honest copy for check 3
            shutil.copytree(step, root / "v1" / step.name)
        mcrdl.barrier("mpi")
        if rank == 0:
            replace_shard(step, -1, crafted_bytes(marker))
        shard = str(sorted(step.glob("*.pt"))[-1])
        mcrdl.barrier("mpi")
        for trust in (False, True):
            msg = refused(run, cfg(checkpoint_dir=str(ck), resume="latest",
                                   trust_checkpoint=trust), shard, GLOBAL, "refused")
        assert not marker.exists(), f"{name}: the crafted shard ran"
        if rank == 0:
            try:
                checkpoint_tool.consolidate(step)
                raise AssertionError(f"{name}: consolidate loaded the crafted shard")
            except ckpt.CheckpointError as e:
                assert shard in str(e) and GLOBAL in str(e), e
            assert not marker.exists(), f"{name}: consolidate ran the crafted shard"
            print(f"crafted {name} OK: resume and consolidate refused on every rank, "
                  f"nothing ran: {msg}", flush=True)
        mcrdl.barrier("mpi")

    # 2. --init-from a crafted consolidated state_dict
    init = root / "gpt.pt"
    if rank == 0:
        init.write_bytes(crafted_bytes(marker))
    mcrdl.barrier("mpi")
    msg = refused(train_gpt.run, gpt(root, G_inter=2, init_from=str(init)), f"--init-from {init}",
                  GLOBAL)
    assert not marker.exists(), "--init-from ran the crafted file"
    if rank == 0:
        print(f"crafted init-from OK: {msg}", flush=True)

    # 3. the previous format: only with --trust-checkpoint
    old = root / "v1" / "step_000001"
    if rank == 0:
        to_previous_format(old)
    mcrdl.barrier("mpi")
    msg = refused(train_gpt.run, gpt(root, G_inter=2, resume=str(old)),
                  ckpt.TRUST_OPTION, "arbitrary code execution", str(old))
    result = train_gpt.run(gpt(root, G_inter=2, resume=str(old), trust_checkpoint=True))
    if rank == 0:
        assert result.start_step == 1 and [s for s, _ in result.losses] == [2], result.losses
        print(f"crafted previous-format OK: refused without the flag ({msg}); resumed "
              "with it", flush=True)
    mcrdl.barrier("mpi")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
