"""The 4D engine (issue 18, training/parallel4d): parity with serial PyTorch and exact
bytes per (op, axis) on every grid of the issue in one 8-rank launch; single-process
checks of the pieces (splits, the model built from the serial one, options, errors)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from ._launch import mpiexec_or_skip, pythonpath, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**kw):
    return dict(os.environ, MCRDL_TIMEOUT="120", PYTHONPATH=pythonpath(ROOT),
                OMP_NUM_THREADS="1", **kw)


def test_4d_grids_in_one_launch():
    """All 14 grids of the issue (both optimizers, micro-batching, --regather-weights),
    each with the GPT and with the Llama (grouped-query attention), and the Llama on
    (2,1,1,2): every step's loss of 20 steps equals the serial run to 1e-5; the logged
    calls and bytes per (op, axis) equal training.parallel4d.perf_model's on every rank;
    evaluate() on (2,1,1,2) and (1,2,2,1) equals the serial loss to 1e-5 on every rank;
    checkpoints, overlap and matmul tuning (tests/training/check_4d.py says how each is
    checked)."""
    out = run_launcher([mpiexec_or_skip(), "-n", "8", sys.executable,
                        os.path.join(HERE, "check_4d.py")], env=_env(), timeout=600)
    m = re.search(r"4d parity OK: (\d+) grids x (\d+) steps, max rel diff (\S+)", out)
    assert m, out
    assert int(m.group(1)) == 29 and int(m.group(2)) == 20 and float(m.group(3)) <= 1e-5
    assert "4d bytes OK: 29 grids" in out, out
    for grid in ("(2, 1, 1, 1)", "(1, 1, 4, 1)", "(3, 1, 1, 1)", "(2, 2, 1, 2)"):
        for shape in ("h", "l"):
            assert re.search(rf"4d parity {re.escape(grid)} {shape}[34] ", out), (grid, out)
    assert "4d parity (2, 1, 1, 2) l4" in out, out
    for grid in ("(2, 1, 1, 2)", "(1, 2, 2, 1)"):
        assert f"4d evaluate {grid} l4: 7 windows" in out, out
    # --regather-weights: the second Z gather in backward, its bytes as modelled
    assert "4d parity (1, 2, 2, 1) h4 {'regather_weights': True}" in out, out
    # resume after step 10 reproduces 11-20 exactly; consolidate gives the serial weights
    assert out.count("resumed steps 11-20 equal the uninterrupted run exactly") == 2, out
    assert out.count("in bf16 steps 11-13 to") == 2, out  # OffloadedAdamW trains bf16
    assert "4d resume on another G_data OK: (1, 1, 2, 2)'s step-10 checkpoint on " \
        "(1, 1, 2, 1)" in out, out
    # --overlap levels bitwise equal, the recorded issue/wait order proves each overlap
    assert "4d overlap OK: (2, 1, 2, 2)" in out, out
    # --tune-matmul on synthetic timings: the group-summed optimum on all ranks, parity
    assert "4d tuning OK" in out and "group-summed optimum of the synthetic" in out, out


def test_4d_layers_in_one_launch():
    """2 ranks: ParallelLayerNorm over G_y = 2 on tokens of large mean against float64
    (bf16 gave NaN), the Z gather schedule after a failed forward and with two models,
    splits the grid does not divide refused by name, a grid unlike the config's refused
    (tests/training/check_4d_layers.py)."""
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable,
                        os.path.join(HERE, "check_4d_layers.py")], env=_env(), timeout=300)
    assert "4d layers OK" in out, out
    for dtype in ("float32", "bfloat16"):
        assert f"4d layernorm {dtype} G_y=2" in out, out
    for level in ("none", "all"):
        assert f"4d gathers --overlap {level} G_z=2" in out, out


def test_4d_llama_from_hf_in_one_launch():
    """4 ranks: a Hugging Face Llama made locally imported on 4-rank grids gives the
    serial model's logits, each rank's peak resident memory growing by at most 1.5x
    its own share (the full model 4x it), and evaluate() of a run --init-from hf:DIR on
    (2,1,1,2) and (1,2,2,1) equals the serial loss (tests/training/check_4d_llama.py)."""
    pytest.importorskip("transformers")
    out = run_launcher([mpiexec_or_skip(), "-n", "4", sys.executable,
                        os.path.join(HERE, "check_4d_llama.py")], env=_env(), timeout=600)
    assert "4d llama OK" in out, out
    for grid in ("(1, 1, 4, 1)", "(1, 2, 2, 1)", "(4, 1, 1, 1)"):
        assert f"4d llama import {grid}: full model" in out, out
    for grid in ("(2, 1, 1, 2)", "(1, 2, 2, 1)"):
        assert f"4d llama evaluate {grid} --init-from hf" in out, out
    # import, 3 steps, checkpoint, consolidate, resume, export-hf, import on another grid
    assert "4d llama checkpoint OK" in out, out


# --- single process ----------------------------------------------------------------------

def test_split_round_trip():
    """Every rank's piece, reassembled, is the serial tensor (permuted rows too)."""
    from training.core.sharding import Split
    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    sizes = {"x": 3, "y": 2, "z": 2, "data": 1}
    for split in (Split((6, 8), "x", "y", True), Split((6, 8), None, "y", True),
                  Split((6, 8), "y", "x", True, perm=(5, 4, 3, 2, 1, 0))):
        sz = dict(sizes, x=2, y=3) if split.rows == "y" else sizes
        pieces = {(x, y, z): split.local(full, {"x": x, "y": y, "z": z}, sz)
                  for x in range(sz["x"]) for y in range(sz["y"]) for z in range(sz["z"])}
        assert torch.equal(split.assemble(pieces, sz), full)
    vec = torch.arange(6.0)
    bias = Split((6,), "x")
    assert torch.equal(bias.local(vec, {"x": 1, "y": 0, "z": 1}, sizes), torch.tensor([2.0, 3.0]))


