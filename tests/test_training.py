"""The training package (issue 7): parity with serial PyTorch, resume, message-driven
pipeline, entry point, and single-process unit checks."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ._launch import (
    FULL,
    mpiexec_or_skip,
    pythonpath,
    run_launcher,
    run_scripts,
    skip_without,
    without_launcher,
)
from .training.check_parity import plan

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**kw):
    env = dict(os.environ, MCRDL_TIMEOUT="90", PYTHONPATH=pythonpath(ROOT), **kw)
    return env


@pytest.fixture(scope="module")
def four_ranks() -> str:
    """check_parity.py, then check_resume.py, in one 4-rank launch (tests/_multi.py: each
    rank imports torch once for both)."""
    plan = [[os.path.join(HERE, s), [], {}] for s in ("check_parity.py", "check_resume.py")]
    return run_scripts(4, plan, _env(), timeout=500)


@pytest.mark.parametrize("n", [pytest.param(1, marks=FULL), pytest.param(2, marks=FULL),
                               pytest.param(3, marks=FULL), 4])
def test_parity_with_serial_pytorch(n, request):
    """Every step's loss of (G_inter, G_data) in {(2,2) even and uneven, (4,1)}, and in the
    wider sweep (1,1), (2,1), (1,2) and (3,1) even and uneven, both optimizers, equals the
    serial run to 1e-5; the same grids with --arch llama (check_parity.plan)."""
    out = request.getfixturevalue("four_ranks") if n == 4 else run_launcher(
        [mpiexec_or_skip(), "-n", str(n), sys.executable, os.path.join(HERE, "check_parity.py")],
        env=_env(), timeout=300)
    m = re.search(r"parity OK: world (\d+), (\d+) runs x 20 steps, max rel diff (\S+)", out)
    assert m, out
    # every grid of the world size, with both optimizers: a dropped run fails
    want = [(arch, str(gi), str(gd), lps or "even", str(offload))
            for arch, gi, gd, lps, offload in plan(n)]
    ran = re.findall(r"parity arch=(\w+) G_inter=(\d+) G_data=(\d+) layers=(\S+) "
                     r"offload=(\w+):", out)
    assert ran == want, f"runs {ran}, expected {want}:\n{out}"
    assert int(m.group(1)) == n and int(m.group(2)) == len(want) and float(m.group(3)) <= 1e-5


def test_message_driven_pipeline():
    out = run_launcher([mpiexec_or_skip(), "-n", "3", sys.executable,
                        os.path.join(HERE, "check_message_driven.py")], env=_env(), timeout=300)
    assert "message-driven OK" in out, out


def test_resume_and_checkpoint_integrity(four_ranks):
    out = four_ranks
    assert out.count("resume OK") == 2 and "consolidate OK" in out, out
    assert "checkpoint errors OK" in out, out


def test_entry_point_mpiexec(tmp_path):
    """python -m training.train_gpt under mpiexec: log lines, metrics JSON lines,
    breakdown, loss PNG, a checkpoint, and the consolidate tool on it."""
    metrics = tmp_path / "m.jsonl"
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "tiny"\nsteps = 50\nG_inter = 2\nlr = 3e-3\n')
    cmd = [mpiexec_or_skip(), "-n", "4", sys.executable, "-m", "training.train_gpt",
           "--config", str(cfg), "--steps", "6", "--G-data", "2", "--micro-batch-size", "1",
           "--metrics", str(metrics), "--out-dir", str(tmp_path / "out"),
           "--checkpoint-dir", str(tmp_path / "ck"), "--activation-checkpointing"]
    out = run_launcher(cmd, env=_env(), timeout=300)
    assert "G_inter=2 x G_data=2" in out, out
    assert len(re.findall(r"^step +\d+/6 \| loss", out, re.M)) == 6, out  # rank 0 only
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in recs)
    for phase in ("compute", "p2p", "bubble", "collective", "optimizer"):
        assert phase in out
    assert re.search(r"bubble fraction: measured [\d.]+ .* = 0\.\d+", out), out
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "ck" / "step_000006" / "manifest.json").exists()
    sd_path = tmp_path / "gpt.pt"
    r = subprocess.run([sys.executable, "-m", "training.checkpoint", "consolidate",
                        str(tmp_path / "ck"), "-o", str(sd_path)], capture_output=True,
                       text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    from training.models.families import config_from_dict, family_of
    mcfg = config_from_dict(json.loads(sd_path.with_suffix(".json").read_text()))
    model = family_of(mcfg).stage(mcfg, 0, mcfg.n_units - 1)
    model.load_state_dict(torch.load(sd_path), strict=True)


def test_entry_point_torchrun(tmp_path):
    torchrun = os.path.join(sys.prefix, "bin", "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    if not torchrun:
        skip_without("torchrun not found")
    env = {k: v for k, v in _env().items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA"))}
    out = run_launcher([torchrun, "--standalone", "--nproc_per_node", "2", "-m",
                        "training.train_gpt", "--steps", "3", "--G-inter", "2",
                        "--out-dir", str(tmp_path), "--no-plot"], env=env, timeout=300)
    assert "p2p 'gloo'" in out and "step     3/3" in out, out


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_trains(tmp_path, dtype):
    """bf16/fp16 keep fp32 master weights (offloaded optimizer); fp16 scales the loss."""
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable, "-m",
                        "training.train_gpt", "--steps", "12", "--G-inter", "2", "--dtype",
                        dtype, "--lr", "3e-3", "--out-dir", str(tmp_path), "--no-plot"],
                       env=_env(), timeout=300)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs]
    assert all(map(lambda v: v == v and v < 10, losses)), losses
    assert losses[-1] < losses[0] - 0.1, losses
    if dtype == "fp16":
        assert all("loss_scale" in r for r in recs)
    assert "(0.07 M params, " + dtype + ")" in out


# --- single process --------------------------------------------------------------------
def test_partition():
    from training.pipeline.engine import partition
    assert partition(4, 1) == [(0, 5)]
    assert partition(4, 3) == [(0, 2), (3, 3), (4, 5)]      # uneven: 2, 1, 1 blocks
    assert partition(5, 3, [1, 3, 1]) == [(0, 1), (2, 4), (5, 6)]
    assert partition(4, 2, [0, 4]) == [(0, 0), (1, 5)]       # stage 0: embedding only
    with pytest.raises(ValueError, match="summing to n_layer=4"):
        partition(4, 2, [1, 2])
    with pytest.raises(ValueError, match="inner stages need at least one block"):
        partition(4, 3, [2, 0, 2])
    with pytest.raises(ValueError, match="--G-inter <= 2"):
        partition(2, 3)


@pytest.mark.parametrize("launcher, local", [
    ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"}, 1),       # MPICH hydra
    ({"OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3),                               # Open MPI
    ({"PMI_RANK": "7", "SLURM_PROCID": "7", "SLURM_LOCALID": "3"}, 3),     # srun --mpi=pmi2
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, 1),  # srun, no PMI
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, 3),               # torchrun
    ({}, 0),                                                                # python script.py
])
def test_auto_device_is_the_launchers_local_gpu(monkeypatch, launcher, local):
    """--device auto takes GPU local_rank % visible GPUs for every launcher mcrdl knows,
    the GPU the nccl backend uses (it had read only LOCAL_RANK and MPI_LOCALRANKID, so
    every rank of an Open MPI or srun job landed on cuda:0)."""
    from training.core.runtime import pick_device
    without_launcher(monkeypatch)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("auto") == torch.device("cuda", local % 2)
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")


def test_world_mismatch_names_the_options():
    """A grid that does not fill the world is refused in the options' words, with the
    launch that fits it and, where one does, the --G-data that fits the world."""
    from training.core.topology import GridError
    from training.train_gpt import TrainConfig
    cfg = TrainConfig(model="tiny", G_inter=2)
    cfg.check_world(2)
    with pytest.raises(GridError, match=r"process grid G_inter=2 x G_data=1 needs 2 ranks but "
                       r"the world has 4; launch with .* or change the degrees so that their "
                       r"product is 4 \(with --G-inter 2: --G-data 2\)$"):
        cfg.check_world(4)
    with pytest.raises(GridError, match=r"product is 2 \(--G-data 2\)$"):
        TrainConfig(model="tiny").check_world(2)
    with pytest.raises(GridError, match=r"product is 3$"):
        cfg.check_world(3)
    # a --G-data the global batch (8 of 2-sequence microbatches) cannot split is not offered
    with pytest.raises(GridError, match=r"product is 3$"):
        TrainConfig(model="tiny").check_world(3)
    with pytest.raises(GridError, match=r"product is 3 \(--G-data 3\)$"):
        TrainConfig(model="tiny", global_batch_size=6).check_world(3)
    TrainConfig(model="tiny", G_inter=0).check_world(2)  # validate() names a bad degree


def test_world_mismatch_from_the_entry_point(tmp_path):
    """The pipeline Trainer checks the grid in the options' words: exit 2, one line."""
    r = subprocess.run([mpiexec_or_skip(), "-n", "1", sys.executable, "-m",
                        "training.train_gpt", "--G-inter", "2", "--steps", "1", "--no-plot",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error: process grid G_inter=2 x G_data=1 needs 2 ranks but the world has 1" \
        in r.stderr, r.stderr


def test_process_grid():
    from training.core.topology import GridError, ProcessGrid
    g = ProcessGrid({"data": 2, "pipe": 4}, world_size=8, rank=5)
    assert g.coords_of(5) == {"data": 1, "pipe": 2}
    assert g.line("pipe") == [1, 3, 5, 7] and g.line("data") == [4, 5]
    g2 = ProcessGrid({"data": 2, "pipe": 4}, order=["pipe", "data"], world_size=8, rank=5)
    assert g2.line("pipe") == [4, 5, 6, 7]
    with pytest.raises(GridError, match="needs 12 ranks but the world has 8"):
        ProcessGrid({"data": 3, "pipe": 4}, world_size=8, rank=0)
    with pytest.raises(GridError, match="degree 0"):
        ProcessGrid({"data": 0}, world_size=1, rank=0)


def test_process_grid_on_a_group():
    """A grid spanning a group of world ranks (runs side by side in one launch): grid
    ranks are group ranks; a process outside the group has no coordinates."""
    from mcrdl import Group
    from training.core.topology import GridError, ProcessGrid
    g = ProcessGrid({"pipe": 3}, world=Group((1, 2, 3), world_rank=3, group_id=7))
    assert (g.world_size, g.rank, g.coord("pipe"), g.line("pipe")) == (3, 2, 2, [0, 1, 2])
    outside = ProcessGrid({"pipe": 3}, world=Group((1, 2, 3), world_rank=0, group_id=7))
    assert not outside.is_member and "not a member" in repr(outside)
    with pytest.raises(GridError, match="not in the grid.s group of world ranks"):
        outside.coord("pipe")
    with pytest.raises(GridError, match=r"its group \[1, 2, 3\] has 3"):
        ProcessGrid({"pipe": 2}, world=Group((1, 2, 3), world_rank=1, group_id=7))


def test_stage_weights_match_whole_model():
    from training.models.gpt import CONFIGS, GPT, GPTStage
    cfg = CONFIGS["tiny"]
    whole = GPT(cfg, seed=3).state_dict()
    part = GPTStage(cfg, 2, 5, seed=3).state_dict()
    assert all(torch.equal(part[k], whole[k]) for k in part)
    assert sum(v.numel() for v in whole.values()) == cfg.n_params()
    x = torch.randint(0, 256, (2, cfg.block_size))
    a = GPT(cfg, seed=3)(x)
    b = GPT(cfg, seed=3, activation_checkpointing=True)(x)
    assert torch.equal(a, b)


def test_batches_shard_the_global_batch():
    from training.core.data import Batches, ByteCorpus
    corpus = ByteCorpus(max_bytes=1 << 20)
    whole = Batches(corpus, 16, 12, 12, seed=5).global_batch_at(7)
    parts = [Batches(corpus, 16, 12, 2, dp_rank=r, dp_size=3, seed=5).microbatches(7)
             for r in range(3)]
    xs = torch.cat([x for p in parts for x, _ in p])
    ys = torch.cat([y for p in parts for _, y in p])
    assert torch.equal(xs, whole[0]) and torch.equal(ys, whole[1])
    assert torch.equal(whole[0][:, 1:], whole[1][:, :-1])  # targets are the next bytes
    with pytest.raises(ValueError, match="multiple of 6"):
        Batches(corpus, 16, 8, 2, dp_rank=0, dp_size=3)


def test_saving_a_step_again_keeps_the_old_checkpoint_until_the_new_one_is_whole(tmp_path):
    """A run resumed from an earlier step saves a step that already has a checkpoint:
    the save goes to a staging directory, so a crash before its manifest leaves the old
    checkpoint whole and named by ``latest``; the published one replaces it and the
    crashed save's leftovers go."""
    from training import checkpoint as checkpoint_tool
    from training.core import checkpoint as ckpt
    root = tmp_path / "ck"
    final = ckpt.step_dir(root, 4)

    def save(token: str, value: float, publish: bool):
        staging = ckpt.staging_dir(final, token)
        staging.mkdir(parents=True)
        shard = ckpt.save_shard(staging, 0, {"w": torch.full((3,), value)})
        if publish:
            ckpt.write_manifest(staging, {"format": ckpt.FORMAT, "step": 4, "shards": [shard]},
                                publish_as=final)

    save("a", 1.0, publish=True)
    save("b", 2.0, publish=False)  # crashed before its manifest
    assert ckpt.latest_checkpoint(root) == final
    manifest = ckpt.read_manifest(final)
    assert torch.equal(ckpt.load_shard(final, manifest, 0)["w"], torch.full((3,), 1.0))
    save("c", 3.0, publish=True)
    manifest = ckpt.read_manifest(final)
    assert torch.equal(ckpt.load_shard(final, manifest, 0)["w"], torch.full((3,), 3.0))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004"]
    # the checkpoint directory given where a step is wanted: said so, not "incomplete"
    with pytest.raises(ckpt.CheckpointError, match="is a checkpoint directory, not one"):
        ckpt.read_manifest(root)
    # consolidate -o x.json would write the config over the state_dict
    assert checkpoint_tool.main(["consolidate", str(root), "-o", str(tmp_path / "x.json")]) != 0
    assert not (tmp_path / "x.json").exists()


def test_checkpoint_list_says_which_load(tmp_path, capsys):
    """``checkpoint list`` had stopped at the first unreadable manifest and shown
    checkpoints with bad shards as fine; the hints of the load errors named them too."""
    from training import checkpoint as checkpoint_tool
    from training.core import checkpoint as ckpt
    root = tmp_path / "ck"

    def save(step: int, publish: bool = True) -> Path:
        final = ckpt.step_dir(root, step)
        staging = ckpt.staging_dir(final, f"t{step}")
        staging.mkdir(parents=True)
        shard = ckpt.save_shard(staging, 0, {"w": torch.full((64,), float(step))})
        manifest = {"format": ckpt.FORMAT, "step": step, "grid": {"G_inter": 1},
                    "shards": [shard]}
        if publish:
            ckpt.write_manifest(staging, manifest, publish_as=final)
        else:
            staging.rename(final)  # a save that never wrote its manifest
        return final

    good, short, flipped, torn = save(2), save(4), save(6), save(8, publish=False)
    shard = short / "stage_00.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    shard = flipped / "stage_00.pt"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint_tool.main(["list", str(root)]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^{good}  step 2 .* ok$", out, re.M), out
    assert re.search(rf"^{short}  step 4 .*UNUSABLE: shard stage_00.pt is \d+ bytes", out,
                     re.M), out
    assert re.search(rf"^{flipped}  step 6 .*\(latest\)  ok$", out, re.M), out  # same size
    assert re.search(rf"^{torn}  UNUSABLE: checkpoint .* has no manifest.json", out, re.M), out
    assert "# 2 of 4 cannot be loaded; the newest usable: --resume " + str(flipped) in out
    assert checkpoint_tool.main(["list", str(root), "--verify"]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^{flipped}  step 6 .*UNUSABLE: shard stage_00.pt is corrupt", out,
                     re.M), out
    assert re.search(rf"^{good}  step 2 .* ok \(sha256 verified\)$", out, re.M), out
    # a load error's hint names only checkpoints whose shards are whole
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.read_manifest(torn)
    assert "complete checkpoints: step_000002, step_000006 (" in str(e.value), e.value
    assert checkpoint_tool.main(["list", str(tmp_path / "none")]) == 2
    # two unreadable manifests: each one's error names the usable others, without
    # reading the other broken one's hints in turn (that had recursed without end)
    (short / "manifest.json").write_text("{")
    (good / "manifest.json").write_text("[]")
    with pytest.raises(ckpt.CheckpointError, match="is not valid JSON .*complete checkpoints: "
                                                   "step_000006 \\("):
        ckpt.read_manifest(short)
    assert checkpoint_tool.main(["list", str(root)]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^{good}  UNUSABLE: .*format \[\], expected", out, re.M), out


def test_resume_names_the_engine_that_wrote_the_checkpoint():
    """A train_gpt checkpoint given to train_moe said "tensor-parallel layers are None",
    the reverse KeyError 'G_inter': the engine is checked first, naming the command."""
    from training.core import checkpoint as ckpt
    ckpt.check_engine({"engine": "ted"}, Path("d"), "ted")
    ckpt.check_engine({}, Path("d"), "pipeline")  # manifests before "engine" existed
    for saved, engine, command in (("ted", "pipeline", "python -m training.train_moe"),
                                   (None, "ted", "python -m training.train_gpt with G_x"),
                                   ("4d", "ted", "python -m training.train_gpt with --G-x"),
                                   ("4d", "pipeline", "python -m training.train_gpt with --G-x")):
        manifest = {} if saved is None else {"engine": saved}
        with pytest.raises(ckpt.CheckpointError, match=f"resume it with {command}") as e:
            ckpt.check_engine(manifest, Path("d"), engine)
        # the serial GPT fits the other GPT engine only: --init-from offered there alone
        assert ("--init-from" in str(e.value)) == ("ted" not in (saved, engine)), e.value


def test_token_memmap(tmp_path):
    import numpy as np

    from training.core.data import Batches, load_dataset
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    ds = load_dataset(str(tmp_path), vocab_size=5000)
    x, y = Batches(ds, 8, 4, 2, seed=0).global_batch_at(0)
    assert torch.equal(y, x + 1) and int(x.max()) < 5000


def test_logged_lr_is_the_applied_one_after_fp16_skips(tmp_path):
    """fp16 steps that overflow apply no update and the schedule follows applied updates:
    the metrics' lr is the one the optimizer used (it had been the step's, ahead of it
    after each skip). The first 3 steps overflow (a gradient set to inf)."""
    from ._launch import RESULT_MARK, fresh_probe
    script = f"""
import json, sys
sys.path.insert(0, {ROOT!r})
import mcrdl
from training.train_gpt import TrainConfig
from training.pipeline.trainer import Trainer
mcrdl.init(["gloo"])
cfg = TrainConfig(model="tiny", steps=6, dtype="fp16", micro_batch_size=2, global_batch_size=4,
                  warmup_steps=5, lr=1e-3, plot=False, progress=False, quiet=True,
                  out_dir={str(tmp_path)!r})
tr = Trainer(cfg)
opt = tr.optimizer
gather = opt._gather_grads
def overflow():
    gather()
    if tr.step < 3:
        opt.flat_grad[0] = float("inf")
opt._gather_grads = overflow
rows = []
for _ in range(6):
    used = cfg.optim().lr_at(opt.step_count)
    loss, applied = tr.train_step()
    rows.append((applied, tr.metrics_record(loss, 1.0, 1, applied)["lr"], used))
mcrdl.finalize()
print({RESULT_MARK!r} + json.dumps(rows))
"""
    rows = fresh_probe(script)
    assert [a for a, _, _ in rows] == [False] * 3 + [True] * 3, rows
    assert all(lr == used for applied, lr, used in rows if applied), rows


def test_cli_config_and_errors(tmp_path):
    from training.train_gpt import parse_args
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"steps": 7, "G-inter": 2, "dtype": "bf16"}))
    cfg = parse_args(["--config", str(f), "--steps", "9", "--offload-optimizer"])
    assert (cfg.steps, cfg.G_inter, cfg.dtype, cfg.offload_optimizer) == (9, 2, "bf16", True)
    with pytest.raises(ValueError, match="--dtype 'fp8'"):
        parse_args(["--dtype", "fp8"])
    with pytest.raises(ValueError, match="need --checkpoint-dir"):
        parse_args(["--stop-after", "3"])
    f.write_text(json.dumps({"stepz": 1}))
    with pytest.raises(ValueError, match="unknown option 'stepz'"):
        parse_args(["--config", str(f)])
    # 0 had made every wait of the pipeline fail at once while the others hung
    with pytest.raises(ValueError, match="--timeout is 0.0; expected >= 0.001"):
        parse_args(["--timeout", "0"])
    with pytest.raises(ValueError, match="--seed is -3; expected >= 0"):
        parse_args(["--seed", "-3"])
    # backend names: a typo was a traceback about mcrdl.init() once the ranks had started
    for argv, option in ((["--backends", "mpi,foo"], "--backends"),
                         (["--p2p-backend", "foo"], "--p2p-backend"),
                         (["--axis-backends", "z=foo"], "--axis-backends")):
        with pytest.raises(ValueError, match=f"{option} .*unknown backend 'foo'; mcrdl's"):
            parse_args(argv)
    assert parse_args(["--backends", "mpi,gloo", "--axis-backends", "z=pccl", "--G-z", "2"])
    # values that trained on, or failed only at the first save, or as raw tracebacks
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv, message in (
            (["--lr", "-1"], "--lr is -1.0; expected > 0"),
            (["--lr", "nan"], "--lr is nan; expected a finite number"),
            (["--grad-clip", "inf"], "--grad-clip is inf; expected a finite number"),
            (["--bucket-mib", "0"], "--bucket-mib is 0.0; expected > 0"),
            (["--min-lr", "0.5"], "--min-lr 0.5 is above --lr 0.001"),
            (["--weight-decay", "-0.1"], "--weight-decay is -0.1; expected >= 0"),
            (["--out-dir", str(afile)], f"--out-dir {afile} is a file; expected a directory"),
            (["--checkpoint-dir", str(afile / "ck")], f"is inside the file {afile}"),
            (["--metrics", str(tmp_path)], f"--metrics: {tmp_path} is a directory"),
            (["--init-from", str(tmp_path / "nope.pt")], "--init-from .*nope.pt: no such file")):
        with pytest.raises(ValueError, match=message):
            parse_args(argv)
    # a fine-tuning rate below the default --min-lr: no decay, not an error
    assert parse_args(["--lr", "5e-5"]).optim().min_lr == 5e-5
    assert parse_args([]).optim().min_lr == 1e-4
    # nothing goes to --out-dir with --metrics and --no-plot: not checked
    assert parse_args(["--out-dir", str(afile), "--metrics", str(tmp_path / "m.jsonl"),
                       "--no-plot"])


