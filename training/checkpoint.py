"""Inspect and consolidate training checkpoints (their format: training/core/checkpoint.py).

    python -m training.checkpoint consolidate runs/ckpt/step_000020 -o gpt.pt

writes one ordinary PyTorch ``state_dict`` of the whole model (``--masters``: the fp32
master weights of a bf16/fp16 or --offload-optimizer run instead; load it with
``GPT(cfg).load_state_dict(torch.load("gpt.pt"))``) and ``gpt.json`` with its config;
for train_moe's checkpoints, the serial ``MoEGPT``'s state_dict and its model and MoE
configs. ``--init-from gpt.pt`` starts a run of any grid or layout from such a file
(training/models/init_source.py checks its names and shapes against the run's model).

    python -m training.checkpoint export-hf runs/ckpt/step_000020 -o my-model

writes a Hugging Face model directory (config.json, model.safetensors,
generation_config.json) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads
as is, from a checkpoint of any engine (pipeline, 4D, TED) of a model with a Hugging
Face equivalent (``--arch gpt`` as GPT2LMHeadModel, ``llama`` as LlamaForCausalLM,
train_moe's ``mixtral`` as MixtralForCausalLM). When the run started from
``--init-from hf:DIR`` (its manifest's train_config), DIR's other config fields, its
generation config and its tokenizer files are carried over.

    python -m training.checkpoint list runs/ckpt [--verify]

prints each step directory and whether it can be loaded (its manifest, its shards'
sizes, with ``--verify`` their sha256), and exits 1 when one cannot.

Both read checkpoints without running anything in their files (``load_file`` in
training/core/checkpoint.py); ``--trust-checkpoint`` also admits checkpoints of the
earlier format (mcrdl-training-checkpoint/1), whose shards are read with pickle's full
unpickler: give it only for files you trust. The consolidated state_dict is a
``torch.save`` file of tensors alone, which ``torch.load``'s default (weights_only)
reads.

Each engine consolidates its own layout: training/pipeline/consolidate.py,
training/parallel4d/consolidate.py, training/ted/consolidate.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from .core import checkpoint as ckpt
from .core.options import PathOptionError, check_file
from .core.run_options import HF_PREFIX
from .core.validate import print_traceback
from .models.families import config_from_dict
from .parallel4d import consolidate as parallel4d
from .pipeline import consolidate as pipeline
from .ted import consolidate as ted

#: The consolidation of each engine's checkpoints (manifest "engine").
CONSOLIDATE = {"pipeline": pipeline.consolidate, "4d": parallel4d.consolidate,
               "ted": ted.consolidate}


def consolidate(directory: str | os.PathLike, *, masters: bool = False,
                trust: bool = False) -> tuple[dict, dict]:
    """(state_dict of the whole model, model config dict) from a checkpoint's shards;
    `masters`: the fp32 master weights of a bf16/fp16 or --offload-optimizer run
    instead of the model's (in the training dtype). A TED MoE checkpoint (train_moe)
    gives the serial MoEGPT's state_dict and ``{"model": ..., "moe": ...}``. `trust`
    (``--trust-checkpoint``): also a checkpoint of an earlier format (ckpt.TRUSTED_ONLY)."""
    manifest = ckpt.read_manifest(directory, trust=trust)
    engine = manifest.get("engine", "pipeline")
    if engine not in CONSOLIDATE:
        raise ckpt.CheckpointError(f"{directory} was written by the engine {engine!r}; this "
                                   f"version consolidates those of {', '.join(CONSOLIDATE)}")
    return CONSOLIDATE[engine](directory, manifest, masters=masters)


def export_hf(directory: str | os.PathLike, out: str | os.PathLike, *,
              masters: bool = False, trust: bool = False) -> Path:
    """Write the checkpoint `directory` as the Hugging Face model directory `out` (made;
    it must not hold files); returns `out`. CheckpointError when `directory` is no
    checkpoint, or its model has no Hugging Face equivalent."""
    from .models import hf

    directory, out = Path(directory), Path(out)
    manifest = ckpt.read_manifest(directory, trust=trust)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PathOptionError(f"-o {out}: {'is a file' if not out.is_dir() else 'is not empty'}"
                              "; expected a new or empty directory for the Hugging Face model")
    state, config = consolidate(directory, masters=masters, trust=trust)
    moe = None
    if "moe" in config:  # train_moe's: {"model": ..., "moe": ...}
        from .models.moe import MoEConfig

        arch = config["model"].get("arch", "gpt")
        if arch != "mixtral":
            raise ckpt.CheckpointError(
                f"{directory}: train_moe's --arch {arch} model (GShard/Switch experts "
                "beside dense blocks) has no Hugging Face equivalent; export-hf writes "
                f"{', '.join(hf.SUPPORTED)} (train_moe --arch mixtral for a MoE)")
        model_cfg, moe = _model_config(config["model"], directory), MoEConfig(**config["moe"])
    else:
        model_cfg = _model_config(config, directory)
    init_from = (manifest.get("train_config") or {}).get("init_from") or ""
    source = init_from.removeprefix(HF_PREFIX) if init_from.startswith(HF_PREFIX) else None
    if source is not None and not os.path.isfile(os.path.join(source, hf.CONFIG)):
        print(f"note: the run started from --init-from {init_from}, which is gone: its "
              "tokenizer and other config fields are not carried over", file=sys.stderr)
        source = None
    staging = out.with_name(f".{out.name}.export-{os.getpid()}")
    try:
        kw = {"moe": moe} if moe is not None else {}
        hf.export_state_dict(model_cfg, state, staging, source=source, **kw)
    except (TypeError, hf.HFConfigError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise ckpt.CheckpointError(f"{directory}: {e}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.rename(staging, out)
    return out


def _model_config(fields: dict, directory: Path):
    try:
        return config_from_dict(fields)
    except (TypeError, ValueError) as e:
        raise ckpt.CheckpointError(f"{directory}: its manifest's model config cannot be "
                                   f"read ({e})") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.checkpoint",
                                 description="Inspect and consolidate training checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="merge a checkpoint's shards into one state_dict")
    c.add_argument("checkpoint", help="a step directory, or a checkpoint dir (its latest)")
    c.add_argument("-o", "--out", required=True, help="output .pt (state_dict); config -> .json")
    c.add_argument("--masters", action="store_true",
                   help="the fp32 master weights of a bf16/fp16 or --offload-optimizer run "
                        "instead of the model in its training dtype (to go on from with "
                        "--init-from: a bf16/fp16 run keeps them whole as its masters)")
    x = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face model "
                       "directory (transformers' from_pretrained loads it)")
    x.add_argument("checkpoint", help="a step directory, or a checkpoint dir (its latest)")
    x.add_argument("-o", "--out", required=True, help="the Hugging Face model directory "
                   "to write (new or empty)")
    x.add_argument("--masters", action="store_true",
                   help="the fp32 master weights of a bf16/fp16 or --offload-optimizer run "
                        "instead of the model in its training dtype")
    ls = sub.add_parser("list", help="list the checkpoints of a directory and whether "
                        "each can be loaded (exit 1 when one cannot)")
    ls.add_argument("directory")
    ls.add_argument("--verify", action="store_true",
                    help="also check every shard's sha256 (reads every byte)")
    for p in (c, x, ls):
        p.add_argument(ckpt.TRUST_OPTION, action="store_true", help=ckpt.TRUST_HELP)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            return _list(Path(args.directory), verify=args.verify,
                         trust=args.trust_checkpoint)
        path = Path(args.checkpoint)
        if not (path / "manifest.json").exists() and ckpt.latest_checkpoint(path):
            path = ckpt.latest_checkpoint(path)
        if args.cmd == "export-hf":
            out = export_hf(path, args.out, masters=args.masters, trust=args.trust_checkpoint)
            arch = json.loads((out / "config.json").read_text())["architectures"][0]
            print(f"exported {path} -> {out}: {arch} (config.json, model.safetensors, "
                  "generation_config.json)")
            return 0
        out = Path(args.out)
        if out.suffix == ".json":  # the config goes to OUT with the suffix .json
            raise ckpt.CheckpointError(f"-o {out}: the state_dict and its config (.json) would be "
                                  "the same file; name the state_dict .pt")
        check_file("-o", out)  # before the shards are read: a refusal costs no work
        state, cfg = consolidate(path, masters=args.masters, trust=args.trust_checkpoint)
        ckpt.atomic_torch_save(state, out)
        ckpt.atomic_write(out.with_suffix(".json"), json.dumps(cfg, indent=1).encode())
        n = sum(t.numel() for t in state.values())
        print(f"consolidated {path} -> {out}: {len(state)} tensors, {n} parameters; "
              f"config in {out.with_suffix('.json')}")
        return 0
    except (ckpt.CheckpointError, PathOptionError) as e:
        print_traceback(e)
        print(f"error: {e}", file=sys.stderr)
        return 2


def _list(root: Path, *, verify: bool, trust: bool = False) -> int:
    """``list``: one line per step directory (complete or not), the newest usable one;
    one of an earlier format is usable only with `trust` (--trust-checkpoint)."""
    if not root.is_dir():
        raise ckpt.CheckpointError(f"{root} is not a directory")
    steps = ckpt.step_dirs(root)
    latest = ckpt.latest_checkpoint(root)
    good, bad = [], 0
    for p in steps:
        mark = "  (latest)" if latest is not None and p.name == latest.name else ""
        try:
            m = ckpt.read_manifest(p, trust=trust)
            problems = ckpt.shard_problems(p, m, verify=verify)
            line = f"{p}  step {m['step']}  grid {m['grid']}  {len(m['shards'])} shards"
        except (ckpt.CheckpointError, OSError, KeyError, TypeError, AttributeError) as e:
            problems, line = [str(e) if isinstance(e, ckpt.CheckpointError)
                              else f"manifest unreadable ({type(e).__name__}: {e})"], str(p)
        if problems:
            bad += 1
            print(f"{line}{mark}  UNUSABLE: {'; '.join(problems)}")
        else:
            good.append(p)
            print(f"{line}{mark}  ok{' (sha256 verified)' if verify else ''}")
    if not steps:
        print(f"no checkpoint in {root}")
    elif bad:
        print(f"# {bad} of {len(steps)} cannot be loaded"
              + (f"; the newest usable: --resume {good[-1]}" if good else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
