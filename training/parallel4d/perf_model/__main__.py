"""Rank every 4D grid of a world by predicted communication time per step.

    python -m training.parallel4d.perf_model --model gpt-20b --ranks 32 --ranks-per-node 4
        [--batch B] [--micro-batches M] [--dtype bf16] [--regather-weights] [--bucket-mib]
        [--table T.json] [--latency US] [--intra-node-bandwidth GB/s]
        [--inter-node-bandwidth GB/s] [--min-model-parallel N] [--top N] [--show-skipped]

Prints each grid (G_x, G_y, G_z, G_data) that fits the model, fastest first, with the
predicted seconds of each (op, axis); then how many grids were skipped and why. A
prediction of the model (training/parallel4d/perf_model), not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence

from mcrdl.tuning.table import TuningTable, TuningTableError

from ...core.arguments import dtype, non_negative_float, positive_float, positive_int
from ...core.dtypes import BYTES, NAMES
from ...models.gpt import CONFIGS, get_config
from .network import DEFAULT_INTER_NODE_BANDWIDTH, DEFAULT_INTRA_NODE_BANDWIDTH, Network
from .ranking import Ranking, rank_grids
from .step import TrainingStep

#: Columns of the table: (op, axis) and its heading, in this order.
COLUMNS = ((("all_gather", "z"), "AG z"), (("reduce_scatter", "z"), "RS z"),
           (("all_reduce", "x"), "AR x"), (("all_reduce", "y"), "AR y"),
           (("all_reduce", "z"), "AR z"), (("all_reduce", "data"), "AR data"),
           (("all_gather", "x"), "AG x"), (("all_reduce", "world"), "AR world"))
SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.parallel4d.perf_model",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(CONFIGS), metavar="NAME",
                   help="GPT shape from training.models.gpt.CONFIGS, e.g. gpt-20b")
    for name in SHAPE_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), type=positive_int, default=None,
                       help=f"override the model's {name}")
    p.add_argument("--ranks", type=positive_int, required=True, help="world size")
    p.add_argument("--ranks-per-node", type=positive_int, default=4,
                   help="ranks (GPUs) per node, G_node of Eq. 5.7 (default 4)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences per step (default: one per rank)")
    p.add_argument("--micro-batches", type=positive_int, default=1,
                   help="forward/backward passes per step (default 1)")
    p.add_argument("--dtype", type=dtype, choices=NAMES, default="fp32",
                   help="element type of parameters and activations: fp32, bf16, fp16 (or "
                        "float32, bfloat16, float16; default fp32)")
    p.add_argument("--regather-weights", action="store_true",
                   help="gather each Linear weight again in the backward (not kept)")
    p.add_argument("--bucket-mib", type=positive_float, default=4.0, metavar="MiB",
                   help="the engine's fused gradient all_reduce buckets (--bucket-mib, "
                        "default %(default)g)")
    p.add_argument("--table", metavar="T.json", default=None,
                   help="tuning table whose alpha-beta fits give the latency and the relative "
                        "bandwidth of each op")
    p.add_argument("--latency", type=non_negative_float, default=None, metavar="US",
                   help="latency per step of every op in microseconds (overrides --table; "
                        "default 5)")
    p.add_argument("--intra-node-bandwidth", type=positive_float, metavar="GB/s",
                   default=DEFAULT_INTRA_NODE_BANDWIDTH / 1e9,
                   help="bandwidth of one ring inside a node, GB/s (default %(default)g)")
    p.add_argument("--inter-node-bandwidth", type=positive_float, metavar="GB/s",
                   default=DEFAULT_INTER_NODE_BANDWIDTH / 1e9,
                   help="bandwidth out of one node, GB/s (default %(default)g)")
    p.add_argument("--min-model-parallel", type=positive_int, default=1, metavar="N",
                   help="skip grids with G_x*G_y*G_z < N, e.g. when the model's states do "
                        "not fit in fewer ranks' memory (default 1)")
    p.add_argument("--top", type=positive_int, default=None, metavar="N",
                   help="print only the N fastest grids")
    p.add_argument("--show-skipped", action="store_true",
                   help="list every skipped grid with its reasons")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.ranks > args.ranks_per_node and args.ranks % args.ranks_per_node:
        p.error(f"--ranks {args.ranks} is not a whole number of nodes of --ranks-per-node "
                f"{args.ranks_per_node}: Eq. 5.7 takes nodes of that many consecutive ranks, "
                f"all full; use a multiple of {args.ranks_per_node}")
    model = get_config(args.model, **{k: getattr(args, k) for k in SHAPE_OPTIONS})
    batch = args.ranks if args.batch is None else args.batch
    try:
        dtype_bytes = BYTES[args.dtype]
        step = TrainingStep(model, batch, args.micro_batches, dtype_bytes,
                            keep_weights=not args.regather_weights,
                            bucket_bytes=max(dtype_bytes, int(args.bucket_mib * 2**20)))
    except ValueError as e:
        p.error(f"--batch/--micro-batches: {e}")
    bandwidths = {"intra_node_bandwidth": args.intra_node_bandwidth * 1e9,
                  "inter_node_bandwidth": args.inter_node_bandwidth * 1e9}
    if args.latency is not None:
        network = Network(args.ranks_per_node, latency=args.latency * 1e-6, **bandwidths)
        latency_from = "--latency"
    elif args.table is not None:
        try:
            table = TuningTable.load(args.table)
        except TuningTableError as e:
            p.error(f"--table: {e}")
        network = Network.from_tuning_table(table, args.ranks_per_node, **bandwidths)
        latency_from = f"alpha-beta fits of {args.table}"
    else:
        network = Network(args.ranks_per_node, **bandwidths)
        latency_from = "default"
    ranking = rank_grids(step, args.ranks, network, min_model_parallel=args.min_model_parallel)
    print_ranking(ranking, args, step, network, latency_from)
    return 0


def print_ranking(ranking: Ranking, args: argparse.Namespace, step: TrainingStep,
                  network: Network, latency_from: str, file=None) -> None:
    out = sys.stdout if file is None else file
    m = step.model
    lat = ", ".join(f"{op} {a * 1e6:.3g}" for op, a in network.latency.items())
    rates = ", ".join(f"{op} {r:.2f}" for op, r in network.op_rate.items())
    print(f"# predicted communication per step (a model, not a measurement): {args.model} "
          f"(n_layer {m.n_layer}, n_embd {m.n_embd}, n_head {m.n_head}, vocab {m.vocab_size}, "
          f"sequence {m.block_size}), batch {step.batch} x {step.micro_batches} micro-batch(es), "
          f"{args.dtype}, weights {'re-gathered' if args.regather_weights else 'kept'}",
          file=out)
    print(f"# {args.ranks} ranks, {network.ranks_per_node} per node; bandwidth GB/s: "
          f"intra-node {network.intra_node_bandwidth / 1e9:g}, inter-node "
          f"{network.inter_node_bandwidth / 1e9:g} per node (Eq. 5.7); latency us per step "
          f"({latency_from}): {lat}; op rates (relative bandwidth): {rates}", file=out)
    shown = ranking.ranked if args.top is None else ranking.ranked[:args.top]
    times = [r.by_op_axis() for r in shown]
    cols = [(key, head) for key, head in COLUMNS if any(key in t for t in times)]
    print(f"{'rank':>5} {'Gx':>5} {'Gy':>5} {'Gz':>5} {'Gdata':>5} {'total(ms)':>12} "
          + " ".join(f"{head + '(ms)':>12}" for _, head in cols) + f" {'calls':>8}", file=out)
    for i, (r, t) in enumerate(zip(shown, times, strict=True), 1):
        g = r.grid
        print(f"{i:>5} {g.x:>5} {g.y:>5} {g.z:>5} {g.data:>5} {r.seconds * 1e3:>12.4f} "
              + " ".join(f"{t.get(key, 0.0) * 1e3:>12.4f}" for key, _ in cols)
              + f" {r.calls:>8}", file=out)
    feasible, total = len(ranking.ranked), len(ranking.ranked) + len(ranking.skipped)
    print(f"# {feasible} of {total} grids fit"
          + ("" if args.top is None or args.top >= feasible else f"; the {args.top} fastest shown"),
          file=out)
    if ranking.skipped:
        why = Counter(c for s in ranking.skipped for c, _ in s.violations)
        print(f"# skipped {len(ranking.skipped)}: grids breaking "
              + ", ".join(f"'{c}' {n}" for c, n in sorted(why.items()))
              + ("" if args.show_skipped else " (--show-skipped lists them)"), file=out)
    if args.show_skipped:
        for s in ranking.skipped:
            print(f"#   {s.grid}: " + "; ".join(msg for _, msg in s.violations), file=out)


if __name__ == "__main__":
    raise SystemExit(main())
