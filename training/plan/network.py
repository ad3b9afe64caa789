"""A machine for the planner: GPUs per node, memory and peak flop rate per GPU, and an
alpha-beta pair per level (inside a node, between nodes).

A description is a JSON file (the shipped ones are in ``networks/``: Perlmutter,
Frontier, Alps, each with its sources in ``"sources"``)::

    {"name": ..., "gpus_per_node": 4, "memory_per_gpu_bytes": 4e10,
     "peak_flops_per_gpu": 3.12e14,
     "levels": {"intra_node": {"latency_us": 5, "bandwidth_GBps": 100},
                "inter_node": {"latency_us": 10, "bandwidth_GBps": 100}},
     "sources": [...]}

or, on the command line, ``ALPHA_US,GBPS:ALPHA_US,GBPS`` (inside a node, then between
nodes; GB/s = 1e9 bytes per second; ``inter_node`` is out of one node, all its NICs).

The 4D performance model's ``Network`` takes one latency for every collective: the
planner gives it the inter-node alpha when the world spans nodes (its slowest rings
set a step's pace), the intra-node alpha otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..parallel4d.perf_model import Network

#: The shipped descriptions, by name (``--network perlmutter``).
NETWORKS_DIR = Path(__file__).with_name("networks")
LEVELS = ("intra_node", "inter_node")


class PlanError(ValueError):
    """A planner input that cannot be used, or a world with no feasible layout."""


@dataclass(frozen=True)
class Machine:
    """What the planner knows of a machine (see the module docstring)."""

    name: str
    gpus_per_node: int | None
    latency: dict[str, float]      # seconds per level
    bandwidth: dict[str, float]    # bytes per second per level
    memory_per_gpu: float | None = None
    peak_flops: float | None = None
    sources: tuple[str, ...] = ()

    def network(self, world_size: int, gpus_per_node: int) -> Network:
        """The 4D model's ``Network`` for a world of ``world_size`` ranks."""
        level = "inter_node" if world_size > gpus_per_node else "intra_node"
        return Network(gpus_per_node, intra_node_bandwidth=self.bandwidth["intra_node"],
                       inter_node_bandwidth=self.bandwidth["inter_node"],
                       latency=self.latency[level])


def shipped() -> list[str]:
    return sorted(p.stem for p in NETWORKS_DIR.glob("*.json"))


def load_machine(spec: str) -> Machine:
    """``spec``: a shipped name, a JSON file, or ``ALPHA_US,GBPS:ALPHA_US,GBPS``."""
    path = NETWORKS_DIR / f"{spec}.json"
    if not path.is_file():
        path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        return _from_json(path)
    return _from_pairs(spec)


def _from_pairs(spec: str) -> Machine:
    parts = spec.split(":")
    try:
        pairs = [tuple(float(v) for v in part.split(",")) for part in parts]
    except ValueError:
        pairs = []
    if len(pairs) != 2 or any(len(p) != 2 or p[0] < 0 or p[1] <= 0 for p in pairs):
        raise PlanError(f"--network {spec!r}: expected a shipped name ({', '.join(shipped())}), "
                        "a JSON file, or ALPHA_US,GBPS:ALPHA_US,GBPS (latency in "
                        "microseconds >= 0 and bandwidth in GB/s > 0, inside a node then "
                        "between nodes), e.g. 5,100:10,100")
    return Machine(spec, None, {lv: a / 1e6 for lv, (a, _) in zip(LEVELS, pairs, strict=True)},
                   {lv: b * 1e9 for lv, (_, b) in zip(LEVELS, pairs, strict=True)})


def _from_json(path: Path) -> Machine:
    try:
        d = json.loads(path.read_text())
        levels = d["levels"]
        latency = {lv: float(levels[lv]["latency_us"]) / 1e6 for lv in LEVELS}
        bandwidth = {lv: float(levels[lv]["bandwidth_GBps"]) * 1e9 for lv in LEVELS}
        gpus = d.get("gpus_per_node")
        memory = d.get("memory_per_gpu_bytes")
        peak = d.get("peak_flops_per_gpu")
        sources = tuple(d.get("sources", ()))
    except FileNotFoundError:
        raise PlanError(f"--network {str(path)!r}: no such file and not a shipped network "
                        f"({', '.join(shipped())})") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"--network {str(path)!r}: not a network description ({e!r}); "
                        "expected JSON with levels.intra_node and levels.inter_node, each "
                        "{latency_us, bandwidth_GBps} (see training/plan/networks/)") from None
    if any(v < 0 for v in latency.values()) or any(v <= 0 for v in bandwidth.values()):
        raise PlanError(f"--network {str(path)!r}: latencies must be >= 0 and bandwidths > 0")
    return Machine(d.get("name", path.stem), None if gpus is None else int(gpus), latency,
                   bandwidth, None if memory is None else float(memory),
                   None if peak is None else float(peak), sources)
