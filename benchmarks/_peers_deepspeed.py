"""The peer of the TED MoE engine in benchmarks/engines.py: the same MoE GPT with every MoE
FFN a DeepSpeed MoE layer (``deepspeed.moe.layer.MoE``, experts spread over all ranks,
top-k gating with the same capacity, no random token selection, no noise), trained by a
DeepSpeed engine (ZeRO stage 0, torch's AdamW) over torch.distributed `backend`.

Install: ``DS_BUILD_OPS=0 pip install deepspeed``; it runs with ``DS_ACCELERATOR=cpu``
(engines.py's launcher sets it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


class _DSMoEGPT(nn.Module):
    """MoEGPT's units with each MoE block's FFN replaced by `ffn[unit]` (a DeepSpeed MoE
    layer); forward: (logits, the sum of the layers' aux losses)."""

    def __init__(self, units: nn.ModuleDict, ffn: nn.ModuleDict):
        super().__init__()
        self.units, self.ffn = units, ffn

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from training.models.moe import MoEBlock
        names = list(self.units)
        x = self.units[names[0]](idx)
        aux = torch.zeros((), dtype=torch.float32)
        for name in names[1:-1]:
            block = self.units[name]
            if isinstance(block, MoEBlock):
                x = x + block.attn(block.ln_1(x))
                y, l_aux, _ = self.ffn[name](block.ln_2(x))
                x = x + y
                aux = aux + l_aux
            else:
                x = block(x)
        return self.units[names[-1]](x), aux


def moe(backend: str) -> Callable:
    def make(args, rank: int, world: int):
        import deepspeed
        import torch.distributed as dist
        import torch.nn.functional as F
        from _peers import mcrdl_bytes
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        from engines import Contender, train_argv

        import mcrdl  # noqa: F401  (registers the "mcrdl" torch backend and its store)
        from training.core.data import Batches, load_dataset
        from training.core.optim import param_groups
        from training.models.gpt import MLP
        from training.models.moe import MoEBlock, MoEGPT, base_config
        from training.train_moe import parse_args

        cfg = parse_args(train_argv(args) + ["--G-expert", str(world)], world_size=world)
        deepspeed.init_distributed(dist_backend=backend)
        torch.manual_seed(cfg.seed)
        dataset = load_dataset(cfg.data, cfg.vocab_size)
        mcfg = base_config(cfg.model, vocab_size=dataset.vocab_size, n_layer=cfg.n_layer,
                           n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size)
        moe_cfg = cfg.moe_config()
        serial = MoEGPT(mcfg, moe_cfg, seed=cfg.seed)
        serial.load_state_dict(torch.load(args.init_moe, weights_only=True))
        local = moe_cfg.experts // world
        ffn = nn.ModuleDict()
        for name, block in serial.units.items():
            if not isinstance(block, MoEBlock):
                continue
            layer = MoE(mcfg.n_embd, MLP(mcfg), num_experts=moe_cfg.experts, ep_size=world,
                        k=moe_cfg.top_k, capacity_factor=moe_cfg.capacity_factor,
                        eval_capacity_factor=moe_cfg.capacity_factor, min_capacity=0,
                        drop_tokens=True, use_rts=False, noisy_gate_policy=None,
                        top2_2nd_expert_sampling=False)
            with torch.no_grad():
                layer.deepspeed_moe.gate.wg.weight.copy_(block.moe.router.weight)
                for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
                    expert.load_state_dict(block.moe.experts[rank * local + i].state_dict())
            del block.moe
            ffn[name] = layer
        model = _DSMoEGPT(serial.units, ffn)
        oc = cfg.optim()
        groups = param_groups(model.parameters(), oc.weight_decay)
        for group, name in zip(groups, ("decay", "no_decay"), strict=True):
            group["name"] = name  # DeepSpeed splits each named group into dense and expert
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
        opt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps)
        batches = Batches(dataset, mcfg.block_size, cfg.global_batch_size,
                          cfg.micro_batch_size, rank, world, seed=cfg.seed)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": batches.n_micro,
            "train_batch_size": cfg.global_batch_size,
            "gradient_clipping": oc.grad_clip,
            "zero_optimization": {"stage": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9})

        def step(i: int) -> float:
            for group in opt.param_groups:
                group["lr"] = oc.lr_at(i)
            total = 0.0
            for x, y in batches.microbatches(i):
                logits, aux = engine(x)
                lm = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                engine.backward(lm + moe_cfg.aux_loss_coef * aux)
                engine.step()  # applies the update at the accumulation boundary
                total += float(lm.detach())
            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t) / (world * batches.n_micro)

        def reduce(values, op):
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, op=op)
            return t.tolist()

        def gather(x):
            v = [0.0] * world
            v[rank] = x
            return reduce(v, dist.ReduceOp.SUM)

        return Contender(step=step, barrier=dist.barrier,
                         max_over_ranks=lambda v: reduce(v, dist.ReduceOp.MAX),
                         gather=gather, comm_bytes=mcrdl_bytes)
    return make


if __name__ == "__main__":  # a module of engines.py; `--help` says so
    import argparse
    argparse.ArgumentParser(description="peers of benchmarks/engines.py: run that script "
                            "(python benchmarks/engines.py --help)").parse_args()
