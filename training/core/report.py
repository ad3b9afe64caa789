"""What a training run reports, on world rank 0: the metrics file (JSON lines), the step
log with a progress bar, the per-phase time breakdown and the loss plot.

The pieces take plain values (records, seconds, paths), not a trainer, so that every
entry point reports the same way: one JSON object per step in the metrics file (``step``,
``loss``, ``lr``, ``grad_norm``, ``time_s``, ``tokens_per_s``, ``loss_scale`` and
``applied`` with fp16 loss scaling, ``goldfish_kept`` with the Goldfish loss, ``val_loss``
on the steps --eval-interval evaluates), one log line per ``--log-interval`` steps, a rich
progress bar on stderr only when it is a terminal.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mcrdl

from .timers import PHASES, PhaseTimers


@dataclass
class TrainResult:
    """What ``run`` returns on every rank; `phases` and the figures derived from the
    breakdown are filled on world rank 0 only."""

    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss), 1-based
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # --eval-interval's
    phases: dict = field(default_factory=dict)  # stage -> phase -> mean seconds per step
    bubble_measured: float = float("nan")
    bubble_model: float = float("nan")
    tokens_per_s: float = float("nan")
    start_step: int = 0                          # the step resumed from (0: a fresh run)
    grid: str = ""                               # "G_inter=2 x G_data=2"
    stage: int = 0                               # this rank's pipeline stage
    events: list = field(default_factory=list)   # the last step's pipeline events (record=True)
    layout: dict | None = None                   # --layout auto's choice (training/plan/auto.py)


class MetricsFile:
    """The JSON-lines metrics file. Resuming from `start_step` keeps the records of the
    steps up to it and drops those of the interrupted run after it."""

    def __init__(self, path: Path, start_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= start_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    continue
        self.file = open(self.path, "w")
        for line in kept:
            self.file.write(line + "\n")

    def write(self, record: dict) -> None:
        """Append one step's record (flushed, so a crash keeps the steps before it)."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


def step_line(record: dict, total_steps: int) -> str:
    """The log line of one step's metrics record."""
    line = (f"step {record['step']:5d}/{total_steps} | loss {record['loss']:.5f} | lr "
            f"{record['lr']:.2e} | {record['time_s'] * 1e3:7.1f} ms | "
            f"{record['tokens_per_s']:,.0f} tok/s")
    if "mfu" in record:
        line += f" | MFU {100 * record['mfu']:.2f}%"
    if "val_loss" in record:
        line += f" | val loss {record['val_loss']:.5f}"
    return line if record.get("applied", True) else line + " | skipped"


class ProgressLog:
    """Log lines on stdout (when `lines`); with `bar` and stderr a terminal, a rich
    progress bar of `total` steps on stderr, the lines printed above it."""

    def __init__(self, total: int, *, lines: bool, bar: bool):
        self.lines = lines
        self.bar = None
        if bar and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("training", total=total)
            self.bar.start()

    def log(self, line: str) -> None:
        if not self.lines:
            return
        if self.bar is not None:
            self.bar.console.print(line)
        else:
            print(line, flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def gather_phase_times(timers: PhaseTimers, wall: float, steps: int, key: int,
                       group: mcrdl.Group | None = None) -> dict[int, dict[str, float]]:
    """Collective over `group` (None: the world). On its rank 0, for each `key` (e.g. a
    pipeline stage), the mean over the ranks with that key of the seconds per step in each
    phase, ``other`` (the rest of `wall`) and the whole step (``wall``); `wall` is the
    seconds of `steps` timed steps. Empty on other ranks and when no step was timed."""
    times = timers.snapshot()
    times["other"] = max(0.0, wall - sum(v for k, v in times.items() if k != "other"))
    times["wall"] = wall
    gathered = mcrdl.all_gather_object((key, times), group=group)
    if mcrdl.get_rank(group=group) != 0 or steps < 1:
        return {}
    by_key: dict[int, list[dict[str, float]]] = {}
    for rank_key, rank_times in gathered:
        by_key.setdefault(rank_key, []).append(rank_times)
    phases = list(PHASES) + sorted({p for _, t in gathered for p in t} - set(PHASES))
    return {k: {phase: sum(t.get(phase, 0.0) for t in rows) / len(rows) / steps
                for phase in phases}
            for k, rows in sorted(by_key.items())}


def pipeline_bubble(phases: dict[int, dict[str, float]], n_stages: int,
                    n_micro: int) -> tuple[float, float]:
    """(measured, model) bubble fraction: bubble / (compute + p2p + bubble) averaged over
    stages, and the pipeline model's (G_inter - 1) / (m + G_inter - 1)."""
    fractions = [p["bubble"] / max(1e-12, p["compute"] + p["p2p"] + p["bubble"])
                 for p in phases.values()]
    return sum(fractions) / len(fractions), (n_stages - 1) / (n_micro + n_stages - 1)


def print_breakdown(result: TrainResult, steps: int, n_stages: int, n_micro: int) -> None:
    """The per-stage phase table, the bubble fractions and the throughput of `result`."""
    print(f"\nper-step time by phase (ms, mean over data-parallel ranks; {steps} steps after "
          "warm-up):")
    print("stage " + "".join(f"{p:>11}" for p in PHASES) + f"{'step':>11}")
    for stage, p in result.phases.items():
        print(f"{stage:5d} " + "".join(f"{p[k] * 1e3:11.2f}" for k in PHASES)
              + f"{p['wall'] * 1e3:11.2f}")
    print(f"bubble fraction: measured {result.bubble_measured:.3f} (bubble / (compute + p2p + "
          f"bubble), mean over stages), model (G_inter-1)/(m+G_inter-1) = "
          f"{result.bubble_model:.3f} with G_inter={n_stages}, m={n_micro}")
    print(f"throughput: {result.tokens_per_s:,.0f} tokens/s", flush=True)


def plot_loss(metrics: Path, png: Path, title: str) -> None:
    """The loss curve of a metrics file as a PNG, with the validation loss where the
    records hold one (a note instead without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no loss curve; pip install matplotlib)")
        return
    records = [r for r in (json.loads(line) for line in metrics.read_text().splitlines()
                           if line.strip()) if "loss" in r]  # not --layout auto's record
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2,
            label="training")
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", lw=1.2, ms=3, label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"loss curve: {png}; metrics: {metrics}")


def print_breakdown_4d(result: TrainResult, steps: int) -> None:
    """The 4D engine's per-step time: compute (forward and backward, less the time
    blocked on collectives), the exposed communication of each axis (time blocked on
    its collectives, what overlap did not hide), the optimizer, the rest; and the
    throughput."""
    p = result.phases.get(0, {})
    print(f"\nper-step time (ms, mean over ranks; {steps} steps after warm-up); exposed = "
          "blocked on that axis's collectives:")
    shown = ["compute"] + sorted(k for k in p if k.startswith("exposed")) + ["optimizer",
                                                                            "other"]
    print("".join(f"{k:>14}" for k in shown) + f"{'step':>14}")
    print("".join(f"{p.get(k, 0.0) * 1e3:14.2f}" for k in shown) + f"{p['wall'] * 1e3:14.2f}")
    print(f"throughput: {result.tokens_per_s:,.0f} tokens/s", flush=True)
