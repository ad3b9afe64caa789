"""Host cost of mcrdl's "nccl" path over torch's own ProcessGroupNCCL, one GPU rank.

At world size 1 NCCL moves no data between GPUs, so the time per call is what the host
spends issuing it (Python front, routing, the backend's stream/event ordering, the Work
object, c10d itself) plus a kernel that a busy stream hides. Each variant issues
``--calls`` back-to-back calls on the same tensors, then one ``torch.cuda.synchronize``;
the figure is that wall time / calls, the best of ``--repeats`` (variants interleaved).

    mpiexec -n 1 python benchmarks/nccl_overhead.py            # needs a CUDA GPU

Variants: ``c10d``: ``dist.all_reduce`` / ``dist.all_gather_into_tensor`` on a
ProcessGroupNCCL of its own; ``mcrdl``: ``mcrdl.all_reduce("nccl", ...)`` and
``mcrdl.all_gather("nccl", ...)`` blocking (the caller's stream waits on the op; the
host does not), and all_reduce ``async_op=True`` + ``wait()``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.distributed as dist

import mcrdl


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 4096, 1 << 20, 16 << 20],
                   help="bytes per call (float32)")
    p.add_argument("--calls", type=int, default=300, help="calls per timed batch")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per variant")
    return p.parse_args(argv)


def per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("nccl_overhead: no CUDA device visible (torch.cuda.is_available() "
                         "is False); run it on a GPU node")
    mcrdl.init(["nccl"])
    if mcrdl.get_size() != 1:
        raise SystemExit("nccl_overhead: run it with one rank (mpiexec -n 1): it measures "
                         "host cost, which other ranks' timing would blur")
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=dev)
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; us per call, best of "
          f"{args.repeats} x {args.calls} calls")
    names = ("c10d all_reduce", "mcrdl all_reduce", "mcrdl all_reduce async+wait",
             "c10d all_gather", "mcrdl all_gather")
    print(f"{'bytes':>10} " + " ".join(f"{n:>27}" for n in names)
          + f" {'+us all_reduce':>15} {'+us all_gather':>15}")
    for nbytes in args.sizes:
        t = torch.ones(max(1, nbytes // 4), device=dev)
        out = torch.empty_like(t)
        fns = (partial(dist.all_reduce, t),
               partial(mcrdl.all_reduce, "nccl", t),
               lambda t=t: mcrdl.all_reduce("nccl", t, async_op=True).wait(),
               partial(dist.all_gather_into_tensor, out, t),
               partial(mcrdl.all_gather, "nccl", out, t))
        for fn in fns:  # warm-up: NCCL's lazy communicator set-up, the allocator
            per_call_us(fn, 20)
        best = [float("inf")] * len(fns)
        for _ in range(args.repeats):
            for i, fn in enumerate(fns):
                best[i] = min(best[i], per_call_us(fn, args.calls))
        print(f"{nbytes:>10} " + " ".join(f"{b:>27.2f}" for b in best)
              + f" {best[1] - best[0]:>+15.2f} {best[4] - best[3]:>+15.2f}", flush=True)
    dist.destroy_process_group()
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