def _trainer_probe(tmp_path, body: str):
    """Run `body` in a fresh one-rank gloo world with Trainer, TrainConfig, torch and
    ``cfg(**options)`` (a 2-step tiny run writing under `tmp_path`) at hand; it leaves
    its result in ``rows`` (JSON), which this returns."""
    from ._launch import RESULT_MARK, fresh_probe
    return fresh_probe(f"""
import json, sys
sys.path.insert(0, {ROOT!r})
import torch
import mcrdl
from training.train_gpt import TrainConfig
from training.pipeline.trainer import Trainer
mcrdl.init(["gloo"])
def cfg(**kw):
    return TrainConfig(model="tiny", steps=2, micro_batch_size=2, global_batch_size=4,
                       plot=False, progress=False, quiet=True, out_dir={str(tmp_path)!r}, **kw)
{body}
mcrdl.finalize()
print({RESULT_MARK!r} + json.dumps(rows))
""")


def test_dtype_has_one_spelling_parser_in_every_command(tmp_path, capsys):
    """fp32/bf16/fp16 and torch's float32/bfloat16/float16 are accepted by every training
    command, from the command line and from a --config file; a run records the short
    name (checkpoints compare it)."""
    from training.parallel4d.perf_model.__main__ import parser
    from training.ted.cost_model import main as ted_cost_model
    from training.train_gpt import parse_args
    from training.train_moe import parse_args as parse_moe_args
    assert parse_args(["--dtype", "bfloat16"]).dtype == "bf16"
    assert parse_moe_args(["--dtype", "float32"]).dtype == "fp32"
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"dtype": "float16"}))
    assert parse_args(["--config", str(f)]).dtype == "fp16"
    with pytest.raises(ValueError, match=r"--dtype 'half': expected one of fp32 \(float32\)"):
        parse_args(["--dtype", "half"])
    for spelling in ("bf16", "bfloat16"):
        args = parser().parse_args(["--model", "tiny", "--ranks", "4", "--dtype", spelling])
        assert args.dtype == "bf16"
    from training.plan.__main__ import parser as plan_parser
    for spelling, short in (("bfloat16", "bf16"), ("float32", "fp32"), ("fp32", "fp32")):
        args = plan_parser().parse_args(["--model", "gpt-20b", "--world-size", "32",
                                         "--network", "perlmutter", "--dtype", spelling])
        assert args.dtype == short
    assert ted_cost_model(["--model", "moe-tiny", "--experts", "4", "--ranks", "8",
                           "--router-group-tokens", "16", "--dtype", "float32"]) == 0
    assert ", fp32, " in capsys.readouterr().out


