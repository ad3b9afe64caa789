"""The serial Llama and Hugging Face checkpoints in and out (training/models/{llama,hf}.py).

Tiny random LlamaForCausalLM and GPT2LMHeadModel models are made locally by transformers
(from a config, nothing downloaded) and saved with save_pretrained; load_hf must give
their logits and losses on the same token windows within 1e-5 (relative, float32),
export_hf must give a directory from_pretrained loads to the same logits, and an import
followed by an export must give back the original tensors bit for bit.
"""

import json
import os

import pytest
import torch

from training.models import gpt, hf, llama
from training.models.gpt import GPTStage, lm_loss
from training.models.hf import HFCheckpoint, HFConfigError, export_hf, load_hf
from training.models.llama import LlamaStage

from ._launch import import_or_skip

transformers = import_or_skip("transformers")
safetensors_torch = import_or_skip("safetensors.torch")

VOCAB, T, B = 96, 16, 3
TOL = 1e-5


def llama_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def gpt2_config(**overrides):
    kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
              activation_function="gelu")
    kw.update(overrides)
    return transformers.GPT2Config(**kw)


MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(llama_config()),
    # Llama 3.1's rotary scaling (original context shorter than T so that every
    # frequency band is hit) and an LM head tied to the embedding
    "llama3-tied": lambda: transformers.LlamaForCausalLM(llama_config(
        tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
        rope_theta=50.0)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2_config()),
    # GPT-2's own activation, the tanh approximation (GPTConfig.activation "gelu_tanh")
    "gpt2-new": lambda: transformers.GPT2LMHeadModel(gpt2_config(
        activation_function="gelu_new")),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def hf_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    model = MODELS[request.param]().eval()
    with torch.no_grad():  # norms away from one, so that their weights are checked too
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


def windows():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (B, T + 1), generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_logits_and_loss(model, w):
    with torch.no_grad():
        out = model(input_ids=w, labels=w)
    return out.logits[:, :T], out.loss


def test_logits_and_loss_match_transformers(hf_dir):
    path, hf = hf_dir
    model = load_hf(path).eval()
    assert isinstance(model, LlamaStage if "llama" in path.name else GPTStage)
    w = windows()
    ref_logits, ref_loss = hf_logits_and_loss(hf, w)
    with torch.no_grad():
        logits = model(w[:, :T])
        loss = lm_loss(logits, w[:, 1:].contiguous())
    print(f"{path.name}: logits rel {rel(logits, ref_logits):.2e}, "
          f"loss rel {rel(loss, ref_loss):.2e}")
    assert rel(logits, ref_logits) <= TOL
    assert rel(loss, ref_loss) <= TOL


