"""MoE with DeepSpeed-TED (issue 19): parity of every layout with the serial MoE GPT,
exact communication bytes and call counts, memory, resume, the entry point, and
single-process checks of the router, the errors, the optimizer and the model."""

import json
import os
import re
import sys

import pytest
import torch

from ._launch import FULL, mpiexec_or_skip, pythonpath, run_launcher
from .training.check_moe import RUNS, n_experts
from .training.synthetic import write_token_file

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """A byte-level token file (vocabulary 256) of synthetic text fixed by its seed: it
    loads instantly (ByteCorpus scans the whole stdlib in every rank, seconds each) and,
    unlike this repository's sources, does not change with an edit. Seed 4: the serial
    runs of every (experts, top-k) in check_moe.py's layouts keep each top-k choice of
    their 20 steps at least 1e-6 apart in probability (tests/training/synthetic.py)."""
    return write_token_file(tmp_path_factory.mktemp("moe-data"), 1 << 19, seed=4)


def _env(**kw):
    return dict(os.environ, MCRDL_TIMEOUT="120", OMP_NUM_THREADS="1",
                PYTHONPATH=pythonpath(ROOT), **kw)


@pytest.mark.parametrize("n", [2, 4, pytest.param(8, marks=FULL)])
def test_moe_layouts(n, token_dir, tmp_path):
    """Every step's loss of 20-step fp32 runs of (G_tensor, G_expert, G_data_nonexp) in
    (1,1,2), (1,2,2), (2,1,1) [n=2], (2,2,2), (1,4,4), (1,2,4), (2,1,2) [n=4], (2,4,4)
    [n=8], top-1 and top-2, DTD (with a padded capacity too), CAC and the tiled optimizer
    on and off, one and two experts per rank of an expert group, equals the serial MoE
    GPT to 1e-5; DTD/CAC twins are bitwise equal. n=4 adds the exact-bytes, call-count,
    memory and resume checks, n=2 a rank skipping an MoE call."""
    out = run_launcher([mpiexec_or_skip(), "-n", str(n), sys.executable,
                        os.path.join(HERE, "check_moe.py")],
                       env=_env(MOE_DATA=str(token_dir), MOE_TMP=str(tmp_path)), timeout=500)
    m = re.search(r"moe parity OK: world (\d+), (\d+) runs x 20 steps, max rel diff (\S+)", out)
    assert m, out
    # every layout of the world size, in order: a dropped run fails
    want = [(str(gt), str(ge), str(gd), str(k), str(n_experts(ge, opts)))
            for gt, ge, gd, k, opts in RUNS[n]]
    ran = re.findall(r"moe parity G_tensor=(\d+) G_expert=(\d+) G_data=(\d+) top-(\d+) "
                     r"(\d+) experts", out)
    assert ran == want, f"runs {ran}, expected {want}:\n{out}"
    assert int(m.group(1)) == n and int(m.group(2)) == len(want), out
    assert float(m.group(3)) <= 1e-5, out
    if n == 2:
        assert out.count("moe parity G_tensor") == 3 and "moe skip OK" in out, out
        assert "moe G_expert=1 OK" in out, out
        assert "all_to_all_single" in out.split("moe skip OK")[1], out
    if n == 4:
        assert out.count("bitwise identical") == 2, out
        assert "(capacity 13, 14 in the buffer) {'dtd': True}" in out, out
        assert "G_tensor=1 G_expert=2 G_data=4 top-1 4 experts" in out, out
        for part in ("moe comm OK", "moe debug check OK", "moe memory OK", "moe resume OK",
                     "moe init-from OK"):
            assert part in out, out
        assert "in bf16 the fp32 masters hold the file's weights" in out, out
        assert "moe bf16 OK: 3 + 3 resumed steps == 6 steps bitwise" in out, out