@pytest.mark.parametrize("module", ["training.checkpoint", "training.perf_model",
                                    "training.parallel4d.perf_model", "training.ted_model",
                                    "training.ted.cost_model"])
def test_documented_commands_start(module):
    """The commands the docs name run from their module paths (training.perf_model and
    training.ted_model are the engines' model commands under their documented names)."""
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                       text=True, timeout=120, env=_env(), cwd=ROOT)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr


def test_init_from_a_serial_state_dict(tmp_path):
    """--init-from: each pipeline stage takes its units from a serial state_dict (another
    seed's here), bit for bit; a file of another model or kind is refused by name, on
    every rank, before training (CheckpointError: exit 3)."""
    script = f"""
from training.core.checkpoint import CheckpointError
from training.models.gpt import GPTStage
c = cfg()
tr = Trainer(c)
full = GPTStage(tr.model_cfg, 0, tr.model_cfg.n_units - 1, seed=99).state_dict()
torch.save(full, {str(tmp_path / "w.pt")!r})
mine = tr.model_stage.state_dict()
before = sum(not torch.equal(v, full[k]) for k, v in mine.items())
got = Trainer(cfg(init_from={str(tmp_path / "w.pt")!r})).model_stage.state_dict()
same = sorted(k for k, v in got.items() if torch.equal(v, full[k]))
errors = []
for name, obj in (("small", {{k: v[..., :1] for k, v in full.items()}}),
                  ("shard", {{"model": full, "step": 3}}),
                  ("extra", {{**full, "units.99.w": torch.zeros(1)}})):
    torch.save(obj, {str(tmp_path)!r} + f"/{{name}}.pt")
    try:
        Trainer(cfg(init_from={str(tmp_path)!r} + f"/{{name}}.pt"))
        errors.append(None)
    except CheckpointError as e:
        errors.append(str(e))
rows = [len(mine), before, same == sorted(mine), errors]
"""
    n, before, same, errors = _trainer_probe(tmp_path, script)
    assert n > 10 and before > 0 and same, (n, before, same)  # another seed, then its copy
    small, shard, extra = errors
    assert small and "does not fit this run's model" in small and "this model's" in small
    assert shard and "is not a state_dict (names to tensors) but a dict of 'model', 'step'" \
        in shard, shard
    assert extra and "has names this model lacks: units.99.w" in extra, extra