def test_export_loads_in_transformers(hf_dir, tmp_path):
    path, hf = hf_dir
    export_hf(load_hf(path), tmp_path, source=path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(hf)
    w = windows()
    ref_logits, ref_loss = hf_logits_and_loss(hf, w)
    logits, loss = hf_logits_and_loss(back, w)
    assert rel(logits, ref_logits) <= TOL and rel(loss, ref_loss) <= TOL
    assert os.path.isfile(tmp_path / "generation_config.json")


def test_import_export_is_bitwise(hf_dir, tmp_path):
    path, _ = hf_dir
    export_hf(load_hf(path), tmp_path, source=path)
    before = safetensors_torch.load_file(path / "model.safetensors")
    after = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name


def test_select_reads_only_the_slice(hf_dir):
    """The per-tensor hook: rows 8..16 of every matrix (columns of GPT-2's transposed
    Conv1D weights in the file), nothing of the rest."""
    path, _ = hf_dir
    with HFCheckpoint(path) as ckpt:
        full = ckpt.state_dict()
        part = ckpt.state_dict(lambda name, shape: (slice(8, 16), slice(None))
                               if len(shape) == 2 else None)
    assert part and all(t.dim() == 2 for t in part.values())
    for name, t in part.items():
        assert torch.equal(t, full[name][8:16]), name


def test_sharded_checkpoint_and_missing_shard(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) > 1
    w = windows()
    with torch.no_grad():
        assert rel(load_hf(tmp_path)(w[:, :T]), hf_logits_and_loss(hf, w)[0]) <= TOL
    os.remove(tmp_path / shards[-1])
    with pytest.raises(FileNotFoundError, match=f"shard {shards[-1]} is missing"):
        load_hf(tmp_path)


def test_unknown_architecture_names_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(HFConfigError, match="'BertForMaskedLM' is not supported; supported: "
                       "LlamaForCausalLM, GPT2LMHeadModel"):
        load_hf(tmp_path)


@pytest.mark.parametrize("model, field", [
    (lambda: transformers.GPT2LMHeadModel(gpt2_config(activation_function="relu")),
     "activation_function"),
    (lambda: transformers.LlamaForCausalLM(llama_config(attention_bias=True)),
     "attention_bias"),
])
def test_unrepresentable_config_names_the_field(tmp_path, model, field):
    model().save_pretrained(tmp_path)
    with pytest.raises(HFConfigError, match=f"{field}=.* cannot be represented"):
        load_hf(tmp_path)


@pytest.mark.parametrize("name", ["tiny", "mini", "tinyllama-1.1b", "llama3-8b"])
def test_presets_count_what_transformers_builds(name):
    """n_params() of each preset equals the parameter count of the LlamaForCausalLM its
    exported config builds (on the meta device: no memory), so the config conversion
    keeps every shape."""
    cfg = llama.get_config(name)
    hf_cfg = transformers.LlamaConfig(**hf._llama_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params()
    assert hf._llama_from_hf(hf_cfg.to_dict()) == cfg
    assert llama.LlamaConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg


def test_stages_compose_to_the_whole_model():
    """Units built alone carry the whole model's weights; stages run one after another
    give its logits; activation checkpointing changes neither logits nor gradients."""
    cfg = llama.get_config("tiny", vocab_size=VOCAB)
    whole = llama.Llama(cfg, seed=3)
    cut = 2
    stages = [llama.LlamaStage(cfg, 0, cut, seed=3),
              llama.LlamaStage(cfg, cut + 1, cfg.n_units - 1, seed=3)]
    x = windows()[:, :T]
    y = whole(x)
    assert torch.equal(stages[1](stages[0](x)), y)
    ckpt = llama.Llama(cfg, seed=3, activation_checkpointing=True)
    y2 = ckpt(x)
    assert torch.equal(y2, y)
    y.square().mean().backward()
    y2.square().mean().backward()
    for (name, p), q in zip(whole.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_tied_embeddings_keep_embedding_and_head_together():
    cfg = llama.get_config("tiny", tie_embeddings=True)
    whole = llama.Llama(cfg)
    head = whole.units[str(cfg.n_units - 1)]
    assert head.lm_head.weight is whole.units["0"].embed_tokens.weight
    assert cfg.n_params() == sum(p.numel() for p in whole.parameters())
    with pytest.raises(ValueError, match="keep them on one stage or untie them"):
        llama.LlamaStage(cfg, 0, 2)


def test_bfloat16_checkpoint_round_trip(tmp_path):
    """Published checkpoints are bfloat16: they load as a bfloat16 model and export back
    bit for bit, with the dtype in config.json."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(
        tmp_path / "in")
    model = load_hf(tmp_path / "in")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    export_hf(model, tmp_path / "out", source=tmp_path / "in")
    before = safetensors_torch.load_file(tmp_path / "in" / "model.safetensors")
    after = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[n], t) and after[n].dtype == t.dtype for n, t in before.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_our_models_export_to_transformers(arch, tmp_path):
    """A model of ours (untied GPT head, GQA Llama) written from its state_dict, as a
    consolidated checkpoint would be, loads in transformers with our logits."""
    if arch == "gpt":
        cfg = gpt.get_config("tiny", vocab_size=VOCAB)
        model = gpt.GPT(cfg, seed=5)
    else:
        cfg = llama.get_config("tiny", vocab_size=VOCAB)
        model = llama.Llama(cfg, seed=5)
    hf.export_state_dict(cfg, model.state_dict(), tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = windows()[:, :T]
    with torch.no_grad():
        assert rel(back(input_ids=x).logits, model(x)) <= TOL
    with pytest.raises(KeyError, match="lacks units.0"):
        hf.export_state_dict(cfg, {}, tmp_path)


def test_config_checks_name_the_field(tmp_path):
    """A missing field and a shape our Llama refuses (kv heads not dividing the heads)."""
    cfg = {**llama_config().to_dict(), "architectures": ["LlamaForCausalLM"]}
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError, match="field 'intermediate_size' of a LlamaForCausalLM "
                       "config is missing"):
        load_hf(tmp_path)
    cfg = {**llama_config(num_key_value_heads=3).to_dict(),
           "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError, match="n_head=4 is not a multiple of n_kv_head=3"):
        load_hf(tmp_path)
