"""How the c10d backends call their process group, checked on Gloo in a world of one (a
fresh interpreter, no mpiexec): every op passes the call's ``asyncOp`` in its options as
torch.distributed's own functions do (NCCL runs a blocking call on the caller's stream
then), a blocking call survives a library that returns no work for it (NCCL's answer to
``asyncOp=False``), the cached options carry the values of each call, and the cached
reduction rules are ops.reduce_plan's.
"""

from __future__ import annotations

import textwrap

import pytest

from ._launch import fresh_probe

_SCRIPT = textwrap.dedent(r'''
    import json
    import torch
    import torch.distributed as dist
    import mcrdl, mcrdl.api
    from mcrdl.backends.c10d import _BOOL_OP, _TORCH_OP
    from mcrdl.ops import reduce_plan

    mcrdl.init(["gloo"])
    be = mcrdl.api.current_runtime().backend("gloo")
    g = be._group(None)
    real = g.pg
    calls = []

    class NoWorkWhenBlocking:
        """The process group, recording each call's asyncOp; a blocking call's work is
        waited here and None returned, as ProcessGroupNCCL does for asyncOp=False."""
        def __getattr__(self, name):
            fn = getattr(real, name)
            if not callable(fn):
                return fn
            def call(*args):
                opts = [a for a in args if hasattr(a, "asyncOp")]
                calls.append([name, [o.asyncOp for o in opts]])
                work = fn(*args)
                if opts and not opts[0].asyncOp:
                    work.wait()
                    return None
                return work
            return call

    g.pg = NoWorkWhenBlocking()
    res = {}
    x = torch.arange(6, dtype=torch.float32)
    for async_op in (False, True):
        calls.clear()
        out = []
        def done(w):
            if async_op:
                w.wait()
        t = x.clone()
        done(mcrdl.all_reduce("gloo", t, op=mcrdl.ReduceOp.AVG, async_op=async_op))
        out.append(torch.equal(t, x))
        t = x.clone()
        done(mcrdl.bcast("gloo", t, 0, async_op=async_op))
        out.append(torch.equal(t, x))
        t = x.clone()
        done(mcrdl.reduce("gloo", t, 0, async_op=async_op))
        out.append(torch.equal(t, x))
        o = torch.empty(6)
        done(mcrdl.all_gather("gloo", o, x, async_op=async_op))
        out.append(torch.equal(o, x))
        o = torch.empty(6)
        done(mcrdl.reduce_scatter("gloo", o, x.clone(), async_op=async_op))
        out.append(torch.equal(o, x))
        o = torch.empty(6)
        done(mcrdl.all_to_all_single("gloo", o, x, async_op=async_op))
        out.append(torch.equal(o, x))
        o = torch.empty(6)
        done(mcrdl.gather("gloo", o, x, 0, async_op=async_op))
        out.append(torch.equal(o, x))
        o = torch.empty(6)
        done(mcrdl.scatter("gloo", o, x, 0, async_op=async_op))
        out.append(torch.equal(o, x))
        o = torch.empty(6)
        done(mcrdl.all_gatherv("gloo", o, x, [6], async_op=async_op))
        out.append(torch.equal(o, x))
        done(mcrdl.barrier("gloo", async_op=async_op))
        res[f"async={async_op}"] = {"results": out, "calls": list(calls)}

    # cached options: one object per value, with the values of the call
    a = be._opts(dist.BroadcastOptions, False, root=3)
    b = be._opts(dist.BroadcastOptions, False, root=3)
    c = be._opts(dist.BroadcastOptions, True, root=5)
    _, rule = be._reduce_args(x, mcrdl.ReduceOp.MAX)
    d = be._opts(dist.ReduceOptions, True, rule, 2)
    e = be._opts(dist.ReduceOptions, True, rule, 2)
    f = be._opts(dist.BarrierOptions, False, device_ids=(0,))
    res["opts"] = [a is b, a is not c, a.rootRank, a.asyncOp, c.rootRank, c.asyncOp,
                   d is e, d.rootRank, d.reduceOp == dist.ReduceOp.MAX, d.asyncOp, f.device_ids]

    # cached reduction rules against reduce_plan, every dtype and op (twice: cold, cached)
    bad = []
    dtypes = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]
    for _ in range(2):
        for dt in dtypes:
            for op in mcrdl.ReduceOp:
                if dt == torch.bool and op == mcrdl.ReduceOp.AVG:
                    continue
                if dt.is_floating_point and op in (mcrdl.ReduceOp.BAND, mcrdl.ReduceOp.BOR,
                                                   mcrdl.ReduceOp.BXOR):
                    continue
                t = torch.zeros(3, dtype=dt)
                buf, rule = be._reduce_args(t, op)
                top, avg = rule.top, rule.average
                p = reduce_plan(dt, op, native_avg=be.native_avg, native_half=True)
                want = (_BOOL_OP if dt == torch.bool else _TORCH_OP)[p.op]
                same = buf.data_ptr() == t.data_ptr()
                if (buf.dtype, top, avg) != (p.dtype, want, p.average) or (
                        same != (p.dtype == dt or dt == torch.bool)):
                    bad.append(f"{dt} {op}")
    res["rules_bad"] = bad
    mcrdl.finalize()
    print("@@RESULT@@" + json.dumps(res))
''')


@pytest.fixture(scope="module")
def report() -> dict:
    return fresh_probe(_SCRIPT)


@pytest.mark.parametrize("async_op", [False, True])
def test_every_op_passes_the_calls_async_op(report, async_op):
    r = report[f"async={async_op}"]
    assert all(r["results"]), r
    names = [name for name, _ in r["calls"]]
    # one library call per op, each with options saying whether the call is async
    assert len(names) == 10, r["calls"]
    for name, flags in r["calls"]:
        assert flags == [async_op], (name, flags)


def test_blocking_calls_accept_no_work_from_the_library(report):
    # the blocking pass above ran through a process group that returned None for every
    # blocking call (its results were checked): nothing was waited on twice or lost
    assert all(report["async=False"]["results"])


def test_cached_options_carry_each_calls_values(report):
    assert report["opts"] == [True, True, 3, False, 5, True,
                              True, 2, True, True, [0]], report["opts"]


def test_cached_reduction_rules_are_reduce_plans(report):
    assert report["rules_bad"] == []