def test_train_moe_entry_point(token_dir, tmp_path):
    """python -m training.train_moe under mpiexec with per-kind pinning: step lines,
    metrics with aux loss and dropped fraction, the communication breakdown per kind and
    backend, a checkpoint, and the consolidate tool giving the serial MoEGPT."""
    metrics = tmp_path / "m.jsonl"
    cmd = [mpiexec_or_skip(), "-n", "2", sys.executable, "-m", "training.train_moe",
           "--experts", "4", "--top-k", "2", "--G-expert", "2", "--steps", "4",
           "--data", str(token_dir), "--vocab-size", "256", "--router-group-tokens", "32",
           "--backends", "mpi,gloo,a2a=gloo,allreduce=mpi", "--metrics", str(metrics),
           "--out-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ck"),
           "--activation-checkpointing", "--cac", "--no-plot"]
    out = run_launcher(cmd, env=_env(), timeout=300)
    assert "G_tensor=1 x G_expert=2 x G_data_exp=1 (G_data_nonexp=2)" in out, out
    assert "collectives a2a=gloo, allreduce=mpi, allgather=auto" in out, out
    assert len(re.findall(r"^step +\d+/4 \| loss .* \| aux [\d.]+ \| dropped", out, re.M)) == 4
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["aux_loss"] > 0 and 0 <= r["dropped_fraction"] < 1 for r in recs), recs
    # per rank and step: (2 forward + 2 backward) x 2 microbatches, recomputation spared
    assert re.search(r"^all_to_all_single +gloo +2 +8\.0 ", out, re.M), out
    assert re.search(r"^all_reduce +mpi ", out, re.M), out
    from training.checkpoint import main as checkpoint_tool  # in process: torch is loaded
    assert checkpoint_tool(["consolidate", str(tmp_path / "ck"), "-o",
                            str(tmp_path / "moe.pt")]) == 0
    from training.models.families import config_from_dict
    from training.models.moe import MoEConfig, MoEGPT
    cfgs = json.loads((tmp_path / "moe.json").read_text())
    model = MoEGPT(config_from_dict(cfgs["model"]), MoEConfig(**cfgs["moe"]))
    model.load_state_dict(torch.load(tmp_path / "moe.pt"), strict=True)
    # a damaged checkpoint: the ranks refuse it together, and one of them reports it
    (tmp_path / "ck" / "step_000004" / "manifest.json").write_text("{")
    out = run_launcher(cmd + ["--resume"], env=_env(), timeout=300, expect_rc=3)
    errors = re.findall(r"^error.*$", out, re.M)
    assert len(errors) == 1 and "manifest.json is not valid JSON" in errors[0], out


# --- single process --------------------------------------------------------------------
def test_router_is_per_group_and_drops_in_order():
    from training.models.moe import expert_capacity, route
    assert expert_capacity(32, 4, 1, 1.25) == 10 and expert_capacity(40, 4, 1, 1.1) == 11
    assert expert_capacity(32, 4, 2, 0.8) == 13
    torch.manual_seed(0)
    logits = torch.randn(3, 16, 4)
    for k in (1, 2):
        whole = route(logits, k, 3)
        parts = [route(logits[g:g + 1], k, 3) for g in range(3)]  # layout independence
        assert torch.equal(whole.slot_token, torch.cat([p.slot_token for p in parts]))
        assert torch.equal(whole.slot_weight, torch.cat([p.slot_weight for p in parts]))
        assert whole.kept == sum(p.kept for p in parts)
        assert whole.kept <= 3 * 4 * 3 < whole.assigned
        for g in range(3):  # first choices keep the earliest tokens of each expert
            first = logits[g].argmax(-1)
            for e in range(4):
                want = (first == e).nonzero().flatten()[:3].tolist()
                have = [t for t in whole.slot_token[g, e].tolist() if t >= 0]
                assert have[:len(want)] == want
    r = route(logits, 2, 16)  # nothing dropped: each token's two gates sum to 1
    total = torch.zeros(3, 16).index_put_(
        (torch.arange(3).view(3, 1, 1).expand(3, 4, 16)[r.slot_token >= 0],
         r.slot_token[r.slot_token >= 0]), r.slot_weight[r.slot_token >= 0], accumulate=True)
    torch.testing.assert_close(total, torch.ones(3, 16))


