"""The 4D communication model (issue 18): Eq. 5.1-5.7 values, the step's collectives,
feasibility, deterministic ranking and the ranking CLI."""

import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from mcrdl.tuning.provenance import SHIPPED_TABLES
from mcrdl.tuning.table import TuningTable
from training.core.topology import GridError
from training.models.gpt import CONFIGS, GPT, GPTConfig
from training.parallel4d.perf_model import (
    Collective,
    Grid4D,
    Network,
    Prediction,
    TrainingStep,
    call_counts,
    check_grid,
    collectives,
    constraint_violations,
    grids,
    linear_collectives,
    predict,
    rank_grids,
)
from training.parallel4d.perf_model.__main__ import main

from ._launch import pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# beta = 1 element per second and no latency: seconds are the paper's element volumes.
UNIT = Network(ranks_per_node=1 << 20, intra_node_bandwidth=1.0, latency=0.0)
MINI = CONFIGS["mini"]


def _layer(grid: Grid4D, transposed: bool = False) -> dict[tuple[str, str], float]:
    entries = linear_collectives("w", 1024, 4096, 2048, grid, transposed=transposed,
                                 dtype_bytes=1)
    return {(e.op, e.axis): UNIT.seconds(e, grid) for e in entries}


# -- Eq. 5.1-5.6 ------------------------------------------------------------------------

def test_layer_equations_on_the_issue_grid():
    t = _layer(Grid4D(2, 2, 2, 2))
    assert t == {("all_gather", "z"): 524288, ("reduce_scatter", "z"): 524288,
                 ("all_reduce", "y"): 2097152, ("all_reduce", "x"): 524288,
                 ("all_reduce", "data"): 524288}
    assert sum(t.values()) == 4194304


def test_n_and_t_layers_swap_x_and_y():
    assert sum(_layer(Grid4D(4, 2, 1, 1)).values()) == 3670016
    t = _layer(Grid4D(4, 2, 1, 1), transposed=True)
    assert sum(t.values()) == 6815744
    assert t == {("all_reduce", "x"): 6291456, ("all_reduce", "y"): 524288}


