"""Rank every layout of a model on a machine by predicted step time.

    python -m training.plan --model gpt-20b --world-size 32 --network perlmutter
    python -m training.plan --model moe-1.3b --experts 16 --world-size 64 \\
        --network frontier --memory-per-gpu 64GiB
    python -m training.plan --model my.json --world-size 8 --gpus-per-node 4 \\
        --memory-per-gpu 24GiB --network 5,100:10,25 --peak-flops 100e12

--model: a GPT shape (training.models.gpt.CONFIGS, or an MoE base with --experts), a
Llama shape (training.models.llama.CONFIGS: llama3-70b, also spelled llama-3-70b, ...),
a Mixtral shape (mixtral-8x7b: every block 8 experts, top 2; --experts changes the
count), or a JSON file of a family's config fields (GPTConfig: n_layer, n_head, n_embd,
block_size, vocab_size, bias; with "arch": "llama" or "mixtral", LlamaConfig's, as a
checkpoint manifest records them) with an optional "moe" object of MoEConfig fields.
--network: a shipped description (perlmutter, frontier, alps: training/plan/networks/,
with their sources), a JSON file in that form, or ALPHA_US,GBPS:ALPHA_US,GBPS (inside
a node, between nodes). --sequence-length: the training sequence (default the shape's
block_size).

Prints the top layouts (engine and degrees, memory per GPU, communication per step,
predicted compute, communication and step time), then how many layouts were dropped
and why. Exit 2 when no layout fits, naming the tightest constraint. A prediction of
the models in training/plan (see training/plan/planner.py), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.arguments import dtype, positive_float, positive_int
from ..models import llama, mixtral
from ..models.families import config_from_dict, family, family_of
from ..models.gpt import CONFIGS
from ..models.moe import MOE_BASES, MoEConfig, base_config
from .memory import gib, parse_bytes
from .network import PlanError, load_machine, shipped
from .planner import Plan, Problem, explain_infeasible, plan


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a GPT, MoE base, Llama (llama-3-70b) or Mixtral shape, or CONFIG.json")
    p.add_argument("--sequence-length", type=positive_int, default=None, metavar="TOKENS",
                   help="tokens per training sequence (default: the model's block_size; "
                        "the Llama 3 shapes' is their 131072-token context)")
    p.add_argument("--experts", type=positive_int, default=None,
                   help="make the model an MoE with this many experts (TED layouts)")
    p.add_argument("--world-size", type=positive_int, required=True, help="GPUs (ranks)")
    p.add_argument("--network", required=True,
                   help=f"{', '.join(shipped())}, a JSON file, or ALPHA_US,GBPS:ALPHA_US,GBPS")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs (ranks) per node (default: the network's)")
    p.add_argument("--memory-per-gpu", type=parse_bytes, default=None, metavar="SIZE",
                   help="device memory per GPU, e.g. 64GiB (default: the network's)")
    p.add_argument("--peak-flops", type=positive_float, default=None, metavar="FLOP/s",
                   help="peak bf16 flop/s per GPU (default: the network's)")
    p.add_argument("--efficiency", type=positive_float, default=0.5,
                   help="fraction of the peak the matmuls reach (default %(default)g)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences per step (default: one per GPU)")
    p.add_argument("--micro-batch-size", type=positive_int, default=1,
                   help="sequences per micro-batch (default 1)")
    p.add_argument("--dtype", type=dtype, choices=("bf16", "fp32"), default="bf16",
                   help="bf16 or fp32 (or bfloat16, float32; default bf16)")
    p.add_argument("--top", type=positive_int, default=10, help="layouts shown (default 10)")
    p.add_argument("--show-rejected", action="store_true",
                   help="list every dropped layout with its reason")
    return p


#: Spellings of the Llama 3 shapes as their publications write them.
_ALIASES = {f"llama-3-{size}": f"llama3-{size}" for size in ("8b", "70b", "405b")}


def _named(spec: str) -> Any:
    """The shape a --model name gives: a GPT or MoE base, then a Llama or Mixtral shape."""
    name = _ALIASES.get(spec, spec)
    for arch in ("llama", "mixtral"):
        configs = family(arch).configs
        if name in configs and name not in CONFIGS and name not in MOE_BASES:
            return configs[name]
    try:
        return base_config(name)
    except ValueError:
        known = [*CONFIGS, *MOE_BASES, *llama.CONFIGS, *_ALIASES, *mixtral.CONFIGS]
        raise PlanError(f"--model {spec!r}: unknown shape; expected one of "
                        f"{', '.join(dict.fromkeys(known))} or a CONFIG.json") from None


def load_model(spec: str, experts: int | None) -> tuple[Any, MoEConfig | None]:
    """The model of --model/--experts (see the module docstring)."""
    moe = None
    if spec.endswith(".json") or Path(spec).is_file():
        try:
            d = json.loads(Path(spec).read_text())
            moe_fields = d.pop("moe", None)
            cfg = config_from_dict(d)  # "arch": a manifest's or consolidated .json's family
            moe = None if moe_fields is None else MoEConfig(**moe_fields)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise PlanError(f"--model {spec!r}: not a model description ({e}); expected a "
                            "JSON object of a family's config fields (GPTConfig, or "
                            "LlamaConfig with \"arch\": \"llama\" or \"mixtral\") with an "
                            "optional \"moe\" object of MoEConfig fields") from None
    else:
        cfg = _named(spec)
        if spec in MOE_BASES and experts is None:
            raise PlanError(f"--model {spec} is an MoE base: give --experts")
    if isinstance(cfg, mixtral.MixtralConfig) and moe is None:
        # Mixtral's routing: every block an MoE, the top 2 experts by probability
        moe = MoEConfig(experts=experts or 8, top_k=2, moe_every=1, gating="mixtral",
                        router_group_tokens=cfg.block_size)
    if experts is not None:
        moe = MoEConfig(**{**({} if moe is None else moe.as_dict()), "experts": experts,
                           "router_group_tokens": cfg.block_size})
    return cfg, moe


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg, moe = load_model(args.model, args.experts)
        if args.sequence_length is not None:
            cfg = dataclasses.replace(cfg, block_size=args.sequence_length)
            if moe is not None:
                moe = dataclasses.replace(moe, router_group_tokens=args.sequence_length)
        machine = load_machine(args.network)
        gpus = args.gpus_per_node or machine.gpus_per_node
        if gpus is None:
            raise PlanError("--gpus-per-node: the network gives no GPUs per node; name it")
        if machine.gpus_per_node not in (None, gpus):
            raise PlanError(f"--gpus-per-node {gpus}: network {machine.name} has "
                            f"{machine.gpus_per_node} GPUs per node; leave it out or give "
                            "alpha-beta pairs for another node shape")
        mem = args.memory_per_gpu or machine.memory_per_gpu
        peak = args.peak_flops or machine.peak_flops
        for value, flag in ((mem, "--memory-per-gpu"), (peak, "--peak-flops")):
            if value is None:
                raise PlanError(f"{flag}: the network gives none; name it")
        problem = Problem(cfg, args.world_size, gpus, mem, machine, peak, args.efficiency,
                          args.batch, args.micro_batch_size, args.dtype, moe)
        result = plan(problem)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_plan(result, args.model, args.top, args.show_rejected)
    if not result.ranked:
        print(f"error: {explain_infeasible(result)}", file=sys.stderr)
        return 2
    return 0


def print_plan(result: Plan, name: str, top: int, show_rejected: bool = False,
               file=None) -> None:
    out = sys.stdout if file is None else file
    p = result.problem
    m = p.model
    moe = "" if p.moe is None else f", {p.moe.experts} experts every {p.moe.moe_every} blocks"
    arch = family_of(m).name
    shape = "" if arch == "gpt" else \
        f" ({arch}: n_kv_head {m.n_kv_head}, intermediate {m.intermediate_size})"
    print(f"# {name}{shape}: n_layer {m.n_layer}, n_embd {m.n_embd}, n_head {m.n_head}, vocab "
          f"{m.vocab_size}, sequence {m.block_size}{moe}; {p.dtype}, batch {p.sequences} "
          f"sequences, micro-batch {p.micro_batch_size}", file=out)
    print(f"# {p.world_size} GPUs, {p.gpus_per_node} per node, {gib(p.memory_per_gpu)} GiB "
          f"each, {p.peak_flops / 1e12:g} TFLOP/s peak x {p.efficiency:g}; network "
          f"{p.machine.name}: intra-node {p.machine.bandwidth['intra_node'] / 1e9:g} GB/s "
          f"{p.machine.latency['intra_node'] * 1e6:g} us, inter-node "
          f"{p.machine.bandwidth['inter_node'] / 1e9:g} GB/s "
          f"{p.machine.latency['inter_node'] * 1e6:g} us", file=out)
    print("# predicted (a model, not a measurement); memory: device bytes per GPU; "
          "comm: bytes per GPU per step", file=out)
    print(f"{'rank':>4}  {'layout':<34} {'mem GiB':>8} {'comm GiB':>9} {'compute s':>10} "
          f"{'comm s':>9} {'step s':>9}", file=out)
    for i, c in enumerate(result.ranked[:top], 1):
        print(f"{i:>4}  {c.label:<34} {gib(c.memory['total']):>8} {c.comm_bytes / 2**30:>9.2f} "
              f"{c.compute_seconds:>10.4f} {c.comm_seconds:>9.4f} {c.step_seconds:>9.4f}",
              file=out)
    total = len(result.ranked) + len(result.rejected)
    print(f"# {len(result.ranked)} of {total} layouts fit"
          + (f"; the {top} fastest shown" if top < len(result.ranked) else ""), file=out)
    if result.rejected:
        reasons = result.reasons()
        print("# dropped: " + ", ".join(f"{c} {n}" for c, n in sorted(reasons.items()))
              + ("" if show_rejected else " (--show-rejected lists them)"), file=out)
    if show_rejected:
        for r in result.rejected:
            print(f"#   {r.label}: {r.constraint}: {r.message}", file=out)


if __name__ == "__main__":
    sys.exit(main())