def test_errors_name_the_constraint():
    from training.models.gpt import GPTConfig
    from training.models.moe import MoEConfig
    from training.ted.model import TEDLayout
    from training.train_moe import parse_args
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16)
    with pytest.raises(ValueError, match="experts=6 is not divisible by G_expert=4"):
        TEDLayout(1, 4, 4).check(cfg, MoEConfig(experts=6))
    with pytest.raises(ValueError, match="G_data_nonexp=6 is not divisible by G_expert=4"):
        TEDLayout(1, 4, 6).check(cfg, MoEConfig(experts=4))
    with pytest.raises(ValueError, match="n_head=4 is not divisible by G_tensor=3"):
        TEDLayout(3, 1, 1).check(cfg, MoEConfig())
    with pytest.raises(ValueError, match="= 4 ranks, but the world has 2"):
        TEDLayout(2, 1, 2).check(world_size=2)
    with pytest.raises(ValueError, match="--moe-every=3 with --n-layer=2: no block has experts"):
        TEDLayout(1, 2, 2).check(cfg, MoEConfig(experts=2, moe_every=3))
    with pytest.raises(ValueError, match="capacity 0.5 < 1 token"):
        parse_args(["--experts", "8", "--router-group-tokens", "4", "--capacity-factor", "1"])
    with pytest.raises(ValueError, match="--cac needs --activation-checkpointing"):
        parse_args(["--cac"])
    with pytest.raises(ValueError, match="unknown collective kind 'bcast'"):
        from training.core.backends import Backends
        Backends.parse("bcast=mpi")


def test_backends_parse():
    from training.core.backends import Backends
    b = Backends.parse("mpi, a2a=gloo,allreduce=mpi")
    assert b.init == ["mpi", "gloo"] and b.of("a2a") == "gloo" and b.of("allgather") == "auto"


def test_tiled_zero_adamw_matches_torch():
    """One rank, no communication: the tiled ZeRO-1 update (tiles cutting through
    parameters) equals torch.optim.AdamW with clipping."""
    from training.core.optim import OptimConfig
    from training.ted.autograd_collectives import Comm
    from training.ted.zero import ParamSet, ZeroAdamW

    from .training.reference import assert_steps_like_torch, twin_models
    a, b = twin_models()
    oc = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.5)
    ours = ZeroAdamW([ParamSet("all", list(a.parameters()), Comm(None), tile=4)], oc,
                     Comm(None))
    assert_steps_like_torch(a, b, ours, oc)
    assert ours.peak_temp_bytes["all"] == 16


def test_serial_moe_checkpointing_and_single_rank_engine():
    """MoEGPT with activation checkpointing computes the same; the TED engine on one rank
    holds the serial weights and computes the serial logits and gradients."""
    from training.models.gpt import GPTConfig
    from training.models.moe import MoEConfig, MoEGPT, moe_loss
    from training.ted.model import TEDGPT, TEDGroups, TEDLayout
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
    moe = MoEConfig(experts=4, top_k=2, router_group_tokens=16, moe_every=1,
                    capacity_factor=0.8)
    x = torch.randint(0, 64, (4, 16))
    serial = MoEGPT(cfg, moe, seed=3)
    ckpt = MoEGPT(cfg, moe, seed=3, activation_checkpointing=True)
    ted = TEDGPT(cfg, moe, TEDGroups(TEDLayout(), world_size=1, rank=0), seed=3)
    # the 4D layers keep a weight as its flattened (Z-shardable) block
    assert all(torch.equal(t.reshape(-1), ted.state_dict()[k].reshape(-1))
               for k, t in serial.state_dict().items())
    assert set(serial.state_dict()) == set(ted.state_dict())
    outs = []
    for m in (serial, ckpt, ted):
        logits, stats = m(x)
        moe_loss(logits, x, stats, moe)[0].backward()
        outs.append((logits, stats.aux_loss, stats.dropped_fraction))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][2] == outs[2][2] > 0
    torch.testing.assert_close(outs[0][0], outs[2][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[2][1])
    grads = dict(ted.named_parameters())
    for name, p in serial.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad.view_as(p), rtol=1e-4, atol=1e-7)


