"""Mixtral (training/models/mixtral.py, train_moe --arch mixtral): parity with Hugging
Face's MixtralForCausalLM on a tiny random model made here, import and export, the
router's Mixtral gating and dropless capacity, the ignored targets of the loss, the
errors, and (one launch of 4 ranks) TED layouts against the serial model, dropless
routing across layouts and an HF import evaluated on (G_tensor 2, G_expert 2).

Tolerances: fp32 throughout. Our model and HF's run the same operations in the same
dtype; they differ in summation order only (one expert's contributions added per token
in another order, attention kernels), a few ulps of fp32 (~1e-7 relative) per layer,
so 1e-5 relative leaves two orders of magnitude while catching any real difference
(a wrong gate, a missing renormalization or a wrong rotary layout moves the loss by
1e-3 or more).
"""

import dataclasses
import json
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from ._launch import mpiexec_or_skip, pythonpath, run_launcher
from .training.synthetic import write_token_file

transformers = pytest.importorskip("transformers")

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


def tiny_hf(path, experts=4, top_k=2, seed=0, vocab=64):
    """A random MixtralForCausalLM saved in `path` (GQA: 4 heads, 2 key/value heads)."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=64, router_aux_loss_coef=0.02)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def ours_from(path, group_tokens):
    from training.models.hf import HFCheckpoint
    from training.models.mixtral import Mixtral
    with HFCheckpoint(path) as ckpt:
        moe = dataclasses.replace(ckpt.moe, router_group_tokens=group_tokens)
        model = Mixtral(ckpt.config, moe)
        model.load_state_dict(ckpt.state_dict(), strict=True)
    return model.eval()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_serial_mixtral_matches_hf(tmp_path):
    """Logits, the LM loss and the router's aux loss of our serial Mixtral equal HF's
    (dropless: HF routes without capacity); one router group holding the batch is HF's
    aux loss exactly, and smaller groups change the aux loss only, never the routing."""
    from training.models.moe import moe_loss
    hf = tiny_hf(tmp_path)
    idx = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        out = hf(x, output_router_logits=True)
        want_lm = F.cross_entropy(out.logits.reshape(-1, 64), y.reshape(-1))
        ours = ours_from(tmp_path, group_tokens=48)
        logits, stats = ours(x)
        loss, lm = moe_loss(logits, y, stats, ours.moe_cfg)
        small = ours_from(tmp_path, group_tokens=16)(x)
    assert rel(logits, out.logits) <= TOL
    assert abs(lm - want_lm) / want_lm <= TOL
    assert abs(stats.aux_loss - out.aux_loss) / out.aux_loss <= TOL
    assert abs(loss - (want_lm + 0.02 * out.aux_loss)) / loss <= TOL
    assert stats.dropped_fraction == 0.0 and stats.assigned == 2 * 48 * 2
    # the same routing; the experts' matmuls see other row counts (other blockings)
    assert rel(small[0], logits) <= TOL and small[1].aux_loss != stats.aux_loss
    # per layer: 2 choices x 48 tokens, routed and kept
    assert [int(t.sum()) for t, _ in stats.load] == [96, 96]
    assert all(torch.equal(t, k) for t, k in stats.load)


def test_export_round_trip(tmp_path):
    """import -> export gives HF's tensors bitwise; transformers loads the export and
    computes the same logits."""
    from safetensors.torch import load_file

    from training.models.hf import export_hf, load_hf
    hf = tiny_hf(tmp_path / "in")
    model = load_hf(tmp_path / "in")
    export_hf(model, tmp_path / "out", source=tmp_path / "in")
    a = load_file(tmp_path / "in" / "model.safetensors")
    b = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(back(x).logits, hf(x).logits)


def test_mixtral_gating_and_dropless_route():
    """Mixtral's gates are the softmax over the top-k logits (HF's router); dropless
    capacity is the largest expert load of a group, nothing is dropped, and the routing
    is that of any capacity at least as large."""
    from training.models.moe import route
    logits = torch.randn(3, 16, 4, generator=torch.Generator().manual_seed(2))
    r = route(logits, 2, None, "mixtral")
    top = torch.topk(logits, 2, dim=-1)
    gates = torch.softmax(top.values, dim=-1)  # over the selected logits
    assert r.kept == r.assigned == 96 and torch.equal(r.tokens, r.kept_per_expert)
    counts = F.one_hot(top.indices, 4).sum(dim=(1, 2))  # (G, E)
    assert r.capacity == int(counts.max())
    for g in range(3):
        for j in range(2):
            for s in range(16):
                e = int(top.indices[g, s, j])
                slot = (r.slot_token[g, e] == s).nonzero().item()
                torch.testing.assert_close(r.slot_weight[g, e, slot], gates[g, s, j])
    wider = route(logits, 2, r.capacity + 3, "mixtral")
    assert torch.equal(wider.slot_token[..., :r.capacity], r.slot_token)
    assert (wider.slot_token[..., r.capacity:] == -1).all()
    agreed = route(logits, 2, None, "mixtral", agree=lambda n: n + 5)  # the group's max
    assert agreed.capacity == r.capacity + 5 and agreed.kept == 96
    capped = route(logits, 2, 5, "mixtral")  # a capacity drops; the gates stay HF's
    assert capped.kept < 96 and int((capped.tokens - capped.kept_per_expert).sum()) == \
        96 - capped.kept


def test_moe_loss_ignores_minus_100():
    """Targets of -100 are out of the loss (Goldfish, padding): the mean is over the
    others, and a denominator gives the sum over a global count."""
    from training.models.moe import MoEConfig, MoEStats, moe_loss
    logits = torch.randn(2, 8, 16)
    y = torch.randint(0, 16, (2, 8))
    y[0, :5] = -100
    stats = MoEStats(torch.tensor(0.5))
    moe = MoEConfig(aux_loss_coef=0.1)
    loss, lm = moe_loss(logits, y, stats, moe)
    keep = y != -100
    want = F.cross_entropy(logits[keep], y[keep])
    torch.testing.assert_close(lm, want)
    torch.testing.assert_close(loss, want + 0.05)
    _, total = moe_loss(logits, y, stats, moe, denominator=1.0)
    torch.testing.assert_close(total, want * keep.sum())


def test_errors_name_the_constraint(tmp_path):
    """--arch mixtral's rules: kv heads and width over G_tensor, experts of an imported
    model over G_expert, options disagreeing with hf:DIR, a dense HF model."""
    from training.models.mixtral import get_config
    from training.models.moe import MoEConfig
    from training.ted.model import TEDLayout
    from training.train_moe import parse_args
    cfg = get_config("moe-tiny")
    with pytest.raises(ValueError, match="n_kv_head=2 is not divisible by G_tensor=4"):
        TEDLayout(4, 1, 1).check(dataclasses.replace(cfg, n_head=8, head_dim=None),
                                 MoEConfig(gating="mixtral", top_k=2))
    tiny_hf(tmp_path / "six", experts=6, vocab=256)
    with pytest.raises(ValueError, match=r"--init-from hf:.*experts=6 is not divisible by "
                                         r"G_expert=4"):
        parse_args(["--arch", "mixtral", "--init-from", f"hf:{tmp_path / 'six'}",
                    "--G-expert", "4", "--router-group-tokens", "16"], world_size=4)
    with pytest.raises(ValueError, match=r"--experts 8 disagrees with --init-from .*"
                                         r"\(experts 6\)"):
        parse_args(["--arch", "mixtral", "--init-from", f"hf:{tmp_path / 'six'}",
                    "--experts", "8"])
    with pytest.raises(ValueError, match=r"--n-layer 3 disagrees with --init-from"):
        parse_args(["--arch", "mixtral", "--init-from", f"hf:{tmp_path / 'six'}",
                    "--n-layer", "3"])
    cfg_ok = parse_args(["--arch", "mixtral", "--init-from", f"hf:{tmp_path / 'six'}",
                         "--G-expert", "2", "--block-size", "16", "--capacity-factor", "0"],
                        world_size=2)
    assert cfg_ok.moe_config().experts == 6 and cfg_ok.model_config().block_size == 16
    imported = parse_args(["--arch", "mixtral", "--init-from", f"hf:{tmp_path / 'six'}"])
    assert imported.moe_config().dropless  # HF routes without a capacity: so by default
    assert parse_args(["--arch", "mixtral"]).moe_config().capacity_factor == 1.25
    small = tmp_path / "small-vocab"
    tiny_hf(small)
    with pytest.raises(ValueError, match=r"vocabulary \(256 tokens\) exceeds the model's "
                                         r"\(64\)"):
        parse_args(["--arch", "mixtral", "--init-from", f"hf:{small}"])
    dense = tmp_path / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4)).save_pretrained(dense)
    with pytest.raises(ValueError, match="a LlamaForCausalLM has no experts"):
        parse_args(["--arch", "mixtral", "--init-from", f"hf:{dense}"])
    with pytest.raises(ValueError, match="--n-kv-head applies to --arch mixtral"):
        parse_args(["--n-kv-head", "2"])


def test_single_rank_engine_is_the_serial_mixtral():
    """TED on one rank holds the serial Mixtral's weights, computes its logits, aux loss
    and gradients (dropless and with a capacity, with activation checkpointing)."""
    from training.models.mixtral import Mixtral, get_config
    from training.models.moe import MoEConfig, moe_loss
    from training.ted.model import TEDGPT, TEDGroups, TEDLayout
    cfg = get_config("moe-tiny", vocab_size=64)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    for factor in (0, 0.8):
        moe = MoEConfig(experts=4, top_k=2, router_group_tokens=16, moe_every=1,
                        capacity_factor=factor, gating="mixtral")
        serial = Mixtral(cfg, moe, seed=3)
        ted = TEDGPT(cfg, moe, TEDGroups(TEDLayout(), world_size=1, rank=0), seed=3,
                     activation_checkpointing=True)
        assert set(serial.state_dict()) == set(ted.state_dict())
        assert all(torch.equal(t.reshape(-1), ted.state_dict()[k].reshape(-1))
                   for k, t in serial.state_dict().items())
        outs = []
        for m in (serial, ted):
            logits, stats = m(x)
            moe_loss(logits, x, stats, moe)[0].backward()
            outs.append((logits, stats.aux_loss, stats.dropped_fraction))
        assert outs[0][2] == outs[1][2] and (outs[0][2] > 0) == (factor > 0)
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outs[0][1], outs[1][1])
        grads = dict(ted.named_parameters())
        for name, p in serial.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad.view_as(p), rtol=1e-4,
                                       atol=1e-7)


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    return write_token_file(tmp_path_factory.mktemp("mixtral-data"), 1 << 17, seed=4)


def test_mixtral_ted_layouts(token_dir, tmp_path):
    """One launch of 4 ranks (tests/training/check_mixtral.py): six --arch mixtral
    layouts (DTD, CAC, the tiled optimizer; capacity 1.0 and dropless) train 8 steps with
    every LM and aux loss within 1e-5 of the serial Mixtral's (a Goldfish run's too);
    the dropless ones drop nothing and agree across layouts; a MixtralForCausalLM
    imported into (2, 2, 2), each rank reading only its experts, evaluates to HF's loss
    within 1e-5."""
    env = dict(os.environ, MCRDL_TIMEOUT="120", OMP_NUM_THREADS="1",
               PYTHONPATH=pythonpath(ROOT), MOE_DATA=str(token_dir))
    out = run_launcher([mpiexec_or_skip(), "-n", "4", sys.executable,
                        os.path.join(HERE, "check_mixtral.py")], env=env, timeout=600)
    m = re.search(r"mixtral parity OK: world 4, 6 runs x 8 steps, max rel diff (\S+)", out)
    assert m and float(m.group(1)) <= TOL, out
    assert out.count("mixtral parity G_tensor") == 6, out
    m = re.search(r"mixtral dropless OK: 3 layouts, nothing dropped, losses agree to (\S+)",
                  out)
    assert m and float(m.group(1)) <= TOL, out
    m = re.search(r"mixtral hf OK: .* \(rel (\S+)\)", out)
    assert m and float(m.group(1)) <= TOL, out


def test_train_moe_mixtral_entry_point(token_dir, tmp_path):
    """python -m training.train_moe --arch mixtral --capacity-factor 0 under mpiexec:
    the metrics carry each MoE layer's load (tokens and dropped per expert, max/mean)."""
    metrics = tmp_path / "m.jsonl"
    cmd = [mpiexec_or_skip(), "-n", "2", sys.executable, "-m", "training.train_moe",
           "--arch", "mixtral", "--experts", "4", "--G-expert", "2", "--steps", "2",
           "--capacity-factor", "0", "--data", str(token_dir), "--vocab-size", "256",
           "--metrics", str(metrics), "--no-plot", "--out-dir", str(tmp_path)]
    env = dict(os.environ, MCRDL_TIMEOUT="120", OMP_NUM_THREADS="1",
               PYTHONPATH=pythonpath(ROOT))
    out = run_launcher(cmd, env=env, timeout=300)
    assert "Mixtral (4 experts, top-2, dropless" in out, out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        load = row["moe_load"]
        assert [layer["unit"] for layer in load] == [1, 2]
        for layer in load:  # 8 sequences x 16 tokens x top-2, none dropped
            assert sum(layer["tokens"]) == 8 * 16 * 2 and layer["dropped"] == [0] * 4
            assert layer["max_mean"] == max(layer["tokens"]) / (sum(layer["tokens"]) / 4)