def test_consolidate_masters_of_a_bf16_run(tmp_path):
    """consolidate --masters: a bf16 run's fp32 master weights (OffloadedAdamW's) instead of
    its bf16 model, bit for bit, which --init-from then starts an fp32 run from, or a bf16
    run whose masters keep them whole; refused by name where no masters are kept apart
    (an fp32 run)."""
    script = f"""
from training import checkpoint as checkpoint_tool
from training.core import checkpoint as ckpt
tr = Trainer(cfg(dtype="bf16", checkpoint_dir={str(tmp_path / "bf16")!r}))
for _ in range(2):
    tr.train_step()
path = tr.save_checkpoint()
names = [n for n, _ in tr.model_stage.named_parameters()]
name_of = {{id(p): n for n, p in tr.model_stage.named_parameters()}}
opt = tr.optimizer
kept = {{name_of[id(p)]: opt.master[off:off + p.numel()].clone()
        for p, off in zip(opt.params, opt.offsets)}}
model, _ = checkpoint_tool.consolidate(path)
masters, _ = checkpoint_tool.consolidate(path, masters=True)
rows = [sorted({{str(t.dtype) for t in model.values()}}),
        sorted({{str(t.dtype) for t in masters.values()}}),
        all(torch.equal(masters[n].reshape(-1), kept[n]) for n in names),
        sum(not torch.equal(masters[n].bfloat16(), model[n]) for n in names)]
torch.save(masters, {str(tmp_path / "m.pt")!r})
fp32 = Trainer(cfg(init_from={str(tmp_path / "m.pt")!r}, checkpoint_dir={str(tmp_path / "fp32")!r}))
rows.append(all(torch.equal(p, masters[n]) for n, p in fp32.model_stage.named_parameters()))
# a bf16 run from them: its model rounds them, its masters keep them whole
b = Trainer(cfg(dtype="bf16", init_from={str(tmp_path / "m.pt")!r}))
of_b = {{id(p): n for n, p in b.model_stage.named_parameters()}}
rows.append(all(torch.equal(b.optimizer.master[off:off + p.numel()],
                            masters[of_b[id(p)]].reshape(-1))
                and torch.equal(p, masters[of_b[id(p)]].bfloat16())
                for p, off in zip(b.optimizer.params, b.optimizer.offsets)))
try:
    checkpoint_tool.consolidate(fp32.save_checkpoint(), masters=True)
    rows.append(None)
except ckpt.CheckpointError as e:
    rows.append(str(e))
"""
    model, masters, equal, rounded_apart, loaded, bf16_kept, refused = _trainer_probe(
        tmp_path, script)
    assert model == ["torch.bfloat16"] and masters == ["torch.float32"], (model, masters)
    assert equal and rounded_apart == 0 and loaded, (equal, rounded_apart, loaded)
    assert bf16_kept  # its masters had been the rounded weights
    assert refused and "--masters: its optimizer (DataParallelAdamW) keeps no" in refused


