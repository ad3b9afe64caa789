"""The serial reference of the parity tests: the whole GPT in one process, plain
PyTorch (torch.optim.AdamW, clip_grad_norm_), the whole global batch in one forward."""

from __future__ import annotations

import torch

from training.config import TrainConfig
from training.data import Batches, ByteCorpus
from training.models.gpt import GPT, get_config, lm_loss
from training.optim import param_groups


def serial_losses(cfg: TrainConfig, dataset=None) -> list[float]:
    dataset = dataset or ByteCorpus()
    mcfg = get_config(cfg.model, vocab_size=dataset.vocab_size, n_layer=cfg.n_layer,
                      n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size)
    oc = cfg.optim()
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg, seed=cfg.seed)
    opt = torch.optim.AdamW(param_groups(model.parameters(), oc.weight_decay), lr=oc.lr,
                            betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False)
    data = Batches(dataset, mcfg.block_size, cfg.global_batch_size, cfg.global_batch_size,
                   seed=cfg.seed)
    losses = []
    for step in range(cfg.steps):
        x, y = data.global_batch_at(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        if oc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
        for g in opt.param_groups:
            g["lr"] = oc.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def serial_moe_losses(cfg, dataset=None) -> list[tuple[float, float]]:
    """(LM loss, aux loss) of every step of the serial MoE GPT (training/moe.py MoEGPT):
    one process, the whole global batch in one forward, torch.optim.AdamW and
    clip_grad_norm_ on the sum of the LM loss and aux_loss_coef x the aux loss.

    An expert that received no token in a step has no gradient; it gets a zero one, as
    in every data-parallel engine (the gradient all-reduce hands every replica a
    gradient), so Adam's momentum and weight decay still move it. torch.optim.AdamW
    alone would skip the parameter."""
    from training.moe import MoEGPT, moe_loss
    from training.moe_trainer import base_config

    dataset = dataset or ByteCorpus()
    mcfg = base_config(cfg.model, vocab_size=dataset.vocab_size, n_layer=cfg.n_layer,
                       n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size)
    moe = cfg.moe_config()
    oc = cfg.optim()
    torch.manual_seed(cfg.seed)
    model = MoEGPT(mcfg, moe, seed=cfg.seed)
    opt = torch.optim.AdamW(param_groups(model.parameters(), oc.weight_decay), lr=oc.lr,
                            betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False)
    data = Batches(dataset, mcfg.block_size, cfg.global_batch_size, cfg.global_batch_size,
                   seed=cfg.seed)
    out = []
    for step in range(cfg.steps):
        x, y = data.global_batch_at(step)
        logits, stats = model(x)
        loss, lm = moe_loss(logits, y, stats, moe)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if oc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
        for g in opt.param_groups:
            g["lr"] = oc.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((lm.item(), stats.aux_loss.item()))
    return out
