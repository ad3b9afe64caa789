"""DataParallelAdamW's bucketed, overlapped all-reduce (training/core/optim.py), at 2 ranks.

Run under ``mpiexec -n 2``. Checks, each printing one "ok" line on rank 0:

1. bitwise: the gradients the buckets hold after the reduction, and the weights after
   three steps without clipping, equal bit for bit those of the flatten path it
   replaced (all gradients flattened after the backward, all-reduced (AVG) in one call,
   copied back, torch.optim.AdamW's fused update as DataParallelAdamW's), on a tiny GPT
   with rank-dependent data; with clipping, against the replaced path's single-tensor
   AdamW, the weights agree to fp32 rounding (2e-6 absolute after three steps at lr
   1e-2: the norm is summed in another order, the fused kernel rounds otherwise), and a
   state of that path resumes;
2. overlap: with ``begin_step(3)`` no bucket is posted before the third microbatch's
   backward, and every bucket is posted by the end of it, before ``step`` (the
   ``posted_in_backward`` counter);
3. a parameter that gets no gradient is reduced as zeros, the other buckets still post
   from the backward in order, and the step does not hang;
4. a gradient accumulated more often than ``begin_step`` announced raises;
5. ``--bucket-mib``: an explicit size bounds every bucket; the default splits the tiny
   GPT into several buckets, the first the smallest.
Rank 0 ends with "dp overlap OK".
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from training.core.optim import DataParallelAdamW, OptimConfig, param_groups  # noqa: E402
from training.models.gpt import GPT, get_config, lm_loss  # noqa: E402

VOCAB = 64


def model() -> GPT:
    return GPT(get_config("tiny", vocab_size=VOCAB), seed=3)


def batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randint(0, VOCAB, (2, 16), generator=g)
    y = torch.randint(0, VOCAB, (2, 16), generator=g)
    return x, y


def flatten_reference(net: GPT, oc: OptimConfig, group, rank: int, steps: int,
                      fused: bool | None):
    """The replaced path: flatten, one all-reduce, copy back, clip, torch AdamW (`fused`:
    its implementation; the replaced path ran the single-tensor one). Returns the
    reduced gradients of step 0, the final weights and the optimizer."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(param_groups(params, oc.weight_decay), lr=oc.lr,
                            betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False,
                            fused=fused)
    first = None
    for step in range(steps):
        for m in range(3):
            x, y = batch(rank, step, m)
            (lm_loss(net(x), y) / 3).backward()
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        mcrdl.all_reduce("auto", flat, op=mcrdl.ReduceOp.AVG, group=group)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(r)
        if first is None:
            first = [g.clone() for g in grads]
        if oc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, oc.grad_clip)
        for gr in opt.param_groups:
            gr["lr"] = oc.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return first, [p.detach().clone() for p in params], opt


def bucketed(net: GPT, oc: OptimConfig, group, rank: int, steps: int):
    """The same steps with DataParallelAdamW; the reduced gradients of step 0 are read
    from its buckets before the update."""
    opt = DataParallelAdamW(net.parameters(), oc, data_group=group)
    first = None
    for step in range(steps):
        opt.begin_step(3)
        for m in range(3):
            x, y = batch(rank, step, m)
            (lm_loss(net(x), y) / 3).backward()
        assert opt.posted_in_backward == (step + 1) * len(opt.buckets), opt.posted_in_backward
        if first is None:
            for bucket in opt.buckets:
                bucket.work.wait()
            first = [p.grad.clone() for p in opt.params]
        opt.step()
    return first, [p.detach().clone() for p in opt.params], opt


def check_bitwise(group, rank: int) -> None:
    oc = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.0)
    ref_g, ref_w, _ = flatten_reference(model(), oc, group, rank, 3, fused=True)
    got_g, got_w, opt = bucketed(model(), oc, group, rank, 3)
    assert opt.opt.param_groups[0]["fused"] is True
    assert len(opt.buckets) > 1, opt.bucket_sizes()
    for a, b in zip(ref_g, got_g, strict=True):
        assert torch.equal(a, b), "reduced gradients differ from the flatten path"
    for a, b in zip(ref_w, got_w, strict=True):
        assert torch.equal(a, b), "weights differ from the flatten path"
    oc = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.05)  # clips every step
    ref_net = model()
    _, ref_w, ref_opt = flatten_reference(ref_net, oc, group, rank, 3, fused=None)
    _, got_w, opt = bucketed(model(), oc, group, rank, 3)
    # the flatten path's float64 norm and torch's clip_grad_norm_ met to 2.1e-7 here
    worst = max(float((a - b).abs().max()) for a, b in zip(ref_w, got_w, strict=True))
    assert worst < 2e-6, worst
    assert opt.last_grad_norm > 0.05
    # resume from the single-tensor update's state (checkpoints of the replaced path)
    resumed = DataParallelAdamW(ref_net.parameters(), oc, data_group=group)
    resumed.load_state_dict({"kind": "adamw", "step_count": 3, "torch": ref_opt.state_dict()})
    assert all(g["fused"] is True and g["foreach"] is False
               for g in resumed.opt.param_groups)
    resumed.begin_step(1)
    x, y = batch(rank, 3, 0)
    lm_loss(ref_net(x), y).backward()
    resumed.step()
    assert all(int(st["step"]) == 4 for st in resumed.opt.state.values())
    if rank == 0:
        print(f"bitwise ok: {len(opt.buckets)} buckets {opt.bucket_sizes()} B; reduced "
              f"gradients and unclipped weights equal, clipped within {worst:.1e} absolute",
              flush=True)


