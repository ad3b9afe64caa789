"""Hugging Face checkpoints through the pipeline and 4D engines, under ``mpiexec -n 4``.

``$HF_MODELS`` names (as JSON, name -> directory) tiny random models that
tests/test_hf_engines.py made with transformers and saved (LlamaForCausalLM with 4 heads
and 2 key/value heads; GPT2LMHeadModel with the exact GELU), each of vocabulary 256 (the
byte corpus) and context T. For each, on the pipeline 2 x 2 grid (G_inter 2, G_data 2):

1. ``--init-from hf:DIR``: Trainer.evaluate on W windows (W not a multiple of the
   replicas: the last microbatch padded with ignored targets) equals transformers' own
   loss on them within 1e-5 relative (float32: both sum T*W float32 log-probabilities of
   the same weights in another order; 1e-5 is ~100 ulps of the loss).
2. A checkpoint at step 0, exported (python -m training.checkpoint export-hf), holds the
   tensors of DIR bit for bit (import -> export with no step).
3. 3 training steps, a checkpoint; a trainer resumed from it evaluates to the same
   loss exactly; the exported directory loads in ``AutoModelForCausalLM.from_pretrained``
   and its loss on the windows equals that evaluation within 1e-5 relative; the
   generation config and tokenizer of DIR are carried over byte for byte.
4. The same windows on the checkpoint resumed at G_data 1 (G_inter 2 on 2 of the ranks
   beside an idle pair): the loss within 1e-5 relative (another data split).

5. The 4D engine (G_x 2, G_data 2): the same import evaluates to transformers' loss
   within 1e-5; its checkpoint at step 0, exported, is bitwise DIR; after 3 steps its
   export's loss in transformers equals Trainer4D.evaluate within 1e-5.
6. TED (train_moe --arch mixtral, G_tensor 2 x G_expert 2) from ``$HF_MIXTRAL`` (a
   MixtralForCausalLM, 4 experts, top-2): its checkpoint at step 0, exported, is bitwise
   the directory; after 3 steps the export holds the consolidated checkpoint's tensors
   bit for bit (training.models.hf.load_hf of it) and loads in transformers.
7. A Llama whose LM head is tied to its embedding (tie_word_embeddings), pruned by SAMO
   (sparsity 0.5, compressed shards store the shared matrix once) on G_data 4: a step,
   a checkpoint, a resumed trainer evaluating to the same loss, an export that
   transformers loads tied, with its loss equal to ours within 1e-5.
8. Memory of an import: a LlamaForCausalLM of ~50 MB (fp32) on 4 pipeline stages. Each
   rank's peak resident set (VmHWM, reset before through /proc/self/clear_refs) grows
   during read_init + load_into by at most 1.5 x its stage's share of the weights
   beyond the stage itself (built before, as the trainer does): the reader holds one
   tensor in flight, never the whole model.

Rank 0 prints one line per model and a final "hf pipeline OK".
"""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mcrdl  # noqa: E402
from training import checkpoint as checkpoint_tool  # noqa: E402
from training.pipeline.trainer import Trainer  # noqa: E402
from training.train_gpt import TrainConfig  # noqa: E402

W, STEPS = 5, 3
TOL = 1e-5


def hf_loss(directory: str, windows: torch.Tensor) -> float:
    """transformers' own model of `directory`: mean cross-entropy of windows[:, 1:]
    given windows[:, :-1] (float32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                              dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                           windows[:, 1:].reshape(-1)).item()


def bitwise_same(a: str, b: str) -> int:
    """The number of tensors of safetensors directories `a` and `b`, asserting they hold
    the same names with the same bits."""
    from safetensors.torch import load_file

    ta = {}
    for d, out in ((a, ta), (b, tb := {})):
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update(load_file(f))
    assert sorted(ta) == sorted(tb), (sorted(set(ta) ^ set(tb)))
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    return len(ta)


def memory_kib(field: str) -> int:
    """/proc/self/status's `field` (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def import_memory(root: Path) -> None:
    """Check 5: each rank's peak RSS growth while its stage of a 4-stage pipeline reads
    its units from an hf: directory, against the stage's share."""
    from training.models.families import family_of, model_shape
    from training.models.init_source import read_init
    from training.pipeline.engine import partition

    rank = mcrdl.get_rank()
    directory = root / "memory"
    if rank == 0:
        import transformers
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
            tie_word_embeddings=False)).save_pretrained(directory)
    mcrdl.barrier("auto")
    cfg = TrainConfig(init_from=f"hf:{directory}", G_inter=4, block_size=64)
    mcfg = model_shape(cfg, 256)
    fam = family_of(mcfg)
    first, last = partition(mcfg.n_layer, 4)[rank]
    stage = fam.stage(mcfg, first, last)
    share = sum(t.numel() * t.element_size() for t in stage.state_dict().values())
    whole = mcfg.n_params() * 4
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = memory_kib("VmRSS")
    with read_init(cfg.init_from, lambda: fam.stage(mcfg, 0, mcfg.n_units - 1)) as source:
        source.load_into(stage)
    grew = (memory_kib("VmHWM") - before) * 1024
    rows = mcrdl.all_gather_object((rank, first, last, share, grew))
    if rank == 0:
        for r, a, b, sh, g in rows:
            print(f"hf import memory rank {r} (units {a}..{b}): share {sh / 2**20:.1f} MiB, "
                  f"peak RSS growth {g / 2**20:.1f} MiB = {g / sh:.2f} x share "
                  f"(whole model {whole / 2**20:.1f} MiB)", flush=True)
        worst = max(g / sh for _, _, _, sh, g in rows)
        assert worst <= 1.5, rows
        print(f"hf import memory OK: peak growth <= {worst:.2f} x each stage's share",
              flush=True)


