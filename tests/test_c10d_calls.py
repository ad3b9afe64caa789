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
import torch.distributed as dist

from ._launch import fresh_probe

pytestmark = pytest.mark.skipif(not hasattr(dist.AllreduceOptions(), "asyncOp"),
                                reason="this torch's c10d options have no asyncOp")

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

    OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")

    def op_name(o):
        return next((n for n in OPS if o.reduceOp == getattr(dist.ReduceOp, n)), "?")

    class NoWorkWhenBlocking:
        """The process group, recording each call's options (asyncOp, reduceOp,
        rootRank); a blocking call's work is waited here and None returned, as
        ProcessGroupNCCL does for asyncOp=False."""
        def __getattr__(self, name):
            fn = getattr(real, name)
            if not callable(fn):
                return fn
            def call(*args):
                opts = [a for a in args if hasattr(a, "asyncOp")]
                calls.append([name] + [[o.asyncOp, op_name(o) if hasattr(o, "reduceOp")
                                        else None, getattr(o, "rootRank", None)]
                                       for o in opts])
                work = fn(*args)
                if opts and not opts[0].asyncOp:
                    work.wait()
                    return None
                return work
            return call

    g.pg = NoWorkWhenBlocking()
    res = {}
    x = torch.arange(6, dtype=torch.float32)
    R = mcrdl.ReduceOp
    for async_op in (False, True):
        calls.clear()
        out = []
        def done(w):
            if async_op:
                w.wait()
        # the same options key but for the reduction: SUM, MAX, then SUM again, AVG
        for op in (R.SUM, R.MAX, R.SUM, R.AVG):
            t = x.clone()
            done(mcrdl.all_reduce("gloo", t, op=op, async_op=async_op))
            out.append(torch.equal(t, x))
        t = x.clone()
        done(mcrdl.bcast("gloo", t, 0, async_op=async_op))
        out.append(torch.equal(t, x))
        for op in (R.SUM, R.MIN):
            t = x.clone()
            done(mcrdl.reduce("gloo", t, 0, op=op, async_op=async_op))
            out.append(torch.equal(t, x))
        o = torch.empty(6)
        done(mcrdl.all_gather("gloo", o, x, async_op=async_op))
        out.append(torch.equal(o, x))
        ol = [torch.empty(6)]
        done(mcrdl.all_gather("gloo", ol, x, async_op=async_op))
        out.append(torch.equal(ol[0], x))
        for native in (False, True):  # Gloo's all_reduce fallback, the library's own op
            be.native_reduce_scatter = native
            for op in (R.SUM, R.MAX):
                o = torch.empty(6)
                done(mcrdl.reduce_scatter("gloo", o, x.clone(), op=op, async_op=async_op))
                out.append(torch.equal(o, x))
        be.native_reduce_scatter = False
        o = torch.empty(6)
        done(mcrdl.all_to_all_single("gloo", o, x, async_op=async_op))
        out.append(torch.equal(o, x))
        ol = [torch.empty(6)]
        done(mcrdl.all_to_all("gloo", ol, [x], async_op=async_op))
        out.append(torch.equal(ol[0], x))
        o = torch.empty(6)
        done(mcrdl.gather("gloo", o, x, 0, async_op=async_op))
        out.append(torch.equal(o, x))
        o = torch.empty(6)
        done(mcrdl.scatter("gloo", o, x, 0, async_op=async_op))
        out.append(torch.equal(o, x))
        for v in ("all_gatherv", "gatherv", "scatterv", "all_to_allv"):
            o = torch.empty(6)
            args = ([6], [6]) if v == "all_to_allv" else ([6],)
            done(getattr(mcrdl, v)("gloo", o, x, *args, async_op=async_op))
            out.append(torch.equal(o, x))
        done(mcrdl.barrier("gloo", async_op=async_op))
        res[f"async={async_op}"] = {"results": out, "calls": list(calls)}

    # NCCL's barrier options (a stub device: no GPU needed to build them)
    from types import SimpleNamespace
    from mcrdl.backends.nccl import NCCLBackend
    stub = SimpleNamespace(device=torch.device("cuda", 3), _opts=be._opts)
    nb = [NCCLBackend._barrier_options(stub, a) for a in (False, True, False)]
    res["nccl_barrier"] = [nb[0] is nb[2], nb[0] is not nb[1], nb[0].device_ids,
                           nb[0].asyncOp, nb[1].asyncOp]

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


#: The library calls of the probe's ops, in order: (method, reduceOp, rootRank) of each
#: call's options (reduceOp None: the options have none), for either asyncOp.
_EXPECTED = (
    [("allreduce", op, None) for op in ("SUM", "MAX", "SUM", "SUM")]  # AVG: SUM, divide
    + [("broadcast", None, 0), ("reduce", "SUM", 0), ("reduce", "MIN", 0),
       ("_allgather_base", None, None), ("allgather", None, None),
       ("allreduce", "SUM", None), ("allreduce", "MAX", None),  # Gloo's reduce_scatter
       ("_reduce_scatter_base", "SUM", None), ("_reduce_scatter_base", "MAX", None),
       ("alltoall_base", None, None), ("alltoall_base", None, None),
       ("gather", None, 0), ("scatter", None, 0)]
    + [("alltoall_base", None, None)] * 4 + [("barrier", None, None)])


@pytest.mark.parametrize("async_op", [False, True])
def test_every_op_passes_the_calls_options(report, async_op):
    """Each op's library call gets the call's asyncOp and its own reduceOp and root (a
    cached options object keyed wrongly would hand MAX a SUM); with asyncOp False the
    process group returned no work, and every result is still right."""
    r = report[f"async={async_op}"]
    assert all(r["results"]), r
    got = [(name, *opts[1:]) for name, opts in r["calls"]]
    assert got == _EXPECTED, r["calls"]
    for name, opts in r["calls"]:
        assert opts[0] == async_op, (name, opts)


def test_cached_options_carry_each_calls_values(report):
    assert report["opts"] == [True, True, 3, False, 5, True,
                              True, 2, True, True, [0]], report["opts"]
    # NCCL's barrier names its device, one object per asyncOp
    assert report["nccl_barrier"] == [True, True, [3], False, True]


def test_cached_reduction_rules_are_reduce_plans(report):
    assert report["rules_bad"] == []