def check_overlap(group, rank: int) -> None:
    net = model()
    opt = DataParallelAdamW(net.parameters(), OptimConfig(), data_group=group)
    opt.begin_step(3)
    for m in range(3):
        x, y = batch(rank, 0, m)
        (lm_loss(net(x), y) / 3).backward()
        want = len(opt.buckets) if m == 2 else 0
        assert opt.posted_in_backward == want, (m, opt.posted_in_backward, want)
    assert all(b.work is not None for b in opt.buckets)
    opt.step()
    assert opt.posted_in_backward == len(opt.buckets)
    assert all(float(b.flat.abs().max()) == 0 for b in opt.buckets)  # zeroed for the next
    assert all(p.grad is v for p, v in zip(opt.params, opt._views, strict=True))
    if rank == 0:
        print(f"overlap ok: all {len(opt.buckets)} buckets posted by the last backward",
              flush=True)


def check_unused_parameter(group, rank: int) -> None:
    net = model()
    spare = torch.nn.Parameter(torch.ones(5))  # first in the list: in the last bucket
    opt = DataParallelAdamW([spare, *net.parameters()],
                            OptimConfig(grad_clip=0.0, bucket_mib=0.01), data_group=group)
    opt.begin_step(1)
    x, y = batch(rank, 0, 0)
    lm_loss(net(x), y).backward()
    # every bucket but the spare's posted from the backward
    assert opt.posted_in_backward == len(opt.buckets) - 1, opt.posted_in_backward
    before = spare.detach().clone()
    opt.step()
    # a vector: no weight decay, and a zero gradient moves no AdamW weight
    assert torch.equal(spare.detach(), before), "a parameter without gradient moved"
    if rank == 0:
        print("unused parameter ok: reduced as zeros, the other buckets posted in order",
              flush=True)


def check_over_accumulation(group, rank: int) -> None:
    net = model()
    opt = DataParallelAdamW(net.parameters(), OptimConfig(), data_group=group)
    opt.begin_step(1)
    x, y = batch(rank, 0, 0)
    lm_loss(net(x), y).backward()
    try:
        lm_loss(net(x), y).backward()
    except RuntimeError as e:
        assert "accumulated 2 times in one step, begin_step announced 1" in str(e), e
    else:
        raise AssertionError("a second accumulation after the post was not refused")
    for b in opt.buckets:
        if b.work is not None:
            b.work.wait()
    if rank == 0:
        print("over-accumulation ok: refused", flush=True)


def check_bucket_sizes(group, rank: int) -> None:
    net = model()
    total = sum(p.numel() * 4 for p in net.parameters())
    opt = DataParallelAdamW(net.parameters(), OptimConfig(bucket_mib=0.02), data_group=group)
    sizes = opt.bucket_sizes()
    largest = max(p.numel() * 4 for p in net.parameters())
    assert sum(sizes) == total and all(s < 0.02 * 2**20 + largest for s in sizes), sizes
    auto = DataParallelAdamW(net.parameters(), OptimConfig(), data_group=group).bucket_sizes()
    assert sum(auto) == total and len(auto) >= 3 and auto[0] == min(auto[:-1]), auto
    if rank == 0:
        print(f"bucket sizes ok: --bucket-mib 0.02 -> {len(sizes)} buckets, default -> "
              f"{auto} B of {total}", flush=True)


def main():
    mcrdl.init(["mpi"])
    rank, n = mcrdl.get_rank(), mcrdl.get_size()
    assert n == 2, "run under mpiexec -n 2"
    torch.manual_seed(0)
    group = mcrdl.new_group([0, 1])
    check_bitwise(group, rank)
    check_overlap(group, rank)
    check_unused_parameter(group, rank)
    check_over_accumulation(group, rank)
    check_bucket_sizes(group, rank)
    if rank == 0:
        print("dp overlap OK", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
