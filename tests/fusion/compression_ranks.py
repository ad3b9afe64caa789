"""zfp compression on a real multi-rank world (run on every rank under mpiexec -n 3).

For each backend (mpi, gloo), mode (fixed rate, precision, accuracy), data kind (random
normals, a smooth field) and dtype (float32, float64): every compressed operation -
all_gather (tensor and list outputs), gather, scatter, bcast, all_to_all_single (uneven
splits), all_to_all, send/recv, all_reduce (SUM, MAX) - async and blocking, with every
received value checked against the sender's original (each rank rebuilds every input
from a shared seed) under the mode's zfp guarantee (see zfp_checks.py): accuracy, the
tolerance (n x tolerance for a SUM of n ranks); precision, the per-block bound; rate,
the exact size on the wire. Other dtypes pass through exactly; fusion and compression
combine. Prints the bytes on the wire / uncompressed per mode; exits non-zero on a
failure.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import zfp_checks

import mcrdl
from mcrdl.extensions import compression_stats


def _abort_on_error(exc_type, exc, tb):
    """An uncaught error ends the whole job at once (the other ranks would wait)."""
    sys.__excepthook__(exc_type, exc, tb)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


sys.excepthook = _abort_on_error

mcrdl.init(["mpi", "gloo"], timeout=60)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
MODES = {"rate": {"mode": "rate", "rate": 8}, "precision": {"mode": "precision", "precision": 16},
         "accuracy": {"mode": "accuracy", "tolerance": 1e-3}}
# each mode's parameter of zfp_checks.block_bounds
BOUND = {"rate": 8, "precision": 16, "accuracy": 1e-3}
SHAPE = (24, 40)  # 2-D: zfp compresses it in 4x4 blocks
failures: list[str] = []


def data(kind: str, r: int, dtype, shape=SHAPE, salt: int = 0) -> np.ndarray:
    if kind == "smooth":
        return (zfp_checks.smooth_data(shape, dtype) * (1 + r) + salt).astype(dtype)
    return zfp_checks.random_data(shape, dtype, 1000 * salt + r)


def check(what: str, mode: str, orig: np.ndarray, got: torch.Tensor) -> None:
    """`got` is `orig` sent compressed: within the mode's bound of each value's block."""
    check_reduced(what, mode, [orig], None, got)


def check_reduced(what: str, mode: str, parts: list, op, got: torch.Tensor) -> None:
    """`got` is the reduction by `op` (SUM, MAX; None: the one part itself) of `parts`,
    each sent compressed: per value, within the sum (SUM) or the largest (MAX) of the
    parts' bounds at that value (zfp_checks.block_bounds), plus the rounding of a sum in
    the tensor's dtype. A result missing a rank's part is further off than that."""
    stack = np.stack(parts).astype(np.float64)
    bounds = np.stack([zfp_checks.block_bounds(p, mode, BOUND[mode]) for p in parts])
    if op == mcrdl.ReduceOp.SUM:
        expect, allowed = stack.sum(0), bounds.sum(0)
        allowed = allowed + 4 * np.finfo(parts[0].dtype).eps * np.abs(stack).sum(0)
    else:
        expect, allowed = stack.max(0), bounds.max(0)
    err = np.abs(got.numpy().reshape(expect.shape).astype(np.float64) - expect)
    if expect.size and bool((err > allowed * (1 + 1e-6)).any()):
        worst = np.unravel_index(int(np.argmax(err - allowed)), err.shape)
        failures.append(f"{what}: error {err[worst]:.3g} above its bound {allowed[worst]:.3g} "
                        f"at {tuple(int(i) for i in worst)} ({mode})")


def run_ops(b: str, mode: str, kind: str, dtype, async_op: bool) -> None:
    tdt = torch.from_numpy(np.zeros(1, dtype)).dtype
    tag = f"{b} {mode} {kind} {np.dtype(dtype).name} async={async_op}"
    mine = [data(kind, r, dtype) for r in range(size)]
    x = torch.from_numpy(mine[rank].copy())

    def done(w):
        if async_op:
            w.wait()

    # all_gather, tensor and list outputs
    out = torch.empty((size, *SHAPE), dtype=tdt)
    done(mcrdl.all_gather(b, out, x, async_op=async_op))
    outs = [torch.empty(SHAPE, dtype=tdt) for _ in range(size)]
    done(mcrdl.all_gather(b, outs, x, async_op=async_op))
    for r in range(size):
        check(f"{tag} all_gather from {r}", mode, mine[r], out[r])
        check(f"{tag} all_gather(list) from {r}", mode, mine[r], outs[r])
    # gather to the last rank
    dst = size - 1
    g = torch.empty((size, *SHAPE), dtype=tdt) if rank == dst else None
    done(mcrdl.gather(b, g, x, dst=dst, async_op=async_op))
    if rank == dst:
        for r in range(size):
            check(f"{tag} gather from {r}", mode, mine[r], g[r])
    # scatter from rank 1
    blocks = [data(kind, r, dtype, salt=3) for r in range(size)]
    src_in = torch.from_numpy(np.stack(blocks)) if rank == 1 else None
    so = torch.empty(SHAPE, dtype=tdt)
    done(mcrdl.scatter(b, so, src_in, src=1, async_op=async_op))
    check(f"{tag} scatter", mode, blocks[rank], so)
    # bcast from rank 2 (every rank, the root too, ends with the same bits)
    bt = torch.from_numpy(mine[2].copy()) if rank == 2 else torch.zeros(SHAPE, dtype=tdt)
    done(mcrdl.bcast(b, bt, src=2, async_op=async_op))
    check(f"{tag} bcast", mode, mine[2], bt)
    views = mcrdl.all_gather_object(bt.numpy().tobytes())
    if len(set(views)) != 1:
        failures.append(f"{tag} bcast: ranks hold different bits after the bcast")
    # all_to_all_single with uneven splits: rank r sends (j + r) % 3 + 1 rows to rank j
    rows = [[(j + r) % 3 + 1 for j in range(size)] for r in range(size)]
    width = SHAPE[1]
    full = [data(kind, r, dtype, shape=(sum(rows[r]), width), salt=5) for r in range(size)]
    recv_rows = [rows[r][rank] for r in range(size)]
    a_out = torch.empty((sum(recv_rows), width), dtype=tdt)
    done(mcrdl.all_to_all_single(b, a_out, torch.from_numpy(full[rank].copy()), recv_rows,
                                 rows[rank], async_op=async_op))
    start = 0
    for r in range(size):
        off = sum(rows[r][:rank])
        check(f"{tag} all_to_all_single from {r}", mode, full[r][off:off + recv_rows[r]],
              a_out[start:start + recv_rows[r]])
        start += recv_rows[r]
    # all_to_all of lists
    ins = [torch.from_numpy(data(kind, rank, dtype, salt=7 + j)) for j in range(size)]
    a2 = [torch.empty(SHAPE, dtype=tdt) for _ in range(size)]
    done(mcrdl.all_to_all(b, a2, ins, async_op=async_op))
    for r in range(size):
        check(f"{tag} all_to_all from {r}", mode, data(kind, r, dtype, salt=7 + rank), a2[r])
    # send/recv around a ring
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    rb = torch.empty(SHAPE, dtype=tdt)
    ws = mcrdl.send(b, x, dst=nxt, tag=5, async_op=True)
    done(mcrdl.recv(b, rb, src=prv, tag=5, async_op=async_op))
    ws.wait()
    check(f"{tag} recv from {prv}", mode, mine[prv], rb)
    # all_reduce SUM and MAX: compressed all-gather, then a local reduction
    for op in (mcrdl.ReduceOp.SUM, mcrdl.ReduceOp.MAX):
        t = torch.from_numpy(mine[rank].copy())
        done(mcrdl.all_reduce(b, t, op=op, async_op=async_op))
        check_reduced(f"{tag} all_reduce {op.name}", mode, mine, op, t)


ratios: dict[tuple, tuple[int, int]] = {}
for mode, settings in MODES.items():
    with mcrdl.extensions(compression=settings):
        for kind in ("random", "smooth"):
            compression_stats(reset=True)
            for b in ("mpi", "gloo"):
                for dtype in (np.float32, np.float64):
                    run_ops(b, mode, kind, dtype, async_op=(dtype == np.float32) == (b == "mpi"))
            total = compression_stats()["total"]
            ratios[(mode, kind)] = (total["raw_bytes"], total["wire_bytes"])

# fixed rate: the exact size on the wire (1 tag byte + zfp stream + 8-byte size)
with mcrdl.extensions(compression=MODES["rate"]):
    compression_stats(reset=True)
    mcrdl.all_gather("mpi", torch.empty((size, *SHAPE)),
                     torch.from_numpy(data("random", rank, np.float32)))
    got = compression_stats()["all_gather"]["wire_bytes"]
    want = 1 + zfp_checks.rate_bytes(SHAPE, 8, 4) + 8
    if got != want:
        failures.append(f"fixed rate: {got} bytes on the wire, expected {want}")
    # other dtypes pass through exactly
    for dt in (torch.int32, torch.float16, torch.bfloat16):
        x = (torch.arange(50) * (rank + 1)).to(dt)
        out = torch.empty(size * 50, dtype=dt)
        mcrdl.all_gather("gloo", out, x)
        expect = torch.cat([(torch.arange(50) * (r + 1)).to(dt) for r in range(size)])
        if not torch.equal(out, expect):
            failures.append(f"{dt} all_gather with compression on is not exact")
    if compression_stats()["all_gather"]["calls"] != 1:
        failures.append("int32/float16/bfloat16 calls were counted as compressed")

# synchronize() completes async compressed calls: the values reach the tensors
with mcrdl.extensions(compression=MODES["accuracy"]):
    outs = [torch.full((size, 30), -1.0) for _ in range(4)]
    for k, o in enumerate(outs):
        mcrdl.all_gather("gloo" if k % 2 else "mpi", o, torch.full((30,), float(rank + k)),
                         async_op=True)
    mcrdl.synchronize()
    for k, o in enumerate(outs):
        want = torch.tensor([float(r + k) for r in range(size)]).unsqueeze(1)
        if float((o - want).abs().max()) > 1e-3:
            failures.append(f"synchronize() left compressed all_gather {k} incomplete")

# fusion and compression together: fused all_reduces compressed as one call
with mcrdl.extensions(fusion=True, compression=MODES["accuracy"]):
    ts = [torch.full((k + 10,), 0.1 * (rank + 1) * (k + 1)) for k in range(30)]
    works = [mcrdl.all_reduce("mpi", t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    for k, t in enumerate(ts):
        exact = 0.1 * (k + 1) * sum(range(1, size + 1))
        if float((t - exact).abs().max()) > size * 1e-3:
            failures.append(f"fused + compressed all_reduce {k}: wrong result")
    # fused bcasts (lossy rate): the root too ends with the decompressed bits
    gen = torch.Generator().manual_seed(5)
    bs = [torch.randn(64 + k, generator=gen) for k in range(4)]
    with mcrdl.extensions(compression=MODES["rate"]):
        works = [mcrdl.bcast("mpi", t, src=1, async_op=True) for t in bs]
        for w in works:
            w.wait()
    views = mcrdl.all_gather_object([t.numpy().tobytes() for t in bs])
    if any(v != views[0] for v in views):
        failures.append("fused + compressed bcast: the root's bits differ from the others'")

# a compressed recv, then an uncompressed one from the same source and tag: the second
# may not overtake the first (it had received the first one's size message)
with mcrdl.extensions(compression=MODES["accuracy"]):
    if rank == 0:
        mcrdl.send("mpi", torch.full((64,), 1.5), dst=1, tag=5)
        mcrdl.send("mpi", torch.full((3,), 7, dtype=torch.int64), dst=1, tag=5)
    elif rank == 1:
        fl, it = torch.zeros(64), torch.zeros(3, dtype=torch.int64)
        w = mcrdl.recv("mpi", fl, src=0, tag=5, async_op=True)
        try:
            mcrdl.recv("mpi", it, src=0, tag=5)
            w.wait()
            if not (torch.all(fl == 1.5) and torch.all(it == 7)):
                failures.append(f"recv order: got {fl[:2].tolist()} and {it.tolist()}")
        except mcrdl.MCRDLError as e:
            failures.append(f"recv order: {type(e).__name__}: {e}")

views = mcrdl.all_gather_object((ratios, failures))
if rank == 0:
    print(f"# compressed bytes on the wire / uncompressed bytes, {size} ranks, every "
          "compressed op on mpi and gloo, float32 and float64, tensors of 24x40 values; "
          "wire = zfp blocks + tag byte + 8-byte sizes")
    print(f"{'mode':<10} {'data':<7} {'raw(B)':>10} {'wire(B)':>10} {'wire/raw':>9}")
    for key in ratios:
        raw = sum(v[0][key][0] for v in views)
        wire = sum(v[0][key][1] for v in views)
        print(f"{key[0]:<10} {key[1]:<7} {raw:>10} {wire:>10}  wire/raw {wire / raw:.4f}")
    bad = [f"rank {r}: {f}" for r, v in enumerate(views) for f in v[1]]
    if bad:
        print(f"compression FAILED ({len(bad)}):\n" + "\n".join(bad[:40]))
    else:
        print("compression OK: every op within its mode's zfp bound on every rank; fixed rate "
              "exact on the wire; other dtypes exact; synchronize; fusion + compression")
ok = not any(v[1] for v in views)
mcrdl.finalize()
sys.exit(0 if ok else 1)
