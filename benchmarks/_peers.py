"""The peers of benchmarks/engines.py built from torch alone: DDP, torch.distributed.pipelining
(GPipe, 1F1B), FSDP2, DTensor tensor parallelism and FSDP2 + TP, each over a torch.distributed
backend ("gloo" or mcrdl's "mcrdl"). Each builds the same model as its mcrdl engine from
the same serial initial weights, trains on the same batches with torch's AdamW (the engine's
hyper-parameters, learning-rate schedule, weight decay groups and global-norm clipping) and
returns a ``Contender`` (engines.py)."""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable

import torch
import torch.distributed as dist


class Setup:
    """What every torch peer shares: the train_gpt config of the row, the dataset, the
    model's shape, the optimizer's options, and reductions over the world."""

    def __init__(self, args, backend: str, world: int, extra: list[str]):
        from engines import model_config, train_argv

        import mcrdl  # (registers the "mcrdl" torch backend and its store)
        from training.core.data import load_dataset
        from training.train_gpt import parse_args
        self.cfg = parse_args(train_argv(args) + extra, world_size=world)
        #: this rank's GPU over NCCL (--device cuda), else the CPU
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device("cuda", mcrdl.launch.detect().local_rank
                                       % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        #: bf16 compute over fp32 weights (--dtype bf16): autocast, or FSDP2's policy
        self.bf16 = self.cfg.dtype in ("bf16", "bfloat16")
        dist.init_process_group(backend)
        torch.manual_seed(self.cfg.seed)
        self.dataset = load_dataset(self.cfg.data, self.cfg.vocab_size)
        self.mcfg = model_config(self.cfg, self.dataset)
        self.oc = self.cfg.optim()
        self.init = args.init
        self.world = world

    def batches(self, dp_rank: int, dp_size: int):
        from training.core.data import Batches
        return Batches(self.dataset, self.mcfg.block_size, self.cfg.global_batch_size,
                       self.cfg.micro_batch_size, dp_rank, dp_size, seed=self.cfg.seed)

    def gpt(self):
        from training.models.gpt import GPT
        model = GPT(self.mcfg, seed=self.cfg.seed)
        model.load_state_dict(torch.load(self.init, weights_only=True))
        return model.to(self.device)

    def microbatches(self, batches, i: int) -> list:
        """Step `i`'s (inputs, targets) microbatches on this rank's device."""
        return [(x.to(self.device), y.to(self.device)) for x, y in batches.microbatches(i)]

    def autocast(self):
        """bf16 compute with --dtype bf16 (the weights stay fp32), else nothing."""
        return (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16
                else contextlib.nullcontext())

    def adamw(self, params, **kw) -> torch.optim.AdamW:
        from training.core.optim import param_groups
        oc = self.oc
        return torch.optim.AdamW(param_groups(params, oc.weight_decay), lr=oc.lr,
                                 betas=(oc.beta1, oc.beta2), eps=oc.eps, **kw)

    def set_lr(self, opt, i: int) -> None:
        for group in opt.param_groups:
            group["lr"] = self.oc.lr_at(i)

    def contender(self, step: Callable[[int], float], rank: int):
        from engines import Contender

        def reduce(values, op):
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=op)
            return t.tolist()

        def gather(x):
            v = [0.0] * self.world
            v[rank] = x
            return reduce(v, dist.ReduceOp.SUM)

        return Contender(step=step, barrier=dist.barrier,
                         max_over_ranks=lambda v: reduce(v, dist.ReduceOp.MAX),
                         gather=gather, comm_bytes=mcrdl_bytes)

    def mean_loss(self, local_sum: float, counted: int) -> float:
        """The global batch's mean loss: SUM over the world of each rank's `local_sum`,
        over `counted` (the number of addends)."""
        t = torch.tensor([local_sum], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / counted


def mcrdl_bytes() -> float | None:
    """Bytes moved by this rank's collectives so far, from mcrdl's logger (the collectives
    of torch.distributed's "mcrdl" backend and of mcrdl's API); None when mcrdl logged
    nothing (a peer over Gloo)."""
    import mcrdl
    try:
        rows = mcrdl.log_summary(quiet=True)
    except Exception:  # mcrdl not initialized in this process (a peer over Gloo)
        return None
    total = sum(r["bytes"] for r in rows)
    return float(total) if rows else None


def clip_by_global_norm(params, max_norm: float, world: int, group=None) -> None:
    """torch's clip_grad_norm_ rule (coefficient max_norm / (norm + 1e-6), at most 1) over
    the global norm of gradients that may be DTensors on different meshes or plain
    tensors: a DTensor's local shard counts 1 / (its copies over the world), a plain
    tensor 1 / world (a copy on every rank), so one all-reduce sums each entry once.
    Every placement that is neither Replicate nor Partial splits the tensor: FSDP2 over a
    tensor-parallel layer places a ``_StridedShard``, which torch 2.13 does not report
    as ``is_shard()`` (counting it as a copy made the norm of FSDP2+TP ~1% small)."""
    from torch.distributed.tensor import DTensor
    if max_norm <= 0:
        return
    grads = [p.grad for p in params if p.grad is not None]
    # on the gradients' device: NCCL reduces device tensors only
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        if isinstance(g, DTensor):
            sharded = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements)
                                if not (pl.is_replicate() or pl.is_partial()))
            local, copies = g.to_local(), world // sharded
        else:
            local, copies = g, world
        total += local.double().pow(2).sum() / copies
    dist.all_reduce(total, group=group)
    coef = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