def test_ted_model_lists_layouts(capsys):
    """The memory model's command: the dissertation's 6.7B base with 32 experts on 128
    GPUs of 80 GiB, and a tiny model whose memory the multi-rank test measures."""
    from training.models.gpt import GPTConfig
    from training.models.moe import MoEConfig
    from training.ted.cost_model import eq72_bytes, main, memory_per_rank, paper_params, rank_params
    from training.ted.model import TEDLayout
    assert main(["--model", "moe-6.7b", "--experts", "32", "--ranks", "128"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d", line)]
    assert rows and all(r[-1] == "yes" for r in rows)
    assert any(r[:3] == ["4", "32", "32"] for r in rows), out  # a TED layout that fits
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=256)
    moe = MoEConfig(experts=8)
    layout = TEDLayout(2, 4, 4)
    n, approx = rank_params(cfg, moe, layout), paper_params(cfg, moe, layout)
    assert 0.9 < n["expert"] / approx["expert"] < 1.1  # Eq. 7.3-7.4 approximate the counts
    mem = memory_per_rank(cfg, moe, layout, "bf16")
    assert mem["total"] == pytest.approx(eq72_bytes(cfg, moe, layout, "bf16"), rel=1e-3)

    # DTD runs where an all_to_all carries duplicates only (ParallelMoE): none without
    # expert parallelism, whatever G_tensor (check_moe's "moe G_expert=1 OK" on the engine)
    from training.ted.cost_model import step_comm
    moe_blocks = sum(moe.is_moe(b) for b in range(cfg.n_layer))
    for lay, gathers in ((TEDLayout(2, 1, 1), 0), (TEDLayout(2, 2, 2), 4 * moe_blocks)):
        dtd, plain = (step_comm(cfg, moe, lay, micro_batch=2, dtd=d, optimizer=False)
                      for d in (True, False))
        # 2 per pass (forward, backward): dispatch and combine
        assert dtd["all_gather"]["calls"] == gathers and plain["all_gather"]["calls"] == 0
        a2a, a2a_plain = dtd["all_to_all_single"]["bytes"], plain["all_to_all_single"]["bytes"]
        assert a2a * (2 if gathers else 1) == a2a_plain, (lay, a2a, a2a_plain)


def test_tiled_optimizer_peak_memory_profiled():
    """The update's temporary memory measured by torch's allocator tracking (the
    profiler's memory events, summed in time order): the whole shard's 4 bytes per
    element untiled, 4 x tile tiled, plus at most a few bytes of scalar operands."""
    from torch.profiler import ProfilerActivity, profile

    from training.core.optim import OptimConfig
    from training.ted.autograd_collectives import Comm
    from training.ted.zero import ParamSet, ZeroAdamW
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    n = sum(p.numel() for p in model.parameters())
    for tile, want in ((None, 4 * n), (1000, 4000)):
        opt = ZeroAdamW([ParamSet("e", list(model.parameters()), Comm(None), tile=tile)],
                        OptimConfig(grad_clip=0), Comm(None))
        model(torch.randn(3, 64)).sum().backward()
        flat = opt._flat_grad(opt.sets[0])
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt._update(opt.sets[0], flat, 1.0, 1e-3)
        live = peak = 0
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            live += e.self_cpu_memory_usage
            peak = max(peak, live)
        assert opt.peak_temp_bytes["e"] == want and want <= peak <= want + 16, (peak, want)
        opt.zero_grad()


def test_aux_loss_against_hand_computation():
    """Switch's load-balancing loss, E x sum_i f_i P_i (f_i: the fraction of tokens whose
    first choice is expert i, P_i: the mean router probability of expert i), computed
    from the logits with math.exp, not torch.softmax."""
    import math

    from training.models.moe import route

    rows = [[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [1.0, 0.0]]  # first choices 0, 1, 0, 0
    probs = [[math.exp(v) / sum(math.exp(u) for u in r) for v in r] for r in rows]
    P = [sum(p[i] for p in probs) / 4 for i in range(2)]
    f = [3 / 4, 1 / 4]
    want = 2 * (f[0] * P[0] + f[1] * P[1])
    r = route(torch.tensor([rows]), top_k=1, capacity=4)
    assert float(r.aux_loss) == pytest.approx(want, rel=1e-6)
    assert r.kept == 4 and r.assigned == 4


def test_parity_data_is_fixed():
    """The MoE parity data is the same bytes on every machine and numpy release (its
    tie margin was measured on them), and top_k_margin measures what routing decides:
    a tie between the k-th and the next expert, or between the first two."""
    import hashlib

    from .training.reference import top_k_margin
    from .training.synthetic import synthetic_text

    text = synthetic_text(1 << 19, seed=4)
    assert hashlib.sha256(text).hexdigest() == (
        "c344446d53446680f86fe53479a167119e10d9a1aa4e5b7a4a1fa1e13dafe7ac")
    assert text.count(b". ") > 1000 and max(text) < 128
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.3, 0.2]]))
    assert top_k_margin(logits, 1) == pytest.approx(0.05)   # row 2: 0.3 vs 0.25
    assert top_k_margin(logits, 2) == pytest.approx(0.0, abs=1e-7)  # row 2's 2nd and 3rd
