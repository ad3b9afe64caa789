"""mcrdl-info: what this process can use: every backend, available or not and why, the
launcher's view (rank, size, ranks per node), the CPUs its node's ranks spread over (as
the mpi backend judges oversubscription before init), and the libraries.

    mcrdl-info                 # one process
    mpiexec -n 4 mcrdl-info    # rank 0 prints; the launch is detected as MPI
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys


def collect() -> dict:
    import torch

    from mcrdl import __version__
    from mcrdl.backends import registry
    from mcrdl.launch import (
        detect,
        node_cores_for_ranks,
        node_cpus,
        oversubscribed,
        usable_cores,
    )

    launch = detect()
    backends = {}
    for name, why in registry.availability(launch).items():
        entry = {"available": why is None, "why": why}
        if why is None:
            try:
                cls = registry.backend_class(name)
                caps = cls.capabilities
                entry["ops"] = len(cls.supported_ops())
                entry["devices"] = sorted(caps.devices)
                entry["stream_aware"] = caps.stream_aware
            except Exception as exc:  # a broken plug-in still gets listed
                entry["why"] = f"class does not load: {exc}"
        backends[name] = entry
    mpi, selection = "", ""
    if launch.mpi_world:
        try:
            from mcrdl.bootstrap import mpi_module
            from mcrdl.tuning.provenance import mpich_coll_selection

            mpi = " ".join(mpi_module().Get_library_version().strip().splitlines()[0].split())
            selection = mpich_coll_selection() if "MPICH" in mpi else ""
        except Exception as exc:
            mpi = f"does not load: {exc}"
    spread = node_cores_for_ranks()
    return {
        "mcrdl": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available() and torch.cuda.get_device_name(0) or "",
        "mpi": mpi,
        "launcher": launch.launcher,
        "rank": launch.rank,
        "size": launch.size,
        "local_size": launch.local_size,
        "ranks_per_node_override": os.environ.get("MCRDL_RANKS_PER_NODE", ""),
        # what the mpi backend assumes before init (launch.node_cores_for_ranks; init
        # then compares every rank's mask)
        "cpus": {"mask": usable_cores(), "node": node_cpus(), "ranks_spread_over": spread,
                 "oversubscribed": oversubscribed(launch.local_size, spread)},
        "mpich_coll_selection": selection,
        "backends": backends,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mcrdl-info", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    info = collect()
    if info["rank"] != 0:
        return 0
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"mcrdl {info['mcrdl']}  python {info['python']}  torch {info['torch']}")
    print(f"MPI: {info['mpi'] or '(not loaded: no MPI launch)'}")
    print(f"GPU: {info['cuda'] or 'none'}")
    rpn = info["ranks_per_node_override"]
    print(f"launch: {info['launcher']}, {info['size']} ranks, {info['local_size']} on this node"
          + (f" (MCRDL_RANKS_PER_NODE={rpn})" if rpn else ""))
    c = info["cpus"]
    print(f"cpus: {c['mask']} in this rank's affinity mask, {c['node']} for the job on this node; "
          f"its {info['local_size']} rank(s) spread over {c['ranks_spread_over']}: "
          + ("oversubscribed (waiters yield and sleep; the shipped blocking steps give way "
             "to nonblocking calls)"
             if c["oversubscribed"] else "a core each or more"))
    if info["mpich_coll_selection"]:
        print(f"MPICH shared-memory collective selection: {info['mpich_coll_selection']}")
    print(f"{'backend':<12} {'status':<12} details")
    for name, b in info["backends"].items():
        if b["available"] and not b.get("why"):
            detail = f"{b['ops']} ops on {', '.join(b['devices'])}" + (
                ", stream-aware" if b.get("stream_aware") else "")
            print(f"{name:<12} {'available':<12} {detail}")
        else:
            print(f"{name:<12} {'unavailable':<12} {b['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