# --- data parallel (DDP), optionally on a pruned model (SAMO's peer) ---------------------
def ddp(backend: str, *, masked: bool = False) -> Callable:
    def make(args, rank: int, world: int):
        """torch.nn.parallel.DistributedDataParallel over `backend`, the unmodified
        training step (no_sync on all but the last microbatch). `masked`: the model is
        the pruned initial weights and the pruned entries' gradients are zeroed before
        the clip, so AdamW never moves them (dense masked training)."""
        s = Setup(args, backend, world, ["--G-data", str(world)])
        model = s.gpt()
        if masked:
            model.load_state_dict(torch.load(args.init_pruned, weights_only=True))
            masks = [(p, p.detach() != 0) for p in model.parameters()]
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[s.device] if s.device.type == "cuda" else None)
        opt = s.adamw(model.parameters())
        batches = s.batches(rank, world)
        from training.models.gpt import lm_loss

        def step(i: int) -> float:
            s.set_lr(opt, i)
            mbs = s.microbatches(batches, i)
            total = 0.0
            for k, (x, y) in enumerate(mbs):
                sync = net.no_sync() if k < len(mbs) - 1 else contextlib.nullcontext()
                with sync:
                    with s.autocast():
                        loss = lm_loss(net(x), y) / len(mbs)
                    loss.backward()
                total += float(loss.detach())
            if masked:
                for p, m in masks:
                    p.grad.mul_(m)
            if s.oc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.oc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return s.mean_loss(total, world)

        return s.contender(step, rank)
    return make


# --- pipeline (torch.distributed.pipelining) ---------------------------------------------
def pipelining(backend: str, schedule: str) -> Callable:
    def make(args, rank: int, world: int):
        """A hand split of the GPT into `world` PipelineStages (the engine's partition),
        run by ScheduleGPipe or Schedule1F1B over the engine's microbatches; the losses
        of the last stage, the gradient norm over all stages."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from training.models.gpt import GPTStage, lm_loss
        from training.pipeline.engine import partition

        s = Setup(args, backend, world, ["--G-inter", str(world)])
        first, last = partition(s.mcfg.n_layer, world)[rank]
        module = GPTStage(s.mcfg, first, last, seed=s.cfg.seed)
        full = torch.load(s.init, weights_only=True)
        module.load_state_dict({k: full[k] for k in module.state_dict()})
        batches = s.batches(0, 1)
        n_micro = batches.n_micro
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # scale_grads: the gradients are the mean over microbatches, as the engine's
        sched = kind(stage, n_micro, loss_fn=lm_loss, scale_grads=True)
        opt = s.adamw(module.parameters())

        def step(i: int) -> float:
            s.set_lr(opt, i)
            mbs = batches.microbatches(i)
            x = torch.cat([m[0] for m in mbs])
            y = torch.cat([m[1] for m in mbs])
            losses: list = []
            if rank == 0:
                sched.step(x, target=y if world == 1 else None,
                           losses=losses if world == 1 else None)
            elif rank == world - 1:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            local = float(sum(float(v) for v in losses)) / n_micro if losses else 0.0
            if s.oc.grad_clip > 0:
                _clip_over_stages(module.parameters(), s.oc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return s.mean_loss(local, 1)

        return s.contender(step, rank)
    return make


def _clip_over_stages(params, max_norm: float) -> None:
    """torch's clip rule over the norm of all stages' gradients (each stage's parameters
    are its own: the squares sum over the world)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        total += g.double().pow(2).sum()
    dist.all_reduce(total)
    coef = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