def test_resume_refuses_another_dtype(tmp_path):
    """The optimizer's state differs by dtype under one class (OffloadedAdamW: bf16's fp32
    masters, fp16's loss scale, which a bf16 checkpoint's disabled scaler reset to 1)."""
    from training.core import checkpoint as ckpt
    manifest = {"train_config": {"dtype": "bf16"}}
    ckpt.check_dtype(manifest, tmp_path, "bf16")
    with pytest.raises(ckpt.CheckpointError,
                       match="written with --dtype bf16, this run has --dtype fp16"):
        ckpt.check_dtype(manifest, tmp_path, "fp16")


def test_offloaded_adamw_matches_torch():
    """Bucketed, host-side AdamW == torch.optim.AdamW (no communication, one rank)."""
    from training.core.optim import OffloadedAdamW, OptimConfig

    from .training.reference import assert_steps_like_torch, twin_models
    a, b = twin_models()
    oc = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0, bucket_mib=1e-5, coarsening=2)
    ours = OffloadedAdamW(a.parameters(), oc)
    assert len(ours.buckets) > 2
    assert_steps_like_torch(a, b, ours, oc)


@pytest.fixture
def plain_process(monkeypatch):
    """No launcher's variables: mcrdl.launch.detect() sees a plain process (rank 0 of 1),
    even where the tests themselves run under one."""
    without_launcher(monkeypatch)
    return monkeypatch


