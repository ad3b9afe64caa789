"""Plots of a tuning table (``mcrdl-tune plot``; needs the ``plot`` extra: matplotlib).

- ``<op>_heatmap.png``: message size x group size -> the winning backend (colour), shaded
  by its speedup over the runner-up (darker = larger), the number printed in each cell;
  like the PCCL paper's heatmaps.
- ``<op>_latency.png``: latency vs message size per backend, one panel per group size;
  for the mpi backends also the time of each variant of a blocking call (dashed: the
  blocking MPI collective, dotted: the nonblocking one and a wait).
"""

from __future__ import annotations

import math
import os

from .sizes import format_size
from .table import TuningTable

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def plot_table(path: str, out_dir: str = ".") -> list[str]:
    """Write the PNGs of every op in the table at `path`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    table = TuningTable.load(path)
    os.makedirs(out_dir, exist_ok=True)
    backends = table.backends()
    color = {b: _COLORS[i % len(_COLORS)] for i, b in enumerate(backends)}
    written = []
    for op in table.ops():
        gsizes = table.group_sizes(op)
        sizes = sorted({n for g in gsizes for b in table.backends(op)
                        for n in table.points(op, g, b)[0]})
        if not sizes:
            continue
        # heatmap: rows = group sizes, columns = message sizes
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(sizes) + 2), 0.7 * len(gsizes) + 2))
        for gi, g in enumerate(gsizes):
            for si, n in enumerate(sizes):
                times = {}
                for b in table.backends(op):
                    ns, ts = table.points(op, g, b)
                    if n in ns and ts[ns.index(n)] is not None:
                        times[b] = ts[ns.index(n)]
                if not times:
                    continue
                ranked = sorted(times, key=times.get)
                win = ranked[0]
                speedup = times[ranked[1]] / times[win] if len(ranked) > 1 else 1.0
                shade = min(1.0, 0.25 + 0.75 * math.log2(speedup) / 3) if speedup > 1 else 0.25
                rgb = to_rgb(color[win])
                cell = tuple(1 - shade * (1 - c) for c in rgb)
                ax.add_patch(plt.Rectangle((si, gi), 1, 1, color=cell))
                ax.text(si + 0.5, gi + 0.5, f"{speedup:.1f}", ha="center", va="center",
                        fontsize=6)
        ax.set_xlim(0, len(sizes))
        ax.set_ylim(0, len(gsizes))
        ax.set_xticks([i + 0.5 for i in range(len(sizes))], [format_size(n) for n in sizes],
                      rotation=90, fontsize=7)
        ax.set_yticks([i + 0.5 for i in range(len(gsizes))], [str(g) for g in gsizes])
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("group size (ranks)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=color[b]) for b in table.backends(op)]
        ax.legend(handles, table.backends(op), loc="upper left", bbox_to_anchor=(1.01, 1),
                  title="winner", fontsize=8)
        ax.set_title(f"{op}: fastest backend (number: speedup over the runner-up)")
        fig.tight_layout()
        out = os.path.join(out_dir, f"{op}_heatmap.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
        # latency curves
        fig, axes = plt.subplots(1, len(gsizes), figsize=(4 * len(gsizes), 3.4), squeeze=False)
        for ax, g in zip(axes[0], gsizes, strict=True):
            for b in table.backends(op):
                ns, ts = table.points(op, g, b)
                # barrier is stored at 0 B, which a log axis cannot show: drawn at 1 B
                pts = [(max(n, 1), t * 1e6) for n, t in zip(ns, ts, strict=True)
                       if t is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker=".", label=b, color=color[b])
                for v, pts in sorted(table.variant_times(op, g, b).items()):
                    if pts:
                        ax.plot([max(n, 1) for n in sorted(pts)],
                                [pts[n] * 1e6 for n in sorted(pts)],
                                linestyle={"blocking": "--", "allreduce": "-."}.get(v, ":"),
                                linewidth=1,
                                label=f"{b} ({v})", color=color[b])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {g} ranks", fontsize=9)
            ax.set_xlabel("message size (bytes)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("time (us)")
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        out = os.path.join(out_dir, f"{op}_latency.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written