# --- FSDP2, DTensor tensor parallelism, FSDP2 + TP ---------------------------------------
def _tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward on this rank's heads: c_attn's local rows are
    [q, k, v] of those heads (see _permute_qkv)."""
    import torch.nn.functional as F
    B, T, C = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=2)
    hd = C // self.n_head
    h = q.shape[-1] // hd
    q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, h * hd))


def _permute_qkv(attn, tp: int) -> None:
    """Reorder c_attn's output rows from [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
    (q_r: the heads of TP rank r), so that ColwiseParallel's contiguous shard r holds
    rank r's q, k and v: the same function as the serial model, split by heads."""
    C = attn.c_proj.weight.shape[0]
    part = C // tp
    order = torch.cat([torch.arange(j * C + r * part, j * C + (r + 1) * part)
                       for r in range(tp) for j in range(3)])
    with torch.no_grad():
        attn.c_attn.weight.copy_(attn.c_attn.weight[order])
        if attn.c_attn.bias is not None:
            attn.c_attn.bias.copy_(attn.c_attn.bias[order])
    attn.forward = types.MethodType(_tp_attention_forward, attn)


def _tensor_parallel(model, mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from training.models.gpt import Block
    for unit in model.units.values():
        if isinstance(unit, Block):
            _permute_qkv(unit.attn, mesh.size())
            parallelize_module(unit, mesh, {"attn.c_attn": ColwiseParallel(),
                                            "attn.c_proj": RowwiseParallel(),
                                            "mlp.c_fc": ColwiseParallel(),
                                            "mlp.c_proj": RowwiseParallel()})


def dtensor(backend: str, layout: str) -> Callable:
    def make(args, rank: int, world: int):
        """`layout` "fsdp2": fully_shard on each unit and the model over all ranks (the
        4D engine's Z axis: weights and samples sharded); "tp": parallelize_module with
        Colwise (c_attn, c_fc) and Rowwise (attn and MLP c_proj) over all ranks (the X
        axis; embedding and head replicated); "2d": TP over pairs of ranks and FSDP2
        over the pairs (init_device_mesh("cpu", (world // 2, 2))). AdamW(foreach=False)
        wherever DTensors of different meshes or plain tensors meet."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from training.models.gpt import lm_loss
        tp = {"fsdp2": 1, "tp": world, "2d": 2}[layout]
        dp = world // tp
        extra = {"fsdp2": ["--G-z", str(world)], "tp": ["--G-x", str(world)],
                 "2d": ["--G-x", "2", "--G-z", str(dp)]}[layout]
        s = Setup(args, backend, world, extra)
        model = s.gpt()
        kind = s.device.type
        if layout == "2d":
            mesh = init_device_mesh(kind, (dp, tp), mesh_dim_names=("dp", "tp"))
            _tensor_parallel(model, mesh["tp"])
            dp_mesh = mesh["dp"]
        elif layout == "tp":
            _tensor_parallel(model, init_device_mesh(kind, (world,)))
            dp_mesh = None
        else:
            dp_mesh = init_device_mesh(kind, (world,))
        if dp_mesh is not None:
            # bf16: FSDP2's mixed precision (bf16 compute and gathers, fp32 gradients)
            policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32)
                      if s.bf16 else MixedPrecisionPolicy())
            for unit in model.units.values():
                fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
            fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        opt = s.adamw(model.parameters(), foreach=layout == "fsdp2")
        dp_rank = rank // tp
        batches = s.batches(dp_rank, dp)

        def step(i: int) -> float:
            s.set_lr(opt, i)
            mbs = s.microbatches(batches, i)
            total = 0.0
            for k, (x, y) in enumerate(mbs):
                if dp_mesh is not None:  # reduce-scatter once, after the last microbatch
                    model.set_requires_gradient_sync(k == len(mbs) - 1)
                loss = lm_loss(model(x), y) / len(mbs)
                loss.backward()
                total += float(loss.detach())
            clip_by_global_norm(model.parameters(), s.oc.grad_clip, world)
            opt.step()
            opt.zero_grad(set_to_none=True)
            # the loss counted once per data shard (the TP ranks of a shard hold copies)
            return s.mean_loss(total if rank % tp == 0 else 0.0, dp)

        return s.contender(step, rank)
    return make


if __name__ == "__main__":  # a module of engines.py; `--help` says so
    import argparse
    argparse.ArgumentParser(description="peers of benchmarks/engines.py: run that script "
                            "(python benchmarks/engines.py --help)").parse_args()