def test_second_gather_when_weights_are_not_kept():
    grid = Grid4D(2, 2, 2, 2)
    kept = linear_collectives("w", 1024, 4096, 2048, grid)
    again = linear_collectives("w", 1024, 4096, 2048, grid, keep_weights=False)
    extra = [e for e in again if e not in kept]
    assert [(e.op, e.axis, e.phase, e.elements) for e in extra] == \
        [("all_gather", "z", "backward", 1024 * 4096 // 4)]


# -- Eq. 5.7 ----------------------------------------------------------------------------

def test_axis_bandwidths_eq_5_7():
    net = Network(ranks_per_node=4, intra_node_bandwidth=3.0, inter_node_bandwidth=1.0)
    bw = net.axis_bandwidths(Grid4D(2, 2, 2, 2))
    assert (bw["x"], bw["y"], bw["z"], bw["data"]) == (3.0, 3.0, 0.25, 0.25)
    assert net.axis_bandwidths(Grid4D(8, 1, 1, 1))["x"] == 1.0
    assert net.axis_bandwidths(Grid4D(2, 4, 1, 1))["y"] == 0.5


def test_intra_node_table_is_keyed_by_inner_product_and_degree():
    net = Network(ranks_per_node=8, intra_node_bandwidth=3.0,
                  intra_node_table={(1, 2): 7.0, (2, 2): 5.0})
    bw = net.axis_bandwidths(Grid4D(2, 2, 2, 1))
    assert (bw["x"], bw["y"], bw["z"]) == (7.0, 5.0, 3.0)


def test_latency_term_uses_mcrdl_coefficients():
    net = Network(ranks_per_node=8, intra_node_bandwidth=1e30,
                  latency={"all_reduce": 1.0, "all_gather": 10.0, "reduce_scatter": 100.0})
    g = Grid4D(8, 1, 1, 1)
    ar = Collective("all_reduce", "x", 1, 1, 3, "forward", "t")
    ag = Collective("all_gather", "x", 1, 1, 1, "forward", "t")
    assert net.seconds(ar, g) == pytest.approx(3 * 2 * 3)  # 3 calls x 2 ceil(log2 8) steps
    assert net.seconds(ag, g) == pytest.approx(10 * 7)     # p - 1 ring steps


def test_op_rate_scales_the_bandwidth_term_of_one_op():
    g = Grid4D(1, 1, 2, 1)
    ag = Collective("all_gather", "z", 100, 1, 1, "forward", "t")
    rs = Collective("reduce_scatter", "z", 100, 1, 1, "backward", "t")
    net = Network(ranks_per_node=8, intra_node_bandwidth=1.0, latency=0.0,
                  op_rate={"all_reduce": 1.0, "all_gather": 1.0, "reduce_scatter": 0.5})
    assert net.seconds(ag, g) == 50 and net.seconds(rs, g) == 100
    assert UNIT.op_rate == {"all_reduce": 1.0, "all_gather": 1.0, "reduce_scatter": 1.0}


def test_network_from_tuning_table_takes_the_best_backend():
    table = TuningTable()
    for backend, alpha, beta in (("slow", 1e-3, 2e-9), ("fast", 1e-5, 4e-9)):
        for n in (8, 1 << 10, 1 << 20):
            table.add("all_reduce", 4, backend, n, alpha * 4 + n * beta * 1.5)
            table.add("reduce_scatter", 4, backend, n, alpha * 3 + n * 2 * beta * 0.75)
    net = Network.from_tuning_table(table, ranks_per_node=4, intra_node_bandwidth=7.0)
    assert net.latency["all_reduce"] == pytest.approx(1e-5, rel=1e-3)  # smallest alpha
    assert net.op_rate["reduce_scatter"] == pytest.approx(0.5, rel=1e-3)  # best 1/beta ratio
    assert net.latency["all_gather"] == 5e-6 and net.op_rate["all_gather"] == 1.0  # absent
    assert net.intra_node_bandwidth == 7.0


@pytest.mark.parametrize("kwargs, words", [
    ({"ranks_per_node": 0}, "ranks_per_node"),
    ({"ranks_per_node": 4, "inter_node_bandwidth": 0}, "inter_node_bandwidth"),
    ({"ranks_per_node": 4, "latency": {"all_reduce": 1e-6}}, "latency"),
    ({"ranks_per_node": 4, "latency": -1.0}, "latency"),
    ({"ranks_per_node": 4, "intra_node_table": {(0, 2): 1.0}}, "intra_node_table"),
    ({"ranks_per_node": 4, "op_rate": 0}, "op_rate"),
])
def test_network_rejects_bad_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Network(**kwargs)


# -- the step's collectives (the engine's contract) -----------------------------------

def test_megatron_grid_sends_only_megatrons_collectives():
    """(G,1,1,1) with N/T alternation: per block one forward all_reduce after each
    T-layer and one backward all_reduce before each N-layer, over X; the LM head's input
    gradient and the logits gather; nothing over Y, Z or data."""
    step = TrainingStep(MINI, batch=8)
    counts = call_counts(step, Grid4D(4, 1, 1, 1))
    t = 8 * MINI.block_size
    assert set(counts) == {("all_reduce", "x"), ("all_gather", "x"), ("all_reduce", "world")}
    assert counts["all_reduce", "x"][0] == 4 * MINI.n_layer + 1
    assert counts["all_gather", "x"] == (1, t * MINI.vocab_size * 4)
    assert counts["all_reduce", "world"] == (1, 8)


def test_fsdp_grid_gathers_and_scatters_each_weight_once():
    """(1,1,G,1): one all_gather and one reduce_scatter per weight, no activation
    collectives; the replicated parameters (biases, LayerNorm) all_reduce over Z."""
    step = TrainingStep(MINI, batch=8)
    entries = collectives(step, Grid4D(1, 1, 4, 1))
    weights = 4 * MINI.n_layer + 3  # four Linear per block, lm_head, wte, wpe
    counts = call_counts(step, Grid4D(1, 1, 4, 1))
    assert counts["all_gather", "z"][0] == weights
    assert counts["reduce_scatter", "z"][0] == weights
    assert {e.axis for e in entries} == {"z", "world"}
    replicated = MINI.n_params() - sum(e.elements * e.count for e in entries
                                       if e.op == "all_gather")
    assert sum(e.elements * e.count for e in entries if e.op == "all_reduce"
               and e.axis == "z") == replicated


def test_data_parallel_reduces_every_parameter_once():
    # Counted on the model itself: GPTConfig.n_params() counts LayerNorm biases also
    # when bias=False.
    for cfg in (MINI, replace(MINI, bias=False)):
        entries = collectives(TrainingStep(cfg, batch=8), Grid4D(1, 1, 1, 8))
        assert {e.axis for e in entries} == {"data", "world"}
        assert sum(e.elements * e.count for e in entries if e.axis == "data") == \
            sum(p.numel() for p in GPT(cfg).parameters())


#: The tensor names of the LayerNorm statistics' collectives end with these.
LN_STATS = (" mean", " variance", " mean grad", " variance grad")


def test_layer_norm_statistics_and_logits():
    step = TrainingStep(MINI, batch=8)
    grid = Grid4D(2, 2, 1, 1)
    t = 8 * MINI.block_size
    # float32 whatever the model's dtype: the mean, then the variance, and their gradients
    for dtype_bytes in (4, 2):
        stats = [e for e in collectives(replace(step, dtype_bytes=dtype_bytes), grid)
                 if e.tensor.endswith(LN_STATS)]
        assert {(e.op, e.axis, e.elements, e.dtype_bytes) for e in stats} == \
            {("all_reduce", "y", t, 4)}
        assert [(e.tensor, e.phase, e.count) for e in stats] == [
            (f"{ln} {stat}", phase, MINI.n_layer if ln != "ln_f" else 1)
            for ln in ("ln_1", "ln_2", "ln_f")
            for stat, phase in (("mean", "forward"), ("variance", "forward"),
                                ("variance grad", "backward"), ("mean grad", "backward"))]
    logits = [e for e in collectives(step, grid) if e.tensor == "logits"]
    assert [(e.op, e.axis, e.elements, e.count) for e in logits] == \
        [("all_gather", "x", t * MINI.vocab_size, 1)]


def test_micro_batches_repeat_per_pass_collectives_only():
    grid = Grid4D(2, 2, 2, 2)
    one = {(e.tensor, e.op, e.axis): e for e in collectives(TrainingStep(MINI, 16), grid)}
    four = {(e.tensor, e.op, e.axis): e
            for e in collectives(TrainingStep(MINI, 16, micro_batches=4), grid)}
    assert one.keys() == four.keys()
    for key, e in one.items():
        f = four[key]
        if e.phase in ("forward", "backward"):
            assert f.count == 4 * e.count
            per_token = key[0].endswith(("output", "input grad", *LN_STATS)) \
                or key[0] == "logits"
            assert f.elements * 4 == e.elements if per_token else f.elements == e.elements
        else:
            assert (f.count, f.elements) == (e.count, e.elements)


def test_dtype_bytes_scale_everything_but_the_scalars_and_statistics():
    grid = Grid4D(2, 2, 2, 2)
    c32 = collectives(TrainingStep(MINI, 8), grid)
    c16 = collectives(TrainingStep(MINI, 8, dtype_bytes=2), grid)
    assert [(e.tensor, e.op, e.axis, e.elements, e.count) for e in c32] == \
        [(e.tensor, e.op, e.axis, e.elements, e.count) for e in c16]
    for e32, e16 in zip(c32, c16, strict=True):
        fixed = e32.axis == "world" or e32.tensor.endswith(LN_STATS)
        assert e16.dtype_bytes == (4 if fixed else 2) and e32.dtype_bytes == 4, e32
    assert any(e.tensor.endswith(LN_STATS) for e in c32)  # G_y = 2: the statistics exist


# -- feasibility ------------------------------------------------------------------------

@pytest.mark.parametrize("grid, batch, constraint, words", [
    (Grid4D(8, 1, 1, 1), 8, "heads", "n_head=4 is not divisible by G_x=8"),
    (Grid4D(1, 3, 1, 1), 3, "width", "n_embd=128 is not divisible by G_y=3"),
    (Grid4D(1, 1, 1, 3), 8, "batch", "batch=8 sequences are not divisible by G_z*G_data"),
    (Grid4D(1, 1, 2, 2), 6, "batch", "multiple of 4"),
])
def test_infeasible_grids_name_the_constraint(grid, batch, constraint, words):
    step = TrainingStep(MINI, batch)
    found = constraint_violations(step, grid)
    assert [c for c, _ in found] == [constraint]
    assert words in found[0][1]
    with pytest.raises(GridError, match=re.escape(words)):
        check_grid(step, grid)
    # the public model refuses it too, instead of timing floor-divided sizes
    for model in (lambda: collectives(step, grid), lambda: predict(step, grid, UNIT)):
        with pytest.raises(GridError, match=re.escape(words)):
            model()


def test_vocab_and_weight_shard_constraints():
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=6, block_size=5, vocab_size=7)
    (c, msg), = constraint_violations(TrainingStep(cfg, 2), Grid4D(2, 1, 1, 1))
    assert c == "vocab" and "vocab_size=7 is not divisible by G_x=2" in msg
    (c, msg), = constraint_violations(TrainingStep(cfg, 4), Grid4D(1, 1, 4, 1))
    assert c == "weight shard" and "G_z=4" in msg and "wte.weight" in msg


def test_check_grid_names_the_world_size():
    with pytest.raises(GridError, match="needs G_x\\*G_y\\*G_z\\*G_data=4 ranks but the "
                                        "world has 8"):
        check_grid(TrainingStep(MINI, 8), Grid4D(2, 2, 1, 1), world_size=8)
    check_grid(TrainingStep(MINI, 8), Grid4D(2, 2, 2, 1), world_size=8)
    # the G_data that fits the world, where one does
    with pytest.raises(GridError, match=r"product is 8 \(with these G_x, G_y, G_z: "
                                        r"--G-data 2\)"):
        check_grid(TrainingStep(MINI, 8), Grid4D(2, 2, 1, 1), world_size=8)
    with pytest.raises(GridError) as e:
        check_grid(TrainingStep(MINI, 8), Grid4D(2, 2, 1, 1), world_size=6)
    assert "--G-data" not in str(e.value), e.value


@pytest.mark.parametrize("bad, words", [
    (lambda: Grid4D(0, 1, 1, 1), "x=0"),
    (lambda: TrainingStep(MINI, 0), "batch=0"),
    (lambda: TrainingStep(MINI, 6, micro_batches=4), "micro_batches=4"),
    (lambda: TrainingStep(MINI, 6, dtype_bytes=3), "dtype_bytes=3"),
])
def test_configurations_reject_bad_values(bad, words):
    with pytest.raises(ValueError, match=words):
        bad()


def test_grids_enumerates_every_factorisation():
    assert len(grids(8)) == 20 and len(grids(8192)) == 560 and grids(1) == [Grid4D(1, 1, 1, 1)]
    assert len(set(grids(12))) == len(grids(12)) == 40
    assert all(g.size == 12 for g in grids(12))


# -- ranking ----------------------------------------------------------------------------

def test_ranking_skips_infeasible_grids_with_reasons():
    r = rank_grids(TrainingStep(MINI, 8), 8, Network(ranks_per_node=4))
    assert len(r.ranked) + len(r.skipped) == 20
    assert [s.grid for s in r.skipped] == [Grid4D(8, 1, 1, 1)]
    assert r.skipped[0].violations[0][0] == "heads"
    times = [p.seconds for p in r.ranked]
    assert times == sorted(times)


def test_minimum_model_parallel_degree_skips_small_shardings():
    r = rank_grids(TrainingStep(MINI, 8), 8, Network(ranks_per_node=4), min_model_parallel=4)
    assert all(p.grid.x * p.grid.y * p.grid.z >= 4 for p in r.ranked)
    reasons = {s.grid: [c for c, _ in s.violations] for s in r.skipped}
    assert reasons[Grid4D(1, 1, 1, 8)] == ["model parallel"]
    assert reasons[Grid4D(8, 1, 1, 1)] == ["heads"]
    assert len(r.ranked) == len([g for g in grids(8) if g.x * g.y * g.z >= 4]) - 1


def test_ties_break_by_calls_then_grid():
    def pred(grid, seconds, calls):
        e = Collective("all_reduce", "x", 1, 4, calls, "forward", "t")
        return Prediction(grid, seconds, ((e, seconds),))
    a = pred(Grid4D(2, 1, 1, 1), 1.0, 5)
    b = pred(Grid4D(1, 2, 1, 1), 1.0 + 1e-15, 5)  # equal to 12 digits: grid decides
    c = pred(Grid4D(1, 1, 2, 1), 1.0, 3)          # fewer calls first
    d = pred(Grid4D(1, 1, 1, 2), 0.999, 9)
    assert sorted([a, b, c, d], key=Prediction.sort_key) == [d, c, b, a]


def test_ranking_is_deterministic():
    step = TrainingStep(CONFIGS["gpt-20b"], 64)
    net = Network(ranks_per_node=4)
    first = [p.grid for p in rank_grids(step, 64, net).ranked]
    assert first == [p.grid for p in rank_grids(step, 64, net).ranked]
    assert predict(step, first[0], net).seconds == rank_grids(step, 64, net).ranked[0].seconds


# -- the CLI ----------------------------------------------------------------------------

def _cli(*args: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "training.parallel4d.perf_model", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=pythonpath(ROOT)), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, time.perf_counter() - t0


def _rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]


