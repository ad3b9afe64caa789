"""Run on every rank (mpiexec -n 2): which variant the mpi backend's blocking calls run,
observed through MpiComm.blocking_calls (the calls that ran the blocking MPI collective),
against the steps the test expects. argv[1] is a JSON list of sessions, each run as an
init/finalize of its own in this one process: {"env": {variable: value}, set before
init; "expected": {op: steps}} (steps as in a tuning table, [[largest bytes, blocking],
...]; ops not named: nonblocking). Calls go through "mpi" and "auto", on the world and
on a group of both ranks; the results are checked against the closed-form sums."""

import json
import os
import sys

import torch

import mcrdl
import mcrdl.api


def session(expected_steps: dict) -> int:
    mcrdl.init(["mpi"])
    rank, n = mcrdl.get_rank(), mcrdl.get_size()
    group = mcrdl.new_group(list(range(n)))
    backend = mcrdl.api.current_runtime().backend("mpi")

    def blocking(op: str, nbytes: int) -> bool:
        for hi, v in expected_steps.get(op, []):
            if hi < 0 or nbytes <= hi:
                return v
        return False

    total = n * (n + 1) / 2
    for name, g in (("world", None), ("group", group)):
        comm = backend.comm(g)
        for front in ("mpi", "auto"):
            for numel in (2, 64):  # 8 B and 256 B of float32
                before = comm.blocking_calls
                t = torch.full((numel,), float(rank + 1))
                mcrdl.all_reduce(front, t, group=g)
                assert torch.all(t == total), t
                ran = comm.blocking_calls - before
                assert ran == blocking("all_reduce", 4 * numel), (name, front, numel, ran)
            before = comm.blocking_calls
            t = torch.full((2,), float(rank))
            mcrdl.bcast(front, t, src=0, group=g)
            assert torch.all(t == 0), t
            assert comm.blocking_calls - before == blocking("bcast", 8), (name, front)
    mcrdl.finalize()
    return rank


for i, s in enumerate(json.loads(sys.argv[1])):
    saved = {var: os.environ.get(var) for var in s["env"]}
    os.environ.update(s["env"])
    rank = session(s["expected"])
    for var, value in saved.items():  # only these: init sets variables of its own
        if value is None:
            os.environ.pop(var)
        else:
            os.environ[var] = value
    print(f"rank {rank}: session {i}: variants as expected", flush=True)