def test_qkv_permutation_puts_each_ranks_heads_together():
    from training.tensor_parallel import layers
    perm = layers.qkv_head_permutation(8, 4, 2)  # head dim 2; rank 0 has heads 0, 1
    assert perm[:12] == (0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19)


def test_gpt4d_on_one_rank_is_the_serial_model():
    """Built from the serial init: same logits, same gradients (pieces = whole tensors),
    and the serial state_dict back; weight decay goes by the logical shape."""
    from training.core.optim import decays
    from training.models.gpt import GPT, GPTConfig, lm_loss
    from training.parallel4d.model import GPT4D, assemble_state_dict
    from training.tensor_parallel.comm import TensorComms
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=96)
    serial, par = GPT(cfg, seed=3), GPT4D(cfg, TensorComms.single(), seed=3)
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    lm_loss(serial(x), y).backward()
    par.loss(x, y).backward()
    par.reduce_gradients()
    grads = {n: p.grad for n, p in serial.named_parameters()}
    for name, p in par.named_parameters():
        torch.testing.assert_close(p.grad.view(grads[name].shape), grads[name], rtol=1e-5,
                                   atol=1e-7)
        assert decays(p) == (grads[name].dim() >= 2), name  # shards are 1-D
    sd = assemble_state_dict(cfg, par.splits(), par.comms.sizes(),
                             [(par.comms.coords(), par.local_pieces())])
    ref = serial.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    again = GPT4D.from_state_dict(cfg, TensorComms.single(), ref)
    assert torch.equal(again(x), par(x))


def test_llama4d_on_one_rank_is_the_serial_model():
    """The Llama on the 4D layers (RMSNorm, rotary, SwiGLU, grouped-query attention):
    the serial logits, loss (targets of -100 ignored) and gradients, the serial
    state_dict back, and built again from an init source."""
    from training.models.llama import Llama, LlamaConfig, lm_loss
    from training.parallel4d.model import GPT4D, assemble_state_dict
    from training.tensor_parallel.comm import TensorComms
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16,
                      vocab_size=96, intermediate_size=48)
    serial, par = Llama(cfg, seed=3), GPT4D(cfg, TensorComms.single(), seed=3)
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    y[0, :5] = -100
    want = lm_loss(serial(x), y)
    want.backward()
    got = par.loss(x, y)
    got.backward()
    par.reduce_gradients()
    torch.testing.assert_close(got, want)
    total, kept = par.loss_sum(x, y)
    assert kept == 27 and abs(total.item() / kept - want.item()) < 1e-6
    grads = {n: p.grad for n, p in serial.named_parameters()}
    for name, p in par.named_parameters():
        torch.testing.assert_close(p.grad.view(grads[name].shape), grads[name], rtol=1e-5,
                                   atol=1e-7)
    ref = serial.state_dict()
    sd = assemble_state_dict(cfg, par.splits(), par.comms.sizes(),
                             [(par.comms.coords(), par.local_pieces())])
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)

    class Source:  # the init source interface (training/models/init_source.py)
        def names(self):
            return list(ref)

        def shape(self, name):
            return tuple(ref[name].shape)

        def part(self, name, index=None):
            return ref[name][index].clone()

    assert torch.equal(GPT4D(cfg, TensorComms.single(), source=Source())(x), par(x))


