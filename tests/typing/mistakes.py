"""Typical mistakes in calls of mcrdl's operations, one a line, each marked by a comment
that starts with "# mistake": tests/test_typing.py expects pyright and mypy to report an
error on each marked line and on no other. Never run (it would fail at run time)."""

from __future__ import annotations

import torch

import mcrdl


def mistakes(blocks: torch.Tensor, t: torch.Tensor) -> None:
    mcrdl.all_reduce("mpi", t, opp=1)  # mistake: a misspelled keyword
    mcrdl.all_gather("mpi", blocks)  # mistake: the input tensor is missing
    mcrdl.reduce("mpi", t, op="sum")  # mistake: a str where a ReduceOp goes
    mcrdl.bcast("mpi", t, async_op=True).wait()  # right: an async call returns a Work
    mcrdl.all_reduce("mpi", t).wait()  # mistake: a blocking call returns None, not a Work
    mcrdl.send("mpi", t)  # mistake: send needs its destination rank
    mcrdl.gatherv("mpi", blocks, t, counts=3)  # mistake: counts is one count per rank