def test_cli_ranks_gpt_20b_on_32_ranks():
    out, _ = _cli("--model", "gpt-20b", "--ranks", "32", "--ranks-per-node", "4",
                  "--table", str(SHIPPED_TABLES / "cpu-2core-mpich-gloo.json"))
    rows = _rows(out)
    assert len(rows) == 52 and "# 52 of 56 grids fit" in out and "'heads' 4" in out
    assert [int(r[0]) for r in rows] == list(range(1, 53))
    totals = [float(r[5]) for r in rows]
    assert totals == sorted(totals)
    assert all(int(r[1]) * int(r[2]) * int(r[3]) * int(r[4]) == 32 for r in rows)
    assert "alpha-beta fits of" in out and "not a measurement" in out


def test_cli_ranks_grids_of_thousands_of_ranks():
    # (its speed is no test's subject: _cli's subprocess timeout only guards a hang)
    out, _ = _cli("--model", "gpt-320b", "--ranks", "8192", "--ranks-per-node", "8",
                        "--top", "10", "--show-skipped", "--dtype", "bfloat16",
                        "--min-model-parallel", "64")
    rows = _rows(out)
    assert len(rows) == 10
    assert all(int(r[1]) * int(r[2]) * int(r[3]) >= 64 for r in rows)
    assert "#   (" in out and "'model parallel'" in out  # skipped grids with reasons


