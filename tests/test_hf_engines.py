"""Hugging Face checkpoints in and out of the engines (issue 50): --init-from hf:DIR's
shape and read (training/models/families.py, init_source.py), the pipeline engine's
import, evaluation, checkpoint and export (tests/training/check_hf_engines.py, one
4-rank launch), ``python -m training.checkpoint export-hf`` and their errors.

Tiny random models are made locally by transformers (nothing downloaded): a
LlamaForCausalLM with 4 heads and 2 key/value heads, and a GPT2LMHeadModel with GPT-2's
own tanh-approximated GELU (``activation_function: "gelu_new"``), both of
vocabulary 256 so that the byte corpus is their data.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training.core import checkpoint as ckpt
from training.models import families
from training.models.gpt import GPTConfig

from ._launch import import_or_skip, mpiexec_or_skip, pythonpath, run_launcher

transformers = import_or_skip("transformers")
import_or_skip("safetensors")

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 16


def _env(**kw):
    return dict(os.environ, MCRDL_TIMEOUT="120", PYTHONPATH=pythonpath(ROOT), **kw)


def llama(**overrides):
    kw = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))


def gpt2(**overrides):
    kw = dict(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=T,
              activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


def save(model, path: Path, **kw) -> Path:
    torch.manual_seed(0)
    with torch.no_grad():  # norms and biases away from their initial values
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, **kw)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(1)
    dirs = {"llama": save(llama(), root / "llama"), "gpt2": save(gpt2(), root / "gpt2")}
    # a tokenizer beside the llama's weights: export-hf carries it over
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
        str(dirs["llama"] / "tokenizer.json"))
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    torch.manual_seed(2)
    return str(save(mixtral(), tmp_path_factory.mktemp("hf") / "mixtral"))


@pytest.fixture
def world_of_one():
    """mcrdl on this process alone (read_init is collective), finalized after."""
    import mcrdl
    if mcrdl.is_initialized():
        yield
        return
    mcrdl.init(["gloo"])
    try:
        yield
    finally:
        mcrdl.finalize()


def options(init_from, **kw):
    base = dict(arch="gpt", model="tiny", n_layer=None, n_head=None, n_embd=None,
                block_size=None, n_kv_head=None, init_from=init_from, data="stdlib",
                vocab_size=None)
    base.update(kw)
    return SimpleNamespace(**base, model_error=lambda e: str(e))


# ------------------------------------------------------------------ the pipeline engine

def test_engines_import_evaluate_train_export(hf_dirs, mixtral_dir):
    """check_hf_engines.py on 4 ranks: import on pipeline 2x2 evaluates to transformers'
    loss within 1e-5; export at step 0 is bitwise; after 3 steps, resumed (also at
    G_data 1) and exported, transformers' loss equals our evaluation within 1e-5; the
    same through the 4D engine (G_x 2, G_data 2); TED checkpoints of a Mixtral export
    bitwise (at step 0: the imported tensors; after 3 steps: the checkpoint's); a tied
    Llama through SAMO's compressed checkpoints, resume and export; a
    4-stage import's peak RSS growth per rank stays within 1.5 x its share."""
    out = run_launcher([mpiexec_or_skip(), "-n", "4", sys.executable,
                        os.path.join(HERE, "check_hf_engines.py")],
                       env=_env(HF_MODELS=json.dumps(hf_dirs), HF_MIXTRAL=mixtral_dir,
                                HF_T=str(T)), timeout=500)
    assert "hf pipeline OK: gpt2, llama" in out, out
    # each rank's peak RSS grows by one tensor in flight, not by its share or the model
    assert re.search(r"hf import memory OK: peak growth <= (\S+) x", out), out
    for name in ("gpt2", "llama"):
        m = re.search(rf"hf pipeline {name}: import \S+ vs transformers \S+ \(rel (\S+)\); "
                      r"export at step 0 bitwise \((\d+) tensors\).*exported in "
                      r"transformers \S+ \(rel (\S+)\)", out)
        assert m, out
        assert float(m.group(1)) <= 1e-5 and float(m.group(3)) <= 1e-5, m.group(0)
    for name in ("gpt2", "llama"):  # the 4D engine's checkpoints export too
        m = re.search(rf"hf 4d {name}: import \S+ vs transformers \S+ \(rel (\S+)\); "
                      r"export at step 0 bitwise \((\d+) tensors\).*exported in "
                      r"transformers \S+ \(rel (\S+)\)", out)
        assert m and float(m.group(1)) <= 1e-5 and float(m.group(3)) <= 1e-5, out
    assert re.search(r"hf ted mixtral: export at step 0 bitwise \(\d+ tensors\); after 3 "
                     r"steps the export holds the checkpoint's \d+ tensors bitwise", out), out
    assert re.search(r"hf tied llama SAMO G_data 4: .*exported tied", out), out
    assert re.search(r"hf pipeline llama: .*carried over: generation_config.json, "
                     r"tokenizer.json", out), out


# ------------------------------------------------------------------ shape from config.json

def test_shape_comes_from_config_json(hf_dirs):
    cfg = families.model_shape(options(f"hf:{hf_dirs['llama']}", block_size=T), 256)
    assert (type(cfg).__name__, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd,
            cfg.block_size, cfg.vocab_size) == ("LlamaConfig", 2, 4, 2, 32, T, 256)
    gpt = families.model_shape(options(f"hf:{hf_dirs['gpt2']}"), 256)
    assert gpt == GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=256,
                            activation="gelu_tanh")


