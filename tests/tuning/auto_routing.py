"""Run on every rank (mpiexec -n 3): "auto" follows a crafted tuning table.

The table says: mpi wins all_reduce up to 1 KiB and gloo above; gloo wins all_gather
everywhere at 3 ranks; pccl wins reduce_scatter; gloo wins the all_to_alls up to about
16 KiB and mpi above. Async works report the backend that ran them. An uneven exchange
(each rank its own bytes) goes where the table puts the largest messages on every rank:
routed by each rank's own bytes, rank 0 (4 B a peer) would pick gloo and rank 2 (16 KiB
a peer) mpi, and the call would never meet."""

import sys

import torch

import mcrdl

mcrdl.init(["mpi", "gloo", "pccl"], tuning_table=sys.argv[1])
n = mcrdl.get_size()
small, large = torch.ones(16), torch.ones(4096)  # 64 B and 16 KiB
w = mcrdl.all_reduce("auto", small, async_op=True)
w.wait()
assert w.backend == "mpi", w.backend
w = mcrdl.all_reduce("auto", large, async_op=True)
w.wait()
assert w.backend == "gloo", w.backend
assert torch.all(small == n) and torch.all(large == n)
out = torch.empty(4 * n)
w = mcrdl.all_gather("auto", out, torch.ones(4), async_op=True)
w.wait()
assert w.backend == "gloo", w.backend
piece = torch.empty(4)
w = mcrdl.reduce_scatter("auto", piece, torch.ones(4 * n), async_op=True)
w.wait()
assert w.backend == "pccl", w.backend
assert torch.all(piece == n), piece
w = mcrdl.bcast("auto", small, async_op=True)  # no data for bcast: the fixed rule ("mpi")
w.wait()
assert w.backend == "mpi", w.backend
rank = mcrdl.get_rank()
out = torch.empty(4 * n)  # an even exchange (64 B a rank) goes by its bytes
w = mcrdl.all_to_all_single("auto", out, torch.full((4 * n,), float(rank)), async_op=True)
w.wait()
assert w.backend == "gloo", w.backend
assert torch.equal(out, torch.arange(n).repeat_interleave(4).float()), out
per = [1, 1024, 4096][:n]  # rank r sends per[r] floats to each rank
expected = torch.cat([torch.full((k,), float(r)) for r, k in enumerate(per)])
out = torch.empty(sum(per))
w = mcrdl.all_to_all_single("auto", out, torch.full((per[rank] * n,), float(rank)),
                            output_split_sizes=per, input_split_sizes=[per[rank]] * n,
                            async_op=True)
w.wait()
assert w.backend == "mpi", w.backend
assert torch.equal(out, expected), out
outs = [torch.empty(k) for k in per]
w = mcrdl.all_to_all("auto", outs, [torch.full((per[rank],), float(rank))] * n, async_op=True)
w.wait()
assert w.backend == "mpi", w.backend
assert torch.equal(torch.cat(outs), expected)
mcrdl.init(["mpi"])  # a later init without a table keeps routing by this one
w = mcrdl.all_reduce("auto", large, async_op=True)
w.wait()
assert w.backend == "gloo", w.backend
try:  # bad arguments still raise the right error through "auto"
    mcrdl.all_reduce("auto", torch.ones(4, 2).t())
    raise AssertionError("no error")
except mcrdl.InvalidArgumentError:
    pass
mcrdl.finalize()

# Every rank must route by the same table. Tables given by path that differ: init refuses
# on every rank. Tables each rank found by itself (the shipped one for its host) that
# differ: rank 0's is used everywhere.
from mcrdl.extensions import auto  # noqa: E402
from mcrdl.tuning.table import TuningTable  # noqa: E402

mine = TuningTable.load(sys.argv[1])
for size in (8, 64, 1024):  # rank 0: mpi wins small all_reduces; the others: gloo does
    mine.add("all_reduce", n, "mpi", size, 1e-6 if rank == 0 else 9.0)
own = f"{sys.argv[1]}.rank{rank}.json"
mine.save(own)
try:
    mcrdl.init(["mpi", "gloo"], tuning_table=own)
    raise AssertionError("ranks with different tables were not refused")
except mcrdl.DesyncError as e:
    assert "tuning table" in str(e) and "same file" in str(e), e
mcrdl.finalize()
auto.load_table = lambda path: TuningTable.load(own) if path is None else None
mcrdl.init(["mpi", "gloo"])
w = mcrdl.all_reduce("auto", torch.ones(2), async_op=True)
w.wait()
assert w.backend == "mpi", w.backend  # rank 0's table, on every rank
mcrdl.finalize()
print("auto routing OK")
