"""The serial reference of the parity tests: the whole model (the GPT, or the family
``--arch`` names) in one process, plain PyTorch (torch.optim.AdamW, clip_grad_norm_),
the whole global batch in one forward.
With ``cfg.prune_sparsity`` set it is dense masked training: each pruning round of
``cfg.prune_schedule`` selects the kept entries (training.samo.pruning.select, over the whole
model), zeroes the pruned weights and Adam moments, and every step zeroes the pruned
gradients before clipping."""

from __future__ import annotations

import math

import torch

from training.core.data import Batches, load_dataset
from training.core.optim import OptimConfig, param_groups
from training.models.families import family_of, model_shape
from training.models.gpt import lm_loss
from training.samo.pruning import full_index, kept_count, parse_schedule, pruned_mask, select
from training.train_gpt import TrainConfig


def torch_adamw(model: torch.nn.Module, oc: OptimConfig) -> torch.optim.AdamW:
    """torch.optim.AdamW with `oc`'s settings and the engines' weight decay groups."""
    return torch.optim.AdamW(param_groups(model.parameters(), oc.weight_decay), lr=oc.lr,
                             betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False)


def torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, oc: OptimConfig,
               step: int) -> None:
    """One update of `model` by `opt` (torch_adamw) from its gradients: clipped to
    ``oc.grad_clip`` (0: not clipped), at the learning rate of `step` (0-based)."""
    if oc.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
    for g in opt.param_groups:
        g["lr"] = oc.lr_at(step)
    opt.step()
    opt.zero_grad(set_to_none=True)


def twin_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two small models with the same weights (seeded): one for the optimizer under test,
    one for torch's."""
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    b = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    b.load_state_dict(a.state_dict())
    return a, b


def assert_steps_like_torch(a: torch.nn.Module, b: torch.nn.Module, ours, oc: OptimConfig,
                            steps: int = 5) -> None:
    """`steps` steps of `a` by the optimizer `ours` and of its twin `b` by torch_adamw, on
    the same random batches, leave the same parameters."""
    ref = torch_adamw(b, oc)
    for step in range(steps):
        x = torch.randn(4, 7)
        for m in (a, b):
            m(x).square().sum().backward()
        ours.step()
        torch_step(b, ref, oc, step)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def whole_model(mcfg, seed: int) -> torch.nn.Module:
    """The whole serial model of config `mcfg`, of its family (--arch)."""
    return family_of(mcfg).stage(mcfg, 0, mcfg.n_units - 1, seed)


def serial_losses(cfg: TrainConfig, dataset=None) -> list[float]:
    return serial_run(cfg, dataset)[0]