def test_read_piece_reads_only_the_piece():
    """read_piece (a piece read from a source in rectangles) equals Split.local on
    every rank of grids with rows, columns, Z chunks across rows and permuted rows;
    every rectangle it reads lies inside the piece's (x, y) block's columns."""
    import itertools

    from training.core.sharding import Split
    from training.tensor_parallel import layers
    from training.tensor_parallel.layers import SerialPart, read_piece
    full = torch.randn(12, 8)
    reads = []
    part = SerialPart(full.shape, lambda index: (reads.append(index), full[index].clone())[1])
    grids = ({"x": 2, "y": 2, "z": 4}, {"x": 3, "y": 1, "z": 2}, {"x": 1, "y": 4, "z": 3},
             {"x": 2, "y": 1, "z": 5}, {"x": 1, "y": 2, "z": 1})
    checked = 0
    for budget in (1 << 20, 40):  # and whole rows read a row at a time
        old, layers.READ_ROWS_BYTES = layers.READ_ROWS_BYTES, budget
        try:
            for split in (Split((12, 8), "x", "y", True), Split((12, 8), None, "y", True),
                          Split((12, 8), "y", "x", True, perm=tuple(reversed(range(12)))),
                          Split((12, 8), "x", "y", True,
                                perm=layers.qkv_head_permutation(4, 2, 2)[:12]),
                          Split((12, 8), "x", "y", False)):
                for g in grids:
                    sizes = {**g, "data": 1}
                    try:
                        split.check(sizes)
                    except ValueError:
                        continue
                    for x, y, z in itertools.product(*(range(g[a]) for a in "xyz")):
                        coords = {"x": x, "y": y, "z": z, "data": 0}
                        reads.clear()
                        got = read_piece(part, split, coords, sizes)
                        assert torch.equal(got, split.local(full, coords, sizes)), split
                        width = 8 // sizes[split.cols] if split.cols else 8
                        c0 = coords[split.cols] * width if split.cols else 0
                        assert all(c0 <= i[1].start and i[1].stop <= c0 + width
                                   for i in reads), (split, reads)
                        checked += 1
        finally:
            layers.READ_ROWS_BYTES = old
    assert checked > 150


def test_4d_llama_kv_head_rule():
    """G_x must divide n_kv_head: refused by the options naming --n-kv-head and --G-x,
    by the grid check, and by the layer."""
    from training.models.llama import LlamaConfig
    from training.parallel4d.perf_model import Grid4D, TrainingStep, constraint_violations
    from training.tensor_parallel.comm import TensorComms
    from training.tensor_parallel.layers import ParallelLlamaAttention
    from training.train_gpt import parse_args
    with pytest.raises(ValueError, match=re.escape(
            "--G-x 4 with --arch llama: n_kv_head=2 is not divisible by G_x=4") + ".*"
            + re.escape("choose --G-x dividing --n-kv-head 2")):
        parse_args(["--arch", "llama", "--G-x", "4"])
    with pytest.raises(ValueError, match="--n-kv-head 1"):
        parse_args(["--arch", "llama", "--G-x", "2", "--n-kv-head", "1"])
    assert parse_args(["--arch", "llama", "--G-x", "2"]).model_config().n_kv_head == 2
    cfg = LlamaConfig(n_layer=1, n_head=8, n_kv_head=2, n_embd=32, block_size=8,
                      vocab_size=64, intermediate_size=64)
    kinds = [k for k, _ in constraint_violations(TrainingStep(cfg, 8), Grid4D(4, 1, 1, 1))]
    assert kinds == ["kv heads"], kinds
    comms = TensorComms.single()
    comms.x.size = 4  # the layer's own guard, before any weight is read
    with pytest.raises(ValueError, match="attn: n_kv_head=2 is not divisible by G_x=4"):
        ParallelLlamaAttention(lambda name: None, 8, 2, 4, torch.ones(2), comms, "attn")


