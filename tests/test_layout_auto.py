"""--layout auto, --layout-trials and model flop/s (training/plan/auto.py,
training/core/flops.py): the option rules and the FLOP counts in process, the choice,
trials, resume and the records in one 4-rank launch (tests/training/check_layout_auto.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

from training import train_gpt, train_moe
from training.core.flops import matmul_weights, model_flops_per_token
from training.models.families import family
from training.models.moe import MoEConfig
from training.plan.auto import degree_options_of
from training.plan.planner import Candidate

from ._launch import mpiexec_or_skip, pythonpath, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layout_auto_refuses_given_degrees_and_lone_trials():
    with pytest.raises(ValueError, match=r"--layout auto chooses the degrees itself; drop "
                                         r"--G-inter 2"):
        train_gpt.parse_args(["--layout", "auto", "--G-inter", "2"], world_size=2)
    with pytest.raises(ValueError, match="--layout auto chooses the degrees itself; drop "
                                         "--G-expert 2"):
        train_moe.parse_args(["--layout", "auto", "--G-expert", "2"], world_size=4)
    with pytest.raises(ValueError, match="--layout-trials needs --layout auto"):
        train_gpt.parse_args(["--layout-trials", "3"], world_size=1)
    with pytest.raises(ValueError, match="--memory-per-rank 12 parsecs"):
        train_gpt.parse_args(["--layout", "auto", "--memory-per-rank", "12 parsecs"])
    # the world's size is not checked against unset degrees
    cfg = train_gpt.parse_args(["--layout", "auto"], world_size=8)
    assert cfg.layout == "auto" and cfg.G_inter == cfg.G_data == 1


def test_degree_options_of_each_engine():
    def cand(engine, degrees):
        return Candidate(engine, degrees, "", {"total": 0.0}, 0.0, 0.0, 0.0)
    assert degree_options_of(cand("pipeline", (2, 4))) == {
        "G_inter": 2, "G_data": 4, "G_x": 1, "G_y": 1, "G_z": 1}
    assert degree_options_of(cand("4d", (2, 1, 2, 3))) == {
        "G_inter": 1, "G_x": 2, "G_y": 1, "G_z": 2, "G_data": 3}
    assert degree_options_of(cand("ted", (2, 4, 8))) == {
        "G_tensor": 2, "G_expert": 4, "G_data": 8}


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("arch,model", [("gpt", "gpt2"), ("gpt", "gpt-20b"),
                                        ("llama", "mini"), ("llama", "tinyllama-1.1b")])
def test_model_flops_count_the_models_own_matmul_weights(arch, model):
    """6 x the weights a token multiplies by: counted from the Linear layers of the
    model itself (built on the meta device), against flops.matmul_weights; for a GPT,
    Narayanan et al.'s closed form."""
    fam = family(arch)
    cfg = fam.config(model)
    with torch.device("meta"):
        whole = fam.stage(cfg, 0, cfg.n_units - 1)
    head = _linear_weights(whole.units[str(cfg.n_units - 1)])
    blocks = sum(_linear_weights(whole.units[str(i)]) for i in range(1, cfg.n_units - 1))
    assert matmul_weights(cfg) == (blocks, head)
    if arch == "gpt":
        s, h, L, v = cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.vocab_size
        narayanan = 72 * s * L * h * h * (1 + s / (6 * h) + v / (12 * L * h))
        assert model_flops_per_token(cfg) * s == pytest.approx(narayanan, rel=1e-12)


def test_moe_flops_count_top_k_experts_per_token():
    cfg = family("gpt").config("tiny")
    dense_blocks, head = matmul_weights(cfg)
    mlp = 8 * cfg.n_embd ** 2
    moe = MoEConfig(experts=8, top_k=2, moe_every=2, router_group_tokens=cfg.block_size)
    blocks, _ = matmul_weights(cfg, moe)
    assert blocks == dense_blocks + (cfg.n_layer // 2) * mlp
    top1 = MoEConfig(experts=8, top_k=1, moe_every=2, router_group_tokens=cfg.block_size)
    assert matmul_weights(cfg, top1) == (dense_blocks, head)


def test_layout_auto_trials_resume_and_records(tmp_path):
    out = run_launcher([mpiexec_or_skip(), "-n", "4", sys.executable,
                        os.path.join(HERE, "check_layout_auto.py"), str(tmp_path)],
                       env=dict(os.environ, MCRDL_TIMEOUT="120", PYTHONPATH=pythonpath(ROOT)),
                       timeout=400)
    assert "layout auto OK" in out, out
    assert "resume: G_inter=2 x G_data=2 from step 2" in out, out


def test_memory_per_rank_drops_the_layouts_that_need_more():
    """With the memory per rank between the least and the most any layout needs, the
    layouts above it are rejected for memory and never among the runnable ones; the
    unbounded first choice, when it needs more, is not chosen."""
    from training.plan import auto

    cfg = train_gpt.parse_args(["--layout", "auto", "--model", "mini", "--global-batch-size",
                                "8", "--micro-batch-size", "1"], world_size=4)
    cpu = torch.device("cpu")
    everything = auto.plan(auto._problem(cfg, 4, cpu, float(1 << 50)))
    unbounded = auto._runnable(cfg, everything, 4, ("pipeline", "4d"))
    needs = sorted(c.memory["total"] for c, _ in unbounded)
    assert needs[0] < needs[-1]
    limit = (needs[0] + needs[-1]) / 2
    result = auto.plan(auto._problem(cfg, 4, cpu, limit))
    runnable = auto._runnable(cfg, result, 4, ("pipeline", "4d"))
    assert runnable and all(c.memory["total"] <= limit for c, _ in runnable)
    dropped = {r.label for r in result.rejected if r.constraint == "memory"}
    assert dropped == {c.label for c in everything.ranked if c.memory["total"] > limit}
    first = unbounded[0][0]
    if first.memory["total"] > limit:
        assert runnable[0][0].label != first.label