def four_d(name: str, directory: str, opts: dict, windows: torch.Tensor, root: Path) -> None:
    """Check 5: import, export at step 0, 3 steps and export through the 4D engine."""
    from training.parallel4d.trainer import Trainer4D

    cfg = TrainConfig(**opts, checkpoint_dir=str(root))
    cfg.validate()
    trainer = Trainer4D(cfg)
    imported = trainer.evaluate(windows)
    step0 = trainer.save_checkpoint()
    for _ in range(STEPS):
        trainer.train_step()
    trained = trainer.evaluate(windows)
    step3 = trainer.save_checkpoint()
    if mcrdl.get_rank() == 0:
        ref = hf_loss(directory, windows)
        assert rel(imported, ref) <= TOL, (name, imported, ref)
        checkpoint_tool.export_hf(step0, root / "hf0")
        n = bitwise_same(directory, root / "hf0")
        checkpoint_tool.export_hf(step3, root / "hf3")
        exported = hf_loss(str(root / "hf3"), windows)
        assert rel(exported, trained) <= TOL, (name, exported, trained)
        print(f"hf 4d {name}: import {imported:.6f} vs transformers {ref:.6f} (rel "
              f"{rel(imported, ref):.1e}); export at step 0 bitwise ({n} tensors); after "
              f"{STEPS} steps {trained:.6f}, exported in transformers {exported:.6f} (rel "
              f"{rel(exported, trained):.1e})", flush=True)
    mcrdl.barrier("auto")


def ted(directory: str, windows: torch.Tensor, root: Path) -> None:
    """Check 6: export-hf of TED checkpoints of a Mixtral."""
    from training.models.hf import load_hf
    from training.ted.options import MoETrainConfig
    from training.ted.trainer import MoETrainer

    cfg = MoETrainConfig(init_from=f"hf:{directory}", arch="mixtral",
                         block_size=windows.size(1) - 1, micro_batch_size=1,
                         global_batch_size=4, steps=STEPS, G_tensor=2, G_expert=2, seed=5,
                         lr=1e-3, warmup_steps=1, plot=False, progress=False, quiet=True,
                         out_dir=str(root), checkpoint_dir=str(root / "ck"))
    cfg.validate()
    trainer = MoETrainer(cfg)
    step0 = trainer.save_checkpoint()
    for _ in range(STEPS):
        trainer.train_step()
    step3 = trainer.save_checkpoint()
    if mcrdl.get_rank() == 0:
        checkpoint_tool.export_hf(step0, root / "hf0")
        n = bitwise_same(directory, root / "hf0")
        checkpoint_tool.export_hf(step3, root / "hf3")
        state, _ = checkpoint_tool.consolidate(step3)
        exported = load_hf(root / "hf3").state_dict()
        assert sorted(exported) == sorted(state)
        assert all(torch.equal(exported[k], state[k]) for k in state)
        loss = hf_loss(str(root / "hf3"), windows)
        assert loss == loss and loss < 10, loss  # finite: transformers ran it
        print(f"hf ted mixtral: export at step 0 bitwise ({n} tensors); after {STEPS} steps "
              f"the export holds the checkpoint's {len(state)} tensors bitwise; "
              f"transformers' loss {loss:.6f}", flush=True)
    mcrdl.barrier("auto")


