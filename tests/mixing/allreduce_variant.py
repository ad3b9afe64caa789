"""all_gather / reduce_scatter on the "allreduce" variant (the blocking MPI_Allreduce of
the whole buffer), forced on the world and a sub-group, checked against torch: every
dtype, odd sizes, list output, async, in-place input, AVG; the input left intact; the
variant each call ran. Prints "rank R: ok N" or raises. Run under mpiexec (2 or 3 ranks)."""

import os
import sys

import torch

import mcrdl
import mcrdl.api

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dist"))
from _ref import avg_rtol  # noqa: E402

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.bool)


def piece(q: int, per: int, dt) -> torch.Tensor:
    if dt == torch.bool:
        return torch.arange(per) % (q + 2) == 0
    return ((torch.arange(per) * 3 + 17 * q) % 101).to(dt)


def main() -> None:
    mcrdl.init(["mpi"])
    backend = mcrdl.api.current_runtime().backend("mpi")
    rank, n = mcrdl.get_rank(), mcrdl.get_size()
    sub = mcrdl.new_group([0, 1])
    checks = 0
    with backend.variant("all_gather", "allreduce"), \
            backend.variant("reduce_scatter", "allreduce"):
        for comm in (backend._world, backend._comms[sub.id] if rank < 2 else None):
            if comm is not None:
                assert comm.variant("all_gather", 1 << 30) == 2, "forced for every size"
                assert comm.variant("reduce_scatter", 8) == 2
        before = backend._world.blocking_calls
        for group in (None, sub):
            if group is not None and rank >= 2:
                continue
            r, g = (rank, n) if group is None else (sub.rank, sub.size)
            for dt in DTYPES:
                for per in (1, 3, 8, 1001):
                    ref = torch.cat([piece(q, per, dt) for q in range(g)])
                    mine = piece(r, per, dt)
                    kept = mine.clone()
                    out = torch.full((per * g,), 5).to(dt)
                    mcrdl.all_gather("mpi", out, mine, group=group)
                    assert torch.equal(out, ref), (dt, per, out, ref)
                    assert torch.equal(mine, kept)
                    # rank 0's output a view 1 element off its storage: not aligned for
                    # the OR's words where the other ranks' are (every rank must still
                    # pass MPI the same datatype and count)
                    store = torch.full((per * g + 1,), 5).to(dt)
                    view = store[1:] if r == 0 else store[:-1]
                    mcrdl.all_gather("mpi", view, mine, group=group)
                    assert torch.equal(view, ref), (dt, per, "view")
                    lst = [torch.empty(per, dtype=dt) for _ in range(g)]
                    mcrdl.all_gather("mpi", lst, mine, group=group, async_op=True).wait()
                    assert torch.equal(torch.cat(lst), ref), (dt, per)
                    inplace = ref.clone()
                    inplace[r * per:(r + 1) * per] = mine
                    mcrdl.all_gather("mpi", inplace, inplace[r * per:(r + 1) * per],
                                     group=group)
                    assert torch.equal(inplace, ref), (dt, per)
                    checks += 4
                    if dt == torch.bool:
                        continue
                    inp = torch.cat([piece(r + k, per, dt) for k in range(g)])
                    sent = inp.clone()
                    total = sum(torch.cat([piece(q + k, per, dt) for k in range(g)]).double()
                                for q in range(g))
                    o = torch.empty(per, dtype=dt)
                    mcrdl.reduce_scatter("mpi", o, inp, group=group)
                    assert torch.equal(o, total[r * per:(r + 1) * per].to(dt)), (dt, per)
                    assert torch.equal(inp, sent)
                    if dt.is_floating_point:
                        mcrdl.reduce_scatter("mpi", o, [inp[k * per:(k + 1) * per]
                                                        for k in range(g)],
                                             op=mcrdl.ReduceOp.AVG, group=group)
                        want = total[r * per:(r + 1) * per] / g
                        # the sum is exact; the division rounds (tests/dist/_ref.py)
                        rtol = avg_rtol(str(dt).removeprefix("torch."))
                        assert torch.allclose(o.double(), want, rtol=rtol, atol=0), (dt, per)
                    checks += 2
        assert backend._world.blocking_calls > before
    # after the block, the chosen steps again (MCRDL_MPI_BLOCKING=never: nonblocking)
    assert backend._world.variant("all_gather", 8) == 0
    os.write(1, f"rank {rank}: ok {checks}\n".encode())  # one write: lines stay whole
    mcrdl.finalize()


if __name__ == "__main__":
    main()