def test_4d_options_and_errors():
    from training.train_gpt import TrainConfig, parse_args
    cfg = parse_args(["--G-x", "2", "--G-z", "2", "--axis-backends", "z=pccl,data=auto"])
    assert cfg.uses_4d() and cfg.backend_of_axis() == {"x": "auto", "y": "auto",
                                                       "z": "pccl", "data": "auto"}
    assert cfg.describe_grid() == "G_inter=1 x G_data=1 x G_x=2 x G_y=1 x G_z=2"
    assert TrainConfig().describe_grid() == "G_inter=1 x G_data=1"
    assert parse_args(["--G-data", "2", "--engine", "4d"]).uses_4d()
    assert not parse_args(["--G-data", "2"]).uses_4d()
    for argv, words in [
        (["--G-inter", "2", "--G-x", "2"], "--G-inter 2 (pipeline stages) with --G-x 2"),
        (["--G-z", "3"], "--global-batch-size 8 is not divisible by G_z*G_data=3*1=3"),
        (["--G-y", "2", "--engine", "pipeline"], "--engine pipeline has no tensor"),
        (["--axis-backends", "w=mpi"], "AXIS one of x, y, z, data"),
        (["--overlap", "most"], "--overlap 'most'"),
        # options the other engine reads: they had been ignored without a word
        (["--tune-matmul", "--overlap", "all"],
         "--overlap, --tune-matmul: only the 4d engine reads them, and this run uses the "
         "pipeline engine"),
        (["--G-x", "2", "--pipeline-limit", "3"],
         "--pipeline-limit: only the pipeline engine reads it"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_args(argv)


def test_4d_grid_errors_name_the_constraint(tmp_path):
    """One process asked for G_x=3 with 4 heads: the error names the world size, the
    heads and the vocabulary, exit status 2."""
    r = subprocess.run([sys.executable, "-m", "training.train_gpt", "--G-x", "3", "--n-head",
                        "4", "--steps", "1", "--global-batch-size", "6",
                        "--out-dir", str(tmp_path), "--no-plot", "--backends", "gloo"],
                       capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    for words in ("needs G_x*G_y*G_z*G_data=3 ranks but the world has 1",
                  "n_head=4 is not divisible by G_x=3", "vocab_size=256 is not divisible by G_x=3"):
        assert words in r.stderr, r.stderr


def test_fused_gradient_buckets_in_the_model():
    """The step's gradient all_reduces are fused: full buckets plus the rest, the same
    elements as one call per tensor."""
    from training.models.gpt import CONFIGS
    from training.parallel4d.perf_model import Grid4D, TrainingStep, call_counts, collectives
    cfg, grid = CONFIGS["mini"], Grid4D(1, 1, 2, 2)
    one = collectives(TrainingStep(cfg, 8, bucket_bytes=None), grid)
    total = sum(e.elements * e.count for e in one if e.axis == "data")
    assert [e.count for e in one if e.axis == "data"] == [1]
    small = call_counts(TrainingStep(cfg, 8, bucket_bytes=4000), grid)
    assert small["all_reduce", "data"] == (-(-total // 1000), total * 4)


def test_matmul_tuner_takes_the_fastest_agreed_mode(monkeypatch):
    """The injected timer decides: a mode made 8x slower is never chosen, a mode made
    8x faster always is; results of every mode agree to 1e-6; decisions come from the
    sum of every rank's timings (here two fake ranks, one of which prefers NT)."""
    from training.parallel4d import tuning
    a, b = torch.randn(24, 16), torch.randn(16, 40)
    for mode in tuning.MODES:
        torch.testing.assert_close(tuning.matmul(a, b, mode), a @ b, rtol=1e-6, atol=1e-6)

    def timer_favouring(best):
        return lambda phase, mode, fn: (fn(), 1.0 if mode == best else 8.0)[1]

    tuner = tuning.MatmulTuner(timer=timer_favouring("TN"))
    w, x, dout = torch.randn(40, 16), torch.randn(24, 16), torch.randn(24, 40)
    out = tuner.forward(x, w)
    tuner.input_grad(dout, w)
    tuner.weight_grad(dout, x)
    torch.testing.assert_close(out, x @ w.t())
    assert tuner.pending and tuner.max_mode_diff <= 1e-6
    other = {k: {m: (0.5 if m == "NT" else 9.0) for m in tuning.MODES} for k in tuner.timings}
    monkeypatch.setattr(tuning.mcrdl, "all_gather_object",
                        lambda obj, group=None: [obj, other])
    decided = tuner.agree()
    # sums: TN 1 + 9 = 10, NT 8 + 0.5 = 8.5, NN 8 + 9 = 17: NT on every rank
    assert set(decided.values()) == {"NT"} and len(decided) == 3 and not tuner.pending
    torch.testing.assert_close(tuner.forward(x, w), out, rtol=1e-6, atol=1e-6)


def test_layers_used_on_their_own():
    """The layers outside GPT4D (as another engine uses them, e.g. an MLP of N then T):
    same output and gradients as torch's Linear pair; the shard gradient arrives in
    ``weight.grad`` after ``finish_gradients``."""
    from training.tensor_parallel.comm import TensorComms
    from training.tensor_parallel.layers import ParallelLinear
    torch.manual_seed(0)
    fc, proj = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
    comms = TensorComms.single()
    n = ParallelLinear(fc.weight.data, fc.bias.data, comms, name="fc")
    t = ParallelLinear(proj.weight.data, proj.bias.data, comms, transposed=True, name="proj")
    x = torch.randn(3, 5, 8)
    ours = t(torch.nn.functional.gelu(n(x)))
    ref = proj(torch.nn.functional.gelu(fc(x)))
    torch.testing.assert_close(ours, ref)
    ours.square().sum().backward()
    ref.square().sum().backward()
    for layer in (n, t):
        layer.finish_gradients()
    torch.testing.assert_close(n.weight.grad.view(32, 8), fc.weight.grad)
    torch.testing.assert_close(t.bias.grad, proj.bias.grad)
    assert n.weight.logical_shape == (32, 8) and n.weight.dim() == 1