def tied(root: Path, windows: torch.Tensor) -> None:
    """Check 7: a tied Llama through SAMO's checkpoints and export-hf."""
    directory = root / "hf"
    if mcrdl.get_rank() == 0:
        import transformers
        torch.manual_seed(4)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True)).save_pretrained(directory)
    mcrdl.barrier("auto")
    opts = dict(init_from=f"hf:{directory}", block_size=windows.size(1) - 1, G_data=4,
                micro_batch_size=1, global_batch_size=4, steps=2, seed=5, lr=1e-3,
                warmup_steps=1, samo=True, prune_sparsity=0.5, plot=False, progress=False,
                quiet=True, out_dir=str(root), checkpoint_dir=str(root / "ck"))
    trainer = Trainer(TrainConfig(**opts))
    trainer.train_step()
    ours = trainer.evaluate(windows)
    step = trainer.save_checkpoint()
    again = Trainer(TrainConfig(**opts, resume=str(step)))
    again.load_checkpoint(str(step))
    assert again.evaluate(windows) == ours
    if mcrdl.get_rank() == 0:
        import transformers
        checkpoint_tool.export_hf(step, root / "out")
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "out")
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        theirs = hf_loss(str(root / "out"), windows)
        assert rel(theirs, ours) <= TOL, (theirs, ours)
        print(f"hf tied llama SAMO G_data 4: resumed evaluate {ours:.6f}, exported tied, "
              f"transformers {theirs:.6f} (rel {rel(theirs, ours):.1e})", flush=True)
    mcrdl.barrier("auto")


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main():
    mcrdl.init(["mpi"])
    rank = mcrdl.get_rank()
    assert mcrdl.get_size() == 4, "run under mpiexec -n 4"
    models = json.loads(os.environ["HF_MODELS"])
    T = int(os.environ["HF_T"])
    root = Path(mcrdl.broadcast_object(
        tempfile.mkdtemp(prefix="mcrdl-hf-") if rank == 0 else None))
    g = torch.Generator().manual_seed(3)
    windows = torch.randint(0, 256, (W, T + 1), generator=g)
    for name, directory in sorted(models.items()):
        base = dict(init_from=f"hf:{directory}", block_size=T, micro_batch_size=1,
                    global_batch_size=4, steps=STEPS, seed=5, lr=1e-3, warmup_steps=1,
                    plot=False, progress=False, quiet=True, out_dir=str(root / name),
                    log_interval=10**6, G_inter=2, G_data=2)
        ck = root / name / "ck"
        cfg = TrainConfig(**base, checkpoint_dir=str(ck))
        cfg.validate()
        trainer = Trainer(cfg)
        imported = trainer.evaluate(windows)
        step0 = trainer.save_checkpoint()
        for _ in range(STEPS):
            trainer.train_step()
        trained = trainer.evaluate(windows)
        step3 = trainer.save_checkpoint()
        resumed = Trainer(TrainConfig(**base, checkpoint_dir=str(ck), resume=str(step3)))
        resumed.load_checkpoint(str(step3))
        again = resumed.evaluate(windows)
        assert again == trained, (again, trained)
        # G_data 1 on ranks 0-1 (the other two build their own (2,1) pipeline)
        from training.core.topology import ProcessGrid
        one = dict(base, G_data=1)
        c1 = TrainConfig(**one, checkpoint_dir=str(ck), resume=str(step3))
        grids = [ProcessGrid(c1.degrees(), order=c1.axis_order(),
                             world=mcrdl.new_group(list(r))) for r in ((0, 1), (2, 3))]
        for grid in grids:
            grid.make_groups()
        mine = next(gr for gr in grids if gr.is_member)
        narrow = Trainer(c1, grid=mine)
        narrow.load_checkpoint(str(step3))
        other = narrow.evaluate(windows)
        assert rel(other, trained) <= TOL, (other, trained)
        if rank == 0:
            ref = hf_loss(directory, windows)
            assert rel(imported, ref) <= TOL, (name, imported, ref)
            out0 = root / name / "hf0"
            checkpoint_tool.export_hf(step0, out0)
            n = bitwise_same(directory, out0)
            out3 = root / name / "hf3"
            checkpoint_tool.export_hf(step3, out3)
            exported = hf_loss(str(out3), windows)
            carried = [f for f in ("generation_config.json", "tokenizer.json")
                       if (Path(directory) / f).is_file()]
            for f in carried:  # from the run's --init-from directory (train_config)
                assert (out3 / f).read_bytes() == (Path(directory) / f).read_bytes(), f
            assert rel(exported, trained) <= TOL, (name, exported, trained)
            assert rel(trained, imported) > 1e-4, (trained, imported)  # it trained
            print(f"hf pipeline {name}: import {imported:.6f} vs transformers {ref:.6f} "
                  f"(rel {rel(imported, ref):.1e}); export at step 0 bitwise ({n} tensors); "
                  f"after {STEPS} steps {trained:.6f}, resumed {again:.6f}, G_data 1 "
                  f"{other:.6f}, exported in transformers {exported:.6f} (rel "
                  f"{rel(exported, trained):.1e}); carried over: {', '.join(carried)}",
                  flush=True)
        mcrdl.barrier("auto")
        four_d(name, directory, dict(base, G_inter=1, G_data=2, G_x=2), windows,
               root / name / "4d")
    ted(os.environ["HF_MIXTRAL"], windows, root / "ted")
    tied(root / "tied", windows)
    import_memory(root)
    if rank == 0:
        print(f"hf pipeline OK: {', '.join(sorted(models))}", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