@pytest.mark.parametrize("args, option", [
    (["--model", "gpt-20b", "--ranks", "0"], "--ranks"),
    (["--model", "nope", "--ranks", "8"], "--model"),
    (["--model", "mini", "--ranks", "8", "--ranks-per-node", "x"], "--ranks-per-node"),
    (["--model", "mini", "--ranks", "8", "--latency", "-1"], "--latency"),
    (["--model", "mini", "--ranks", "8", "--table", "/nonexistent.json"], "--table"),
    (["--model", "mini", "--ranks", "8", "--batch", "6", "--micro-batches", "4"],
     "--micro-batches"),
    (["--ranks", "8"], "--model"),
    (["--model", "mini", "--ranks", "8", "--min-model-parallel", "0"], "--min-model-parallel"),
    (["--model", "mini", "--ranks", "8", "--ranks-per-node", "3"], "--ranks-per-node 3"),
])
def test_cli_bad_arguments_name_the_option(args, option, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def test_linear_layers_match_the_serial_gpt():
    """Every nn.Linear of the serial GPT is one of ``linear_layers`` with its [n, k]
    weight, counted once per block or once per model."""
    from torch import nn

    from training.parallel4d.perf_model import linear_layers

    cfg = CONFIGS["tiny"]
    found: dict[str, list[tuple[int, int]]] = {}
    for name, module in GPT(cfg).named_modules():
        if isinstance(module, nn.Linear):
            key = next(layer.name for layer in linear_layers(cfg) if name.endswith(layer.name))
            found.setdefault(key, []).append(tuple(module.weight.shape))
    layers = {layer.name: layer for layer in linear_layers(cfg)}
    assert set(found) == set(layers)
    for name, shapes in found.items():
        layer = layers[name]
        assert shapes == [(layer.n, layer.k)] * (cfg.n_layer if layer.per_block else 1), name
    # N and T alternate through a block, so no redistribution between them.
    per_block = [layer.transposed for layer in linear_layers(cfg) if layer.per_block]
    assert per_block == [False, True, False, True]


def test_matmul_modes_benchmark_measures_the_grid_blocks():
    """benchmarks/matmul_modes.py on the tiny GPT: one row per distinct (phase, m, n, k) of
    the grid's local blocks (t = tokens / G_z, N-layer k / G_y and n / G_x), every mode
    timed, the best the fastest, every mode equal to the natural one."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "matmul_modes", os.path.join(ROOT, "benchmarks", "matmul_modes.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = CONFIGS["tiny"]
    step, grid = TrainingStep(cfg, batch=4), Grid4D(2, 1, 2, 1)
    rows = bench.measure(step, grid, torch.float32, repeats=1)
    t = 4 * cfg.block_size // 2
    c, v = cfg.n_embd, cfg.vocab_size
    expected = {  # (phase, layer) -> (m, n, k) of the tuner's key
        ("forward", "attn.c_attn"): (t, 3 * c // 2, c),
        ("input_grad", "attn.c_attn"): (t, c, 3 * c // 2),
        ("weight_grad", "attn.c_attn"): (3 * c // 2, c, t),
        ("forward", "attn.c_proj"): (t, c, c // 2),  # T-layer: in-features over X
        ("forward", "mlp.c_proj"): (t, c, 4 * c // 2),
        ("forward", "lm_head"): (t, v // 2, c),
    }
    by_layer = {(r["phase"], name): r for r in rows for name in r["layers"]}
    for key, shape in expected.items():
        assert by_layer[key]["shape"] == shape, key
    assert len({(r["phase"], r["shape"]) for r in rows}) == len(rows)
    for r in rows:
        assert set(r["gflops"]) == {"NN", "NT", "TN"} and min(r["gflops"].values()) > 0
        assert r["best"] == max(r["gflops"], key=r["gflops"].get)
        assert r["max_rel_diff"] <= 1e-6