@pytest.mark.parametrize("given, words", [
    ({"arch": "llama"}, ["--arch llama", "--arch gpt"]),
    ({"n_layer": 3}, ["--n-layer 3", "n_layer 2"]),
    ({"model": "small"}, ["--model small"]),
    ({"block_size": 8}, ["--block-size 8", "block_size 16", "position table"]),
    ({"n_kv_head": 2}, ["--n-kv-head", "does not apply"]),
])
def test_disagreeing_options_name_both(hf_dirs, given, words):
    with pytest.raises(ValueError) as e:
        families.model_shape(options(f"hf:{hf_dirs['gpt2']}", **given), 256)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_vocabulary_and_unknown_architecture(hf_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"vocabulary \(300 tokens\) exceeds .* 256"):
        families.model_shape(options(f"hf:{hf_dirs['llama']}", data="d", vocab_size=300), 300)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError) as e:
        families.model_shape(options(f"hf:{bert}"), 256)
    assert "BertForMaskedLM" in str(e.value)
    for name in ("LlamaForCausalLM", "GPT2LMHeadModel"):
        assert name in str(e.value), str(e.value)


def test_tied_embeddings_refuse_a_pipeline(tmp_path):
    from training.train_gpt import parse_args
    d = save(llama(tie_word_embeddings=True), tmp_path / "tied")
    with pytest.raises(ValueError, match=r"--G-inter 2: the model ties its LM head"):
        parse_args(["--init-from", f"hf:{d}", "--block-size", str(T), "--G-inter", "2"])
    parse_args(["--init-from", f"hf:{d}", "--block-size", str(T), "--G-data", "2"])


def test_mixtral_is_train_moe_s(tmp_path):
    """A MixtralForCausalLM directory gives the mixtral family's shape; train_gpt, whose
    engines build no MoE, refuses it naming train_moe."""
    from training.train_gpt import parse_args
    d = save(mixtral(), tmp_path / "mixtral")
    cfg = families.model_shape(options(f"hf:{d}"), 256)
    assert families.family_of(cfg).name == "mixtral" and cfg.n_kv_head == 2
    with pytest.raises(ValueError, match=r"mixtral model.*python -m training.train_moe"):
        parse_args(["--init-from", f"hf:{d}", "--block-size", str(T)])


# ------------------------------------------------------------------ the init source

def test_source_reads_slices_and_checks_the_template(hf_dirs, world_of_one):
    from training.models.init_source import read_init
    from training.models.llama import LlamaStage

    cfg = families.model_shape(options(f"hf:{hf_dirs['llama']}", block_size=T), 256)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dirs["llama"])
    with read_init(f"hf:{hf_dirs['llama']}",
                   lambda: LlamaStage(cfg, 0, cfg.n_units - 1)) as source:
        part = source.part("units.2.self_attn.k_proj.weight", (slice(8, 16), slice(None)))
        assert torch.equal(part, hf.model.layers[1].self_attn.k_proj.weight[8:16])
        stage = LlamaStage(cfg, 1, 1)
        source.load_into(stage)
        assert torch.equal(stage.units["1"].mlp.down_proj.weight,
                           hf.model.layers[0].mlp.down_proj.weight)
    from dataclasses import replace
    with pytest.raises(ckpt.CheckpointError, match=r"lacks units\.3\.") as e:
        read_init(f"hf:{hf_dirs['llama']}",
                  lambda: LlamaStage(replace(cfg, n_layer=3), 0, 4)).close()
    assert "--init-from" in str(e.value)


