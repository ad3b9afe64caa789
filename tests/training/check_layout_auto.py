"""--layout auto and --layout-trials in one 4-rank launch (tests/test_layout_auto.py):

1. train_gpt --layout auto: every rank trains on the planner's first runnable layout
   (computed here independently on rank 0 from the same Problem), and the metrics
   file's first record and the checkpoint's manifest hold the choice; every step record
   carries model flop/s and MFU consistent with the model's FLOPs and the step time; a
   --resume of it keeps the layout and records the earlier choice in its manifest.
2. --layout-trials 3: three distinct grids timed, the chosen one the least measured.
3. --resume with --layout auto keeps the checkpoint's layout (saved on G_inter=2 x
   G_data=2, not the planner's first choice).
4. train_moe --layout auto trains on a TED layout the planner ranked.
5. train_gpt --arch llama --layout auto: the planner's first runnable Llama layout.
Prints "layout auto OK" last on rank 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import mcrdl
from training import train_gpt, train_moe
from training.core.checkpoint import step_dir
from training.core.flops import model_flops_per_token
from training.plan import auto


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _manifest(root: str, step: int) -> dict:
    return json.loads((step_dir(root, step) / "manifest.json").read_text())


def _first_runnable(cfg, record: dict):
    """The planner's first runnable layout of `cfg` on the network and compute rate the
    job measured (its layout_choice record), computed here independently."""
    net = record["network"]
    machine = auto._one_level(net["name"], net["alpha_s"], net["bandwidth_bytes_per_s"])
    problem = auto._problem(cfg, 4, torch.device("cpu"), 1 << 40, machine,
                            (record["peak_flops"], record["peak_source"]))
    return auto._runnable(cfg, auto.plan(problem), 4, ("pipeline", "4d"))[0][1]


def main() -> None:
    tmp = Path(sys.argv[1])
    base = ["--model", "tiny", "--quiet", "--no-plot", "--no-progress",
            "--global-batch-size", "8", "--micro-batch-size", "1"]
    rank = None

    # 1. the planner's first runnable layout, and the records
    auto_ckpt = str(tmp / "auto_ckpt")
    cfg = train_gpt.parse_args([*base, "--layout", "auto", "--steps", "2", "--checkpoint-dir",
                                auto_ckpt, "--metrics", str(tmp / "auto.jsonl")], world_size=4)
    result = train_gpt.run(cfg)
    rank = mcrdl.get_rank()
    if rank == 0:
        records = _records(tmp / "auto.jsonl")
        choice = records[0]["layout_choice"]
        first = _first_runnable(cfg, choice)
        assert choice["network"]["name"] in ("this machine's tuning table",
                                             "this world's all_reduce, measured at start")
        assert choice["peak_source"] == "measured GEMM rate, every rank at once", choice
        assert choice["source"] == "model" and choice["grid"] == result.grid, (choice, result)
        assert result.grid == first.describe_grid(), (result.grid, first.describe_grid())
        flops = model_flops_per_token(cfg.model_config()) * 8 * cfg.model_config().block_size
        for r in records[1:]:
            assert abs(r["model_flops_per_s"] * r["time_s"] / flops - 1) < 1e-9, r
            assert 0 < r["mfu"] < 1, r
        assert _manifest(auto_ckpt, 2)["layout_choice"] == choice, _manifest(auto_ckpt, 2)
        print(f"auto: {result.grid} (the planner's first runnable)", flush=True)
    # ... and a resume of it keeps that layout and carries the record into its checkpoints
    cfg = train_gpt.parse_args([*base, "--layout", "auto", "--resume", "--steps", "3",
                                "--checkpoint-dir", auto_ckpt], world_size=4)
    again = train_gpt.run(cfg)
    assert again.grid == result.grid and again.start_step == 2, (again, result)
    if rank == 0:
        resumed = _manifest(auto_ckpt, 3)["layout_choice"]
        assert resumed["source"] == "checkpoint" and resumed["chosen"] == choice, resumed

    # 2. trials
    cfg = train_gpt.parse_args([*base, "--layout", "auto", "--layout-trials", "3",
                                "--layout-trial-steps", "2", "--steps", "1",
                                "--metrics", str(tmp / "trials.jsonl")], world_size=4)
    result = train_gpt.run(cfg)
    if rank == 0:
        choice = _records(tmp / "trials.jsonl")[0]["layout_choice"]
        trials = choice["trials"]
        assert choice["source"] == "trials" and len(trials) == 3, choice
        assert len({t["grid"] for t in trials}) == 3, trials
        best = min(trials, key=lambda t: t["measured_step_s"])
        assert best["grid"] == result.grid == choice["grid"], (best, result.grid)
        print(f"trials: {[t['grid'] for t in trials]} -> {result.grid}", flush=True)

    # 3. resume keeps the checkpoint's layout
    ckpt = str(tmp / "ckpt")
    cfg = train_gpt.parse_args([*base, "--G-inter", "2", "--G-data", "2", "--steps", "2",
                                "--checkpoint-dir", ckpt, "--metrics", str(tmp / "m.jsonl")],
                               world_size=4)
    train_gpt.run(cfg)
    cfg = train_gpt.parse_args([*base, "--layout", "auto", "--resume", "--steps", "3",
                                "--checkpoint-dir", ckpt, "--metrics", str(tmp / "m.jsonl")],
                               world_size=4)
    result = train_gpt.run(cfg)
    assert result.grid == "G_inter=2 x G_data=2" and result.start_step == 2, result
    if rank == 0:
        print(f"resume: {result.grid} from step {result.start_step}", flush=True)

    # 4. TED
    moe_ckpt = str(tmp / "moe_ckpt")
    cfg = train_moe.parse_args(["--quiet", "--no-plot", "--no-progress", "--steps", "1",
                                "--layout", "auto", "--metrics", str(tmp / "moe.jsonl"),
                                "--checkpoint-dir", moe_ckpt], world_size=4)
    result = train_moe.run(cfg)
    if rank == 0:
        choice = _records(tmp / "moe.jsonl")[0]["layout_choice"]
        assert set(choice["degrees"]) == {"G_tensor", "G_expert", "G_data"}, choice
        assert _manifest(moe_ckpt, 1)["layout_choice"] == choice, _manifest(moe_ckpt, 1)
        print(f"moe: {result.grid}", flush=True)

    # 5. a Llama
    cfg = train_gpt.parse_args([*base, "--arch", "llama", "--layout", "auto", "--steps", "1",
                                "--metrics", str(tmp / "llama.jsonl")], world_size=4)
    result = train_gpt.run(cfg)
    if rank == 0:
        choice = _records(tmp / "llama.jsonl")[0]["layout_choice"]
        first = _first_runnable(cfg, choice)
        assert result.grid == first.describe_grid() == choice["grid"], (result.grid, choice)
        print(f"llama: {result.grid}", flush=True)
        print("layout auto OK", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
