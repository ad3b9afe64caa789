"""python -m training.evaluate: the loss of hf:DIR, .pt and checkpoint sources on a
split's windows, serially (the reference) and through the engine's trainer; and the
trainers' --eval-interval."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ._launch import clean_env, mpiexec_or_skip, run_launcher

ROOT = Path(__file__).resolve().parent.parent
VOCAB, T, W = 256, 16, 5


def _data(directory: Path) -> Path:
    """Random byte tokens (uint16, no meta.json: nanoGPT's format)."""
    directory.mkdir()
    rs = np.random.RandomState(0)
    rs.randint(0, VOCAB, 4000).astype(np.uint16).tofile(directory / "train.bin")
    rs.randint(0, VOCAB, 600).astype(np.uint16).tofile(directory / "val.bin")
    return directory


def _windows(directory: Path) -> torch.Tensor:
    v = np.fromfile(directory / "val.bin", np.uint16).astype(np.int64)
    return torch.tensor(np.stack([v[i * T:i * T + T + 1] for i in range(W)]))


def _hf_models(tmp_path):
    """Tiny random Llama (GQA: 4 heads, 2 kv heads) and GPT-2, made here."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    models = {"llama": LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=32, activation_function="gelu"))}
    for name, m in models.items():
        m.eval().save_pretrained(tmp_path / name, safe_serialization=True)
    return models


def _hf_loss(model, windows) -> float:
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             windows[:, 1:].reshape(-1)).item()


def _command(args, expect=0):
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                       env={**clean_env(), "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=300)
    assert r.returncode == expect, r.stdout + r.stderr
    return r


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_serial_loss_equals_transformers(tmp_path, capsys):
    """--serial (the reference) gives transformers' own loss on the same windows within
    1e-5 relative (fp32; the two differ in summation order only), for Llama and GPT-2;
    the engine (train_gpt's pipeline, one rank) gives the same."""
    from training.evaluate import main
    data = _data(tmp_path / "d")
    models = _hf_models(tmp_path)
    windows = _windows(data)
    for name, model in models.items():
        assert main(["--init-from", f"hf:{tmp_path / name}", "--data", str(data),
                     "--windows", str(W), "--block-size", str(T), "--serial"]) == 0
        got = _last_json(capsys.readouterr().out)
        assert got["tokens"] == W * T and got["windows"] == W
        assert got["loss"] == pytest.approx(_hf_loss(model, windows), rel=1e-5), name
    out = _command(["training.evaluate", "--init-from", f"hf:{tmp_path / 'llama'}", "--data",
                    str(data), "--windows", str(W), "--block-size", str(T)]).stdout
    assert _last_json(out)["loss"] == pytest.approx(_hf_loss(models["llama"], windows),
                                                    rel=1e-5)


def test_refusals(tmp_path, capsys):
    from training.evaluate import main
    data = _data(tmp_path / "d")
    _hf_models(tmp_path)
    assert main(["--data", str(data)]) == 2
    assert "--init-from is required" in capsys.readouterr().err
    assert main(["--init-from", f"hf:{tmp_path / 'llama'}", "--data", str(data), "--windows",
                 "99", "--block-size", str(T), "--serial"]) == 2
    assert "--windows 99: the split holds 600 tokens, 37 windows" in capsys.readouterr().err
    assert main(["--init-from", str(tmp_path / "none.pt"), "--data", str(data)]) == 2
    assert "none.pt: no such file or directory" in capsys.readouterr().err


def test_eval_interval_and_checkpoint_sources(tmp_path):
    """train_gpt --eval-interval 2: val_loss in the metrics at steps 2 and 4; the last
    equals training.evaluate on the step-4 checkpoint, serially (its shards consolidated)
    and through the engine (the checkpoint loaded as a resume), and on the consolidated
    .pt (with its .json) within 1e-6 relative."""
    data = _data(tmp_path / "d")
    ckpt, out = tmp_path / "ck", tmp_path / "run"
    _command(["training.train_gpt", "--arch", "llama", "--model", "tiny", "--n-layer", "2",
              "--block-size", str(T), "--data", str(data), "--vocab-size", str(VOCAB),
              "--steps", "4", "--eval-interval", "2", "--eval-windows", str(W),
              "--checkpoint-dir", str(ckpt), "--out-dir", str(out), "--no-plot",
              "--goldfish-k", "3"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert all(0.5 < r["goldfish_kept"] < 0.8 for r in records)
    step = next(ckpt.glob("step_*"))
    _command(["training.checkpoint", "consolidate", str(step), "-o", str(tmp_path / "m.pt")])
    base = ["--data", str(data), "--windows", str(W)]
    for source, extra in ((step, ["--serial"]), (step, []), (tmp_path / "m.pt", ["--serial"])):
        got = _last_json(_command(["training.evaluate", "--init-from", str(source), *base,
                                   *extra]).stdout)
        assert got["loss"] == pytest.approx(records[-1]["val_loss"], rel=1e-6), (source, extra)
    # --layout auto at 2 ranks: the planner's layout, the same loss
    r = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable, "-m", "training.evaluate",
                      "--init-from", str(tmp_path / "m.pt"), *base, "--layout", "auto"],
                     env={**clean_env(), "PYTHONPATH": str(ROOT)}, timeout=300)
    assert "--layout auto:" in r and "chosen (predicted fastest)" in r, r
    assert _last_json(r)["loss"] == pytest.approx(records[-1]["val_loss"], rel=1e-6), r