def test_command_exit_codes(capsys, plain_process):
    """training.core.runner.run_command: 0 trained, 2 bad options or layout, 3 unusable
    checkpoint, one line on stderr; other errors propagate."""
    from training.core.checkpoint import CheckpointError
    from training.core.runner import run_command
    from training.core.topology import GridError

    def parse(argv):
        if argv == ["bad"]:
            raise ValueError("--steps 'x': expected an integer")
        return argv[0]

    def run(what):
        raise {"grid": GridError("grid (3,1,1,1) cannot run"), "ckpt": CheckpointError(
            "manifest.json is damaged"), "bug": KeyError("bug")}.get(what, ValueError("v"))

    kw = {"layout_errors": (GridError,), "layout_errors_agree": True}
    assert run_command(parse, lambda cfg: None, ["ok"], **kw) == 0
    assert run_command(parse, run, ["bad"], **kw) == 2
    assert "error: --steps 'x'" in capsys.readouterr().err
    assert run_command(parse, run, ["grid"], **kw) == 2
    assert capsys.readouterr().err == "error: grid (3,1,1,1) cannot run\n"
    assert run_command(parse, run, ["ckpt"], **kw) == 3
    assert capsys.readouterr().err == "error (rank ?): manifest.json is damaged\n"
    agreed = CheckpointError("(rank 1) shard 1 is truncated")
    agreed.agreed = True  # raise_together's: every rank has it, one reports it

    def run_agreed(what):
        raise agreed
    assert run_command(parse, run_agreed, ["x"], **kw) == 3
    assert capsys.readouterr().err == "error: (rank 1) shard 1 is truncated\n"
    agreed.reporter = False  # another rank of the run reports it
    assert run_command(parse, run_agreed, ["x"], **kw) == 3
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError):  # not a layout error of this command
        run_command(parse, run, ["other"], **kw)
    with pytest.raises(KeyError):
        run_command(parse, run, ["bug"], **kw)
    assert run_command(parse, run, ["other"], layout_errors=(ValueError,),
                       layout_errors_agree=False) == 2
    assert capsys.readouterr().err.endswith("error (rank ?): v\n")


