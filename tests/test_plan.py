"""The layout planner (training/plan): deterministic ranking, the memory filter, the
memory model against real modules, the paper's validation shapes, and its errors.
Single process, no communication: seconds."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from training.core.optim import storage_bytes
from training.core.sharding import split_of
from training.models.gpt import CONFIGS, GPTConfig, GPTStage, lm_loss
from training.models.gpt import Block as GPTBlock
from training.models.llama import CONFIGS as LLAMAS
from training.models.llama import Block as LlamaBlock
from training.models.llama import LlamaStage
from training.parallel4d.model import GPT4D
from training.parallel4d.perf_model import Grid4D, TrainingStep, constraint_violations, grids
from training.pipeline.engine import partition
from training.plan import (
    PlanError,
    Problem,
    explain_infeasible,
    grid_params,
    load_machine,
    parse_bytes,
    pipeline_memory,
    plan,
    shipped,
    stage_params,
)
from training.plan.__main__ import main
from training.plan.memory import block_activations
from training.tensor_parallel.comm import TensorComms

PERLMUTTER = load_machine("perlmutter")


def _problem(model="gpt-20b", world=32, **kw) -> Problem:
    kw.setdefault("memory_per_gpu", PERLMUTTER.memory_per_gpu)
    return Problem(CONFIGS[model], world, 4, machine=PERLMUTTER,
                   peak_flops=PERLMUTTER.peak_flops, **kw)


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith(("#", "rank"))]


def test_ranking_is_deterministic_and_sorted():
    first, again = plan(_problem()), plan(_problem())
    assert [c.label for c in first.ranked] == [c.label for c in again.ranked]
    keys = [c.sort_key() for c in first.ranked]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)  # the key breaks every tie
    times = [c.step_seconds for c in first.ranked]
    assert times == sorted(times)
    assert _cli("--model", "gpt-20b", "--world-size", "32", "--network", "perlmutter") \
        == _cli("--model", "gpt-20b", "--world-size", "32", "--network", "perlmutter")


def test_layout_over_the_memory_is_excluded_with_its_reason():
    best = plan(_problem()).ranked[0]
    tight = plan(_problem(memory_per_gpu=best.memory["total"] - 1))
    assert best.label not in [c.label for c in tight.ranked]
    reason = next(r for r in tight.rejected if r.label == best.label)
    assert reason.constraint == "memory" and reason.memory == best.memory["total"]
    assert "GiB per GPU" in reason.message
    assert all(c.memory["total"] <= best.memory["total"] - 1 for c in tight.ranked)


@pytest.mark.parametrize("stages,dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_pipeline_memory_matches_the_stage_modules(stages, dtype):
    """Parameter and gradient bytes of every stage as the engine builds it (GPTStage over
    partition's units), measured as storage after a backward pass."""
    cfg = dataclasses.replace(CONFIGS["tiny"], n_layer=5)
    w = 2 if dtype == torch.bfloat16 else 4
    predicted = stage_params(cfg, stages)
    for (first, last), params in zip(partition(cfg.n_layer, stages), predicted, strict=True):
        stage = GPTStage(cfg, first, last).to(dtype)
        x = torch.randint(cfg.vocab_size, (2, cfg.block_size)) if first == 0 \
            else torch.randn(2, cfg.block_size, cfg.n_embd, dtype=dtype)
        y = stage(x)
        (lm_loss(y, torch.zeros(2, cfg.block_size, dtype=torch.long))
         if last == cfg.n_units - 1 else y.float().square().mean()).backward()
        assert storage_bytes(stage.parameters()) == w * params
        assert storage_bytes(p.grad for p in stage.parameters()) == w * params
    assert sum(predicted) == sum(p.numel() for p in GPTStage(cfg, 0, cfg.n_units - 1)
                                 .parameters())
    fullest = pipeline_memory(cfg, stages, 1, 4, w)
    assert fullest["params"] == fullest["grads"] == w * max(predicted)


@pytest.mark.parametrize("bias", [True, False])
def test_grid_params_match_the_4d_engines_splits(bias):
    """Per-rank parameter elements of the 4D engine on every grid of 8 that the tiny
    model fits: the engine's GPT4D declares each parameter's Split; its block on a grid
    (``Split.block_shape``, over Z when split) is what a rank stores. At 1x1x1x1 the
    model is built for real and its storage measured."""
    _check_grid_params(dataclasses.replace(CONFIGS["tiny"], bias=bias), least_grids=6)


def _check_grid_params(cfg, least_grids: int) -> None:
    """grid_params of `cfg` against the 4D engine's declared splits on every grid of 8
    the model fits (at least `least_grids` of them), and its storage at 1x1x1x1."""
    model = GPT4D(cfg, TensorComms.single())
    splits = [split_of(p) for p in model.parameters()]
    assert all(splits)
    assert storage_bytes(model.parameters()) == 4 * grid_params(cfg, Grid4D(1, 1, 1, 1))
    step = TrainingStep(cfg, 8)
    fitted = [g for g in grids(8) if not constraint_violations(step, g)]
    assert len(fitted) >= least_grids
    for grid in fitted:
        sizes = grid.sizes()
        local = sum(math.prod(s.block_shape(sizes)) // (grid.z if s.z else 1) for s in splits)
        assert grid_params(cfg, grid) == local, grid


@pytest.mark.parametrize("stages,dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_llama_pipeline_memory_matches_the_stage_modules(stages, dtype):
    """The same for a Llama (grouped-query attention, SwiGLU, no biases), untied and,
    on one stage, tied."""
    w = 2 if dtype == torch.bfloat16 else 4
    for tied in (False, True) if stages == 1 else (False,):
        cfg = dataclasses.replace(LLAMAS["tiny"], n_layer=5, tie_embeddings=tied)
        predicted = stage_params(cfg, stages)
        for (first, last), params in zip(partition(cfg.n_layer, stages), predicted,
                                         strict=True):
            stage = LlamaStage(cfg, first, last).to(dtype)
            assert storage_bytes(stage.parameters()) == w * params, (tied, first, last)
        assert sum(predicted) == sum(p.numel() for p in
                                     LlamaStage(cfg, 0, cfg.n_units - 1).parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_states_match_the_memory_model(dtype):
    """The optimizer bytes the planner charges per parameter (memory.DEVICE_STATES on
    the device, HOST_STATES in host memory) against the states the engines' optimizers
    hold after a step, counted as storage: fp32 trains with DataParallelAdamW (two fp32
    moments), bf16 with OffloadedAdamW (fp32 master and moments)."""
    from training.core.optim import DataParallelAdamW, OffloadedAdamW, OptimConfig
    from training.plan.memory import DEVICE_STATES, HOST_STATES
    from training.samo.optimizer import dense_state_bytes

    cfg = dataclasses.replace(CONFIGS["tiny"], n_layer=2)
    w = 2 if dtype == torch.bfloat16 else 4
    stage = GPTStage(cfg, 0, cfg.n_units - 1).to(dtype)
    params = sum(stage_params(cfg, 1))
    opt = (OffloadedAdamW if dtype == torch.bfloat16 else DataParallelAdamW)(
        stage.parameters(), OptimConfig())
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size))
    lm_loss(stage(x), x).backward()
    opt.step()
    measured = dense_state_bytes(opt)
    if dtype == torch.float32:
        assert measured["exp_avg + exp_avg_sq"] == DEVICE_STATES[w] * params
        assert HOST_STATES[w] == 0
    else:
        host = measured["theta32"] + measured["exp_avg"] + measured["exp_avg_sq"]
        assert host == HOST_STATES[w] * params and DEVICE_STATES[w] == 0
    memory = pipeline_memory(cfg, 1, 1, 1, w)
    assert memory["optimizer"] == DEVICE_STATES[w] * params
    assert memory["host"] == HOST_STATES[w] * params


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward of ``module(x)``, each storage
    once, the module's parameters left out (they are the states, not activations)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["gpt", "gpt-nobias", "llama"])
def test_block_activations_are_what_autograd_saves(arch, dtype):
    """memory.block_activations against the saved tensors of one block of each family,
    for two shapes (the width, heads, sequence and batch all vary)."""
    w = 2 if dtype == torch.bfloat16 else 4
    shapes = [dict(n_head=2, n_embd=32, block_size=16), dict(n_head=4, n_embd=48, block_size=24)]
    for shape, batch in zip(shapes, (2, 3), strict=True):
        if arch == "llama":
            cfg = dataclasses.replace(LLAMAS["tiny"], **shape, n_kv_head=shape["n_head"] // 2,
                                      head_dim=None, intermediate_size=shape["n_embd"] * 3)
            block = LlamaBlock(cfg)
        else:
            cfg = GPTConfig(n_layer=1, vocab_size=64, bias=arch == "gpt", **shape)
            block = GPTBlock(cfg)
        x = torch.randn(batch, cfg.block_size, cfg.n_embd, dtype=dtype, requires_grad=True)
        assert _saved_bytes(block.to(dtype), x) == block_activations(cfg, batch, w), shape


def test_llama_grid_params_match_the_4d_engines_splits():
    """grid_params of a Llama against the splits the 4D engine declares (as the GPT's)."""
    _check_grid_params(LLAMAS["tiny"], least_grids=4)


def test_llama_and_mixtral_shapes_plan():
    """llama-3-70b (the publication's spelling) at a training sequence length: 4D and
    pipeline layouts, the kv-head rule dropping G_x that do not divide 8; a tied Llama
    on one stage only; Mixtral's TED layouts."""
    rc, out, err = _cli("--model", "llama-3-70b", "--sequence-length", "4096", "--world-size",
                        "64", "--network", "alps", "--top", "10")
    assert rc == 0, err
    assert "llama: n_kv_head 8, intermediate 28672" in out and "sequence 4096" in out
    assert len(_rows(out)) == 10 and "kv heads" in out
    result = plan(Problem(dataclasses.replace(LLAMAS["llama3-70b"], block_size=4096), 64, 4,
                          load_machine("alps").memory_per_gpu, load_machine("alps"),
                          load_machine("alps").peak_flops))
    assert all(c.degrees[0] in (1, 2, 4, 8) for c in result.ranked if c.engine == "4d")
    tied = dataclasses.replace(LLAMAS["mini"], tie_embeddings=True)
    result = plan(Problem(tied, 4, 4, 2**40, PERLMUTTER, PERLMUTTER.peak_flops))
    assert {c.degrees for c in result.ranked if c.engine == "pipeline"} == {(1, 4)}
    assert result.reasons()["tied"] > 0
    rc, out, err = _cli("--model", "mixtral-8x7b", "--sequence-length", "4096",
                        "--world-size", "64", "--network", "alps")
    assert rc == 0, err
    assert _rows(out) and all(" TED " in f" {r} " for r in _rows(out))
    rc, _, err = _cli("--model", "llama-4-1t", "--world-size", "8", "--network", "alps")
    assert rc == 2 and "unknown shape" in err and "llama-3-70b" in err


def test_pipeline_memory_without_biases():
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, bias=False)
    whole = GPTStage(cfg, 0, cfg.n_units - 1)
    assert stage_params(cfg, 1) == [sum(p.numel() for p in whole.parameters())]


@pytest.mark.parametrize("model,world", [("gpt-20b", 32), ("gpt-40b", 64)])
def test_paper_validation_shapes_print_a_top_10(model, world):
    result = plan(_problem(model, world))
    assert len(result.ranked) >= 10
    assert all(c.memory["total"] <= PERLMUTTER.memory_per_gpu for c in result.ranked)
    assert result.reasons()["memory"] > 0  # the filter has work to do at this size
    rc, out, err = _cli("--model", model, "--world-size", str(world), "--network",
                        "perlmutter", "--top", "10")
    assert rc == 0, err
    rows = _rows(out)
    assert len(rows) == 10
    assert [r.split()[0] for r in rows] == [str(i) for i in range(1, 11)]
    assert [r[6:40].strip() for r in rows] == [c.label for c in result.ranked[:10]]


def test_no_feasible_layout_names_memory_and_the_fix():
    result = plan(_problem(memory_per_gpu=2**30))
    assert not result.ranked
    text = explain_infeasible(result)
    assert "tightest constraint is memory" in text and "at least" in text
    least = min(r.memory for r in result.rejected if r.constraint == "memory")
    assert f"{least / 2**30:.1f} GiB" in text
    rc, out, err = _cli("--model", "gpt-20b", "--world-size", "32", "--network", "perlmutter",
                        "--memory-per-gpu", "1GiB")
    assert rc == 2 and "tightest constraint is memory" in err and not _rows(out)


def test_no_feasible_layout_names_a_divisibility_constraint(tmp_path):
    """One block, one head, width 7: no G_x or G_y > 1, no pipeline, and a batch of 2
    that 4 data shards cannot split: every layout of 4 GPUs breaks a rule."""
    model = tmp_path / "odd.json"
    model.write_text(json.dumps({"n_layer": 1, "n_head": 1, "n_embd": 7, "block_size": 8,
                                 "vocab_size": 7}))
    rc, out, err = _cli("--model", str(model), "--world-size", "4", "--network", "perlmutter",
                        "--batch", "2")
    assert rc == 2 and not _rows(out)
    assert "tightest constraint is batch (4 of 13 layouts; all: batch 4, heads 4, width 3, " \
           "layers 2)" in err
    assert "multiple of the world size" in err


def test_moe_models_plan_ted_layouts():
    rc, out, err = _cli("--model", "moe-1.3b", "--experts", "16", "--world-size", "32",
                        "--network", "perlmutter", "--memory-per-gpu", "40GB")
    assert rc == 0, err
    rows = _rows(out)
    assert rows and all(" TED " in f" {r} " for r in rows)
    rc, _, err = _cli("--model", "moe-1.3b", "--world-size", "8", "--network", "perlmutter")
    assert rc == 2 and "--experts" in err


def test_networks_are_shipped_with_sources():
    assert {"perlmutter", "frontier", "alps"} <= set(shipped())
    for name in ("perlmutter", "frontier", "alps"):
        m = load_machine(name)
        assert m.sources and m.gpus_per_node and m.memory_per_gpu and m.peak_flops
        assert m.bandwidth["inter_node"] == 100e9  # 4 x 25 GB/s Slingshot NICs
    assert load_machine("frontier").gpus_per_node == 8  # GCDs
    pairs = load_machine("5,100:10,25")
    assert pairs.latency == {"intra_node": 5e-6, "inter_node": 1e-5}
    assert pairs.bandwidth == {"intra_node": 100e9, "inter_node": 25e9}
    for bad in ("5,100", "x,1:2,3", "5,0:1,1", "nope.json"):
        with pytest.raises(PlanError, match="--network"):
            load_machine(bad)
    rc, _, err = _cli("--model", "gpt-20b", "--world-size", "32", "--network", "frontier",
                      "--gpus-per-node", "4")
    assert rc == 2 and "8 GPUs per node" in err


def test_parse_bytes():
    assert parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("40GB") == 40e9
    assert parse_bytes("512") == 512
    for bad in ("", "GiB", "-1GiB", "lots"):
        with pytest.raises(ValueError, match="memory"):
            parse_bytes(bad)
