"""The serial reference of the parity tests: the whole GPT in one process, plain
PyTorch (torch.optim.AdamW, clip_grad_norm_), the whole global batch in one forward."""

from __future__ import annotations

import torch

from training.config import TrainConfig
from training.data import Batches, ByteCorpus
from training.models.gpt import GPT, get_config, lm_loss
from training.optim import param_groups


def serial_losses(cfg: TrainConfig, dataset=None) -> list[float]:
    return serial_run(cfg, dataset)[0]


def serial_run(cfg: TrainConfig, dataset=None, steps: int | None = None):
    """(losses, model) after `steps` (default cfg.steps) steps of the serial run."""
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
    for step in range(cfg.steps if steps is None else steps):
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
    return losses, model