@pytest.mark.parametrize("name", ["gpt2", "llama-bf16"])
def test_source_reads_what_safetensors_reads(hf_dirs, tmp_path, name):
    """The source's own reader (os.pread of the rows, no memory map) gives, for whole
    tensors and for row, column and strided slices, what safetensors' slices give
    through hf.HFCheckpoint (GPT-2's Conv1D weights transposed; bfloat16 as stored)."""
    from training.models.hf import HFCheckpoint
    from training.models.init_source import open_source

    d = hf_dirs["gpt2"] if name == "gpt2" else str(save(llama().to(torch.bfloat16),
                                                         tmp_path / name))
    cuts = [None, lambda n: (slice(1, n - 1),), lambda n: (slice(None), slice(2, 7)),
            lambda n: (slice(0, n, 3), slice(1, None, 2))]
    with HFCheckpoint(d) as ref:
        with torch.device("meta"):
            template = ref.architecture.stage(ref.config, 0, ref.config.n_units - 1)
        source = open_source(f"hf:{d}", template)
    with source, HFCheckpoint(d) as ref:
        for cut in cuts:
            def index(shape, cut=cut):
                return None if cut is None else cut(shape[0])[:len(shape)]
            want = ref.state_dict(lambda n, shape: index(shape) or
                                  tuple(slice(None) for _ in shape))
            got = source.parts({n: index(source.shape(n)) for n in source.names()})
            assert sorted(got) == sorted(want)
            for n, t in want.items():
                assert got[n].dtype == t.dtype and torch.equal(got[n], t), (n, cut)
                assert got[n].is_contiguous()


def test_missing_shard_is_named(tmp_path, world_of_one):
    from training.models.init_source import read_init
    from training.models.llama import LlamaStage

    d = save(llama(), tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    cfg = families.model_shape(options(f"hf:{d}", block_size=T), 256)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(shards[-1].name)):
        read_init(f"hf:{d}", lambda: LlamaStage(cfg, 0, cfg.n_units - 1))


# ------------------------------------------------------------------ manifests and export-hf

def test_manifests_without_arch_are_gpt():
    gpt = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8)
    assert families.config_from_dict(gpt.as_dict()) == gpt
    manifest = {"grid": {"G_inter": 1}, "partition": [[0, 3]], "model": gpt.as_dict(),
                "optimizer": "DataParallelAdamW"}
    ckpt.check_resumable(manifest, Path("ck"), n_stages=1, partition=[(0, 3)],
                         model=families.describe(gpt), optimizer="DataParallelAdamW")


def test_export_hf_errors(tmp_path):
    cmd = [sys.executable, "-m", "training.checkpoint", "export-hf"]
    r = subprocess.run([*cmd, str(tmp_path), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2 and "no manifest.json" in r.stderr, r.stderr
    # train_moe's GShard MoE GPT: no Hugging Face equivalent, named
    from training import checkpoint as tool
    step = tmp_path / "step_000001"
    step.mkdir()
    (step / "manifest.json").write_text(json.dumps({
        "format": ckpt.FORMAT, "engine": "ted", "step": 1, "shards": []}))
    original = tool.CONSOLIDATE["ted"]
    tool.CONSOLIDATE["ted"] = lambda d, m, masters: (
        {}, {"model": GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8).as_dict(),
             "moe": {"experts": 2}})
    try:
        with pytest.raises(ckpt.CheckpointError, match=r"no Hugging Face equivalent.*"
                           r"LlamaForCausalLM"):
            tool.export_hf(step, tmp_path / "moe-out")
    finally:
        tool.CONSOLIDATE["ted"] = original
    assert not (tmp_path / "moe-out").exists()