def serial_run(cfg: TrainConfig, dataset=None, steps: int | None = None,
               prune_gaps: list | None = None):
    """(losses, model) after `steps` (default cfg.steps) steps of the serial run.

    ``prune_gaps``, where given, gets (step, gap) for each pruning round: cut_margin of
    the magnitudes the round chose from. Where it is a few ulps, a parallel run's other
    rounding may keep another entry, and its losses part from this run's there."""
    dataset = dataset or load_dataset("stdlib")
    mcfg = model_shape(cfg, dataset.vocab_size)
    oc = cfg.optim()
    torch.manual_seed(cfg.seed)
    model = whole_model(mcfg, cfg.seed)
    opt = torch_adamw(model, oc)
    data = Batches(dataset, mcfg.block_size, cfg.global_batch_size, cfg.global_batch_size,
                   seed=cfg.seed)
    params = list(model.parameters())
    numels = [p.numel() for p in params]
    rounds = ([] if cfg.prune_sparsity is None
              else parse_schedule(cfg.prune_schedule, cfg.prune_sparsity))
    index, pruned = full_index(params), [None] * len(params)
    losses = []
    for step in range(cfg.steps if steps is None else steps):
        for r in (r for r in rounds if r.step == step):
            values = [p.detach().view(-1)[i.long()] for p, i in zip(params, index, strict=True)]
            if prune_gaps is not None:
                prune_gaps.append((step, cut_margin(values, numels, r.sparsity,
                                                    cfg.prune_scope)))
            index = select(values, index, numels, r.sparsity, cfg.prune_scope)
            pruned = [pruned_mask(p.numel(), i) for p, i in zip(params, index, strict=True)]
            with torch.no_grad():
                for p, mask in zip(params, pruned, strict=True):
                    p.view(-1).masked_fill_(mask, 0)
                    for t in opt.state.get(p, {}).values():
                        if t.shape == p.shape:
                            t.view(-1).masked_fill_(mask, 0)
        x, y = data.global_batch_at(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        for p, mask in zip(params, pruned, strict=True):
            if mask is not None:
                p.grad.view(-1).masked_fill_(mask, 0)
        torch_step(model, opt, oc, step)
        losses.append(loss.item())
    return losses, model


def serial_index(cfg: TrainConfig, vocab_size: int = 256) -> dict[str, torch.Tensor]:
    """The mask of the first pruning round of `cfg` on the whole model, by parameter name."""
    mcfg = model_shape(cfg, vocab_size)
    named = list(whole_model(mcfg, cfg.seed).named_parameters())
    first = parse_schedule(cfg.prune_schedule, cfg.prune_sparsity)[0]
    params = [p for _, p in named]
    index = select([p.detach().view(-1) for p in params], full_index(params),
                   [p.numel() for p in params], first.sparsity, cfg.prune_scope)
    return {n: i for (n, _), i in zip(named, index, strict=True)}


def serial_moe_losses(cfg, dataset=None, router_gaps: list | None = None
                      ) -> list[tuple[float, float]]:
    """(LM loss, aux loss) of every step of the serial MoE GPT (training/models/moe.py MoEGPT):
    one process, the whole global batch in one forward, torch.optim.AdamW and
    clip_grad_norm_ on the sum of the LM loss and aux_loss_coef x the aux loss.

    ``router_gaps``, where given, gets each step's smallest margin of a top-k choice
    (over every token and router: the probability gap between the k-th and the next
    expert, and between the first two): where it is a few ulps, another summation order
    may route a token elsewhere, and a parallel run part from this one at that step.

    An expert that received no token in a step has no gradient; it gets a zero one, as
    in every data-parallel engine (the gradient all-reduce hands every replica a
    gradient), so Adam's momentum and weight decay still move it. torch.optim.AdamW
    alone would skip the parameter."""
    from training.models.moe import MoEGPT, base_config, moe_loss

    dataset = dataset or load_dataset("stdlib")
    mcfg = base_config(cfg.model, vocab_size=dataset.vocab_size, n_layer=cfg.n_layer,
                       n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size)
    moe = cfg.moe_config()
    oc = cfg.optim()
    torch.manual_seed(cfg.seed)
    model = MoEGPT(mcfg, moe, seed=cfg.seed)
    opt = torch_adamw(model, oc)
    data = Batches(dataset, mcfg.block_size, cfg.global_batch_size, cfg.global_batch_size,
                   seed=cfg.seed)
    margins = []
    if router_gaps is not None:  # the model is this function's: the hooks die with it
        for name, m in model.named_modules():
            if name.endswith(".router"):
                m.register_forward_hook(lambda _m, _i, out: margins.append(
                    top_k_margin(out, moe.top_k)))
    out = []
    for step in range(cfg.steps):
        x, y = data.global_batch_at(step)
        logits, stats = model(x)
        if router_gaps is not None:
            router_gaps.append(min(margins, default=float("inf")))
            margins.clear()
        loss, lm = moe_loss(logits, y, stats, moe)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch_step(model, opt, oc, step)
        out.append((lm.item(), stats.aux_loss.item()))
    return out


def cut_margin(values: list[torch.Tensor], numels: list[int], sparsity: float,
               scope: str) -> float:
    """The smallest relative magnitude gap, at the cut of training.samo.pruning.select,
    between the last entry a round keeps and the first it prunes: over the whole model
    (global scope) or per tensor (layer). 0 where they tie exactly; inf: nothing is cut."""
    def gap(mags: torch.Tensor, keep: int) -> float:
        if mags.numel() <= keep:
            return float("inf")
        top = mags.topk(keep + 1).values
        kept, cut = top[keep - 1].item(), top[keep].item()
        return (kept - cut) / kept if kept > 0 else 0.0

    mags = [v.detach().reshape(-1).float().abs() for v in values]
    if scope == "global":
        return gap(torch.cat(mags), kept_count(sum(numels), sparsity))
    return min(gap(m, kept_count(n, sparsity)) for m, n in zip(mags, numels, strict=True))


def top_k_margin(logits: torch.Tensor, top_k: int) -> float:
    """The smallest probability gap, over tokens, that decides a top-k routing: between
    the first two experts (the order of a token's choices) and between the k-th and the
    (k+1)-th (the choice itself)."""
    probs = torch.softmax(logits.detach().float(), dim=-1)
    top = probs.topk(min(top_k + 1, probs.shape[-1]), dim=-1).values
    gaps = top[..., :-1] - top[..., 1:]
    return gaps.min().item() if gaps.numel() else float("inf")  # one expert: no choice


def bf16_loss_rtol(tokens: int, roundings: int = 2, sigmas: float = 5.0) -> float:
    """Bound on a bf16 run's loss relative to the same fp32 run's (fp32 masters, loss and
    update; bf16 weights and activations), from the dtype and the number of roundings.

    Round to nearest in bf16 (8 significand bits) errs by at most half an ulp, 2**-9
    relative, uniformly: standard deviation 2**-9 / sqrt(3). Each token's loss carries
    `roundings` of them (its activations' and the weights' it is computed with), with
    independent signs; the step's loss is the mean over `tokens` tokens, so its relative
    error has standard deviation sqrt(roundings / (3 * tokens)) * 2**-9, bounded here by
    `sigmas` of them. (128 tokens, 2 roundings: 7.0e-4; measured 1.5e-4 and 1.7e-4 by
    tests/training/check_4d.py and check_moe.py.)"""
    return sigmas * math.sqrt(roundings / (3 * tokens)) * 2.0**-9