def test_option_errors_printed_once_per_job(capsys, plain_process, tmp_path):
    """A refused command line, before mcrdl starts: an error that follows from the
    command line (argparse's, a bad value) is printed by the launch's rank 0 alone, every
    rank exiting 2; one about a path (this node's file system) by every rank, named.
    --help is printed by rank 0 alone, every rank exiting 0."""
    from training.core.options import parse_args
    from training.core.runner import run_command
    from training.train_gpt import TrainConfig

    def parse(argv):
        return parse_args(TrainConfig, argv, prog="train_gpt")

    kw = {"layout_errors": (), "layout_errors_agree": True}
    monkeypatch = plain_process
    bad_key, bad_value = tmp_path / "key.json", tmp_path / "value.toml"
    bad_key.write_text('{"stepz": 3}')
    bad_value.write_text("lr = -1.0\n")
    # this node's copy of a --config file: every rank reports what it read
    from_files = ((["--config", str(bad_key)], "unknown option 'stepz'"),
                  (["--config", str(bad_value)], "--lr is -1.0; expected > 0"),
                  (["--config", str(tmp_path)], "Is a directory"))
    cases = ((["--bogus"], "usage: train_gpt [-h]", "train_gpt: error: unrecognized "
              "arguments: --bogus\n"),
             (["--steps", "x"], "usage: train_gpt", "argument --steps: invalid int value"),
             (["--lr", "-1"], "error: --lr is -1.0; expected > 0", None))
    for rank in ("0", "1"):
        monkeypatch.setenv("PMI_RANK", rank)
        monkeypatch.setenv("PMI_SIZE", "2")
        for argv, first, last in cases:
            assert run_command(parse, lambda cfg: None, argv, **kw) == 2
            err = capsys.readouterr().err
            if rank == "1":
                assert err == "", (argv, err)
                continue
            assert err.startswith(first) and err.count("error") == 1, (argv, err)
            assert last is None or last in err, (argv, err)
        for argv, message in from_files:
            assert run_command(parse, lambda cfg: None, argv, **kw) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error (rank {rank}): ") and message in err, (argv, err)
            assert err.count("\n") == 1, err
        with pytest.raises(SystemExit) as stop:  # --help: printed once, every rank exits 0
            parse(["--help"])
        assert stop.value.code == 0
        out = capsys.readouterr().out
        assert (out == "") if rank == "1" else out.startswith("usage: train_gpt [-h]"), out
        missing = "/nonexistent/w.pt"
        assert run_command(parse, lambda cfg: None, ["--init-from", missing], **kw) == 2
        assert capsys.readouterr().err == (f"error (rank {rank}): --init-from {missing}: no "
                                           "such file; expected a serial state_dict (.pt) "
                                           "or hf:DIR\n")
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.delenv("PMI_SIZE")  # a plain process: no rank named
    assert run_command(parse, lambda cfg: None, ["--config", "/nonexistent.toml"], **kw) == 2
    assert capsys.readouterr().err == "error: --config /nonexistent.toml: no such file\n"


def test_lr_schedule_and_decay_groups_against_hand_values():
    """The schedule and the decay groups the serial references share with the engines,
    checked against values worked out by hand (a wrong warmup or decay, or biases in the
    decay group, would pass every parity run)."""
    import math

    from training.core.optim import OptimConfig, param_groups

    oc = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=12)
    # warmup: (step + 1) / 4; cosine from step 4 (ratio 0) to 12 (ratio 1); then min_lr
    want = {0: 0.25, 3: 1.0, 4: 1.0, 8: 0.55, 11: 0.1 + 0.45 * (1 + math.cos(7 * math.pi / 8)),
            12: 0.1, 100: 0.1}
    for step, lr in want.items():
        assert oc.lr_at(step) == pytest.approx(lr, abs=1e-12), step
    lin, norm, emb = torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Embedding(5, 4)
    model = torch.nn.ModuleList([lin, norm, emb])
    decay, rest = param_groups(model.parameters(), 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(lin.weight), id(emb.weight)}
    assert {id(p) for p in rest["params"]} == {id(lin.bias), id(norm.weight), id(norm.bias)}
