"""The 4D engine against the serial PyTorch run, step by step, on grids of one launch:
each step's loss, the global gradient norm the clip uses, and per parameter the
gradient (reduced, before the clip) and the weights after the step.

Run under ``mpiexec -n R`` (R = every grid's product)::

    mpiexec -n 4 python tests/training/check_4d_drift.py --grids "2,1,2,1;2,2,1,1"
    mpiexec -n 4 python tests/training/check_4d_drift.py --grids 2,1,2,1 --model mini
        # the engine and data of benchmarks/engines.py --ranks 4 --rows 4d-xz
        # --parity-steps 10 --parity-only (its losses, to the digits it prints)

Without ``--model`` the model is a small GPT (2 blocks, n_embd 64, 4 heads, sequence 32,
global batch 16 in micro-batches of 4) on tests/training/check_4d.py's 96-token data;
``--model NAME`` takes train_gpt's model and data. Options after ``--`` go to train_gpt.
The serial run (tests/training/reference.py's loop: torch.optim.AdamW, clip_grad_norm_,
the whole global batch in one forward) runs on rank 0 in lockstep. Rank 0 prints one line
per step; ``--per-param`` adds every parameter's figures; ``--check`` asserts the
tolerances below and ends with "4d drift OK".

Tolerances (fp32; u = 2**-24, the unit roundoff). The two runs add the same products in
another grouping (each rank's tokens, the partial sums of the split matmuls, the
reductions over X, Z and data); rounding errors of a sum of n addends of random sign
grow as sqrt(n) u relative to its scale:

- GRAD_TOL, step 1's gradients (identical weights), per tensor max |diff| / max |g|:
  n = the global batch's tokens (512 here): sqrt(n) u = 1.3e-6; the backward carries
  these errors through the blocks, so 32x that: 4.3e-5. Measured: 8.0e-7 here, 2.5e-6
  on mini's 2048 tokens (sqrt(n) u = 2.7e-6). A gradient scaled wrongly or missing a
  reduction over an axis errs by O(1) (a replicated gradient not summed over Z: 0.57).
- NORM_TOL, the clip's global norm each step, relative: a sum of squares has no
  cancellation, so it inherits the gradients' relative error (<= sqrt(n) u), plus the
  world all_reduce's float32 rounding (u / 2): 1e-5. Measured: 1.9e-7 here, 1.6e-6 on
  mini. A piece counted on every rank that holds a copy: 0.74 off; the column shards'
  squares counted at half weight: 1.1e-2 off.
- LOSS_TOL, each step's loss, relative: step 1 is the mean of n cross-entropies summed in
  another order (a few u); each later step's weights differ by lr times the update's
  rounding difference, which moves the loss by ~u per step: 1e-6 over 10 steps.
  Measured: 1.2e-7 here and on mini. The 1.1e-2 norm error above moves the loss by
  1.4e-6 at step 5 here; on mini, the FSDP2 + TP peer of benchmarks/engines.py, its norm 1.0e-2
  low, drifted 9.6e-7, 9.8e-6, 2.9e-5 at steps 3, 4, 5.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from tests.training import _failfast as failfast  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from tests.training.reference import torch_adamw, whole_model  # noqa: E402
from training.core.data import Batches  # noqa: E402
from training.core.topology import ProcessGrid  # noqa: E402
from training.models.gpt import lm_loss  # noqa: E402
from training.parallel4d.model import assemble_state_dict  # noqa: E402
from training.parallel4d.trainer import Trainer4D  # noqa: E402
from training.train_gpt import parse_args  # noqa: E402

U = 2.0 ** -24
GRAD_TOL = 32 * 512 ** 0.5 * U
NORM_TOL = 1e-5
LOSS_TOL = 1e-6
SMALL = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "4",
         "--block-size", "32", "--global-batch-size", "16", "--micro-batch-size", "4"]
GROUPS: dict = {}  # axis groups shared by the launch's grids


def gathered(trainer: Trainer4D, tensors: dict[str, torch.Tensor]) -> dict | None:
    """Collective: the serial-shaped tensors of data replica 0's pieces `tensors` (by
    parameter name) on rank 0."""
    model, c = trainer.model, trainer.comms
    mine = (c.coords(), tensors) if c.data.rank == 0 else None
    got = mcrdl.all_gather_object(mine)
    if mcrdl.get_rank() != 0:
        return None
    return assemble_state_dict(model.cfg, model.splits(), c.sizes(),
                               [g for g in got if g is not None])


def rel(a: torch.Tensor, b: torch.Tensor, name: str = "") -> float:
    """max |a - b| / max |b|. For c_attn.bias, without its key part: attention is
    invariant to it (q.b_k is added to every score of a query), so its exact gradient
    is 0 and AdamW turns each run's rounding noise into full-size steps."""
    if name.endswith("attn.c_attn.bias"):
        c = a.numel() // 3
        a, b = torch.cat([a[:c], a[2 * c:]]), torch.cat([b[:c], b[2 * c:]])
    scale = b.abs().max().item()
    d = (a - b).abs().max().item()
    return d / scale if scale > 0 else d


def run_grid(grid: tuple, argv: list[str], steps: int, per_param: bool, check: bool) -> dict:
    """Train `steps` steps on `grid` and the serial run beside it; rank 0's worst
    figures {"loss", "norm", "grad1", "clipped"}."""
    world, rank = mcrdl.get_size(), mcrdl.get_rank()
    gx, gy, gz, gd = grid
    cfg = parse_args(argv + ["--G-x", str(gx), "--G-y", str(gy), "--G-z", str(gz),
                             "--G-data", str(gd)], world_size=world)
    layout = ProcessGrid({"x": gx, "y": gy, "z": gz, "data": gd},
                         order=["x", "y", "z", "data"], group_cache=GROUPS)
    trainer = Trainer4D(cfg, grid=layout)
    seen = {}
    step_of = trainer.optimizer.step

    def step(sumsq=None):  # the reduced gradients and the norm, before the clip
        seen["grads"] = gathered(trainer, {n: p.grad.detach().clone()
                                           for n, p in trainer.model.named_parameters()})
        seen["norm"] = sumsq ** 0.5
        return step_of(sumsq=sumsq)
    trainer.optimizer.step = step
    worst = {"loss": 0.0, "norm": 0.0, "grad1": 0.0, "clipped": 0}
    if rank == 0:
        mcfg, oc = trainer.model_cfg, cfg.optim()
        torch.manual_seed(cfg.seed)
        serial = whole_model(mcfg, cfg.seed)
        opt = torch_adamw(serial, oc)
        data = Batches(trainer.dataset, mcfg.block_size, cfg.global_batch_size,
                       cfg.global_batch_size, seed=cfg.seed)
        names = [n for n, _ in serial.named_parameters()]
        print(f"grid {grid}: {cfg.model} n_layer {mcfg.n_layer} n_embd {mcfg.n_embd}, batch "
              f"{cfg.global_batch_size} x {mcfg.block_size} (micro {cfg.micro_batch_size}), "
              f"lr {oc.lr} warmup {oc.warmup_steps} decay {oc.decay_steps} clip "
              f"{oc.grad_clip} wd {oc.weight_decay}", flush=True)
    for i in range(steps):
        loss, _ = trainer.train_step()
        weights = gathered(trainer, trainer.model.local_pieces())
        if rank != 0:
            continue
        x, y = data.global_batch_at(i)
        ref = lm_loss(serial(x), y)
        ref.backward()
        grads = {n: q.grad.detach().clone() for n, q in serial.named_parameters()}
        norm = float(torch.nn.utils.clip_grad_norm_(serial.parameters(), oc.grad_clip))
        for g in opt.param_groups:
            g["lr"] = oc.lr_at(i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = dict(serial.named_parameters())
        grad_rel = {n: rel(seen["grads"][n], grads[n], n) for n in names}
        weight_rel = {n: rel(weights[n], state[n].detach(), n) for n in names}
        worst_g = max(grad_rel, key=grad_rel.get)
        worst_w = max(weight_rel, key=weight_rel.get)
        loss_rel = abs(loss - ref.item()) / ref.item()
        norm_rel = abs(seen["norm"] - norm) / norm
        worst["loss"] = max(worst["loss"], loss_rel)
        worst["norm"] = max(worst["norm"], norm_rel)
        worst["clipped"] += norm > oc.grad_clip > 0
        if i == 0:
            worst["grad1"] = grad_rel[worst_g]
        print(f"step {i + 1:2d}: loss 4d {loss:.8f} serial {ref.item():.8f} rel "
              f"{loss_rel:.1e}; norm {seen['norm']:.6f} serial {norm:.6f} rel "
              f"{norm_rel:.1e}; worst grad {worst_g} {grad_rel[worst_g]:.1e}; worst weight "
              f"{worst_w} {weight_rel[worst_w]:.1e}", flush=True)
        if per_param:
            for n in names:
                print(f"    {n:32s} grad {grad_rel[n]:.1e} weight {weight_rel[n]:.1e}")
    if rank == 0 and check:
        assert worst["grad1"] <= GRAD_TOL, f"{grid}: step-1 gradients differ by " \
            f"{worst['grad1']:.2e} > {GRAD_TOL:.1e}"
        assert worst["norm"] <= NORM_TOL, f"{grid}: gradient norm differs by " \
            f"{worst['norm']:.2e} > {NORM_TOL:.0e}"
        assert worst["loss"] <= LOSS_TOL, f"{grid}: loss differs by {worst['loss']:.2e} " \
            f"> {LOSS_TOL:.0e}"
        assert worst["clipped"] >= steps // 2, f"{grid}: only {worst['clipped']} of " \
            f"{steps} steps clipped: the check would not see the clip coefficient"
    return worst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--grids", default="2,1,2,1", help="G_x,G_y,G_z,G_data;...")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", default=None, help="train_gpt's --model and its data "
                   "(default: the small GPT on check_4d.py's data)")
    p.add_argument("--per-param", action="store_true")
    p.add_argument("--check", action="store_true", help="assert the module's tolerances")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    mcrdl.init(["mpi"])
    torch.set_num_threads(1)
    rank = mcrdl.get_rank()
    if args.model is None:
        from tests.training.check_4d import VOCAB, token_data
        directory = scratch_dir(f"mcrdl-4d-drift-{rank}-")
        token_data(directory)
        base = SMALL + ["--data", directory, "--vocab-size", str(VOCAB)]
    else:
        base = ["--model", args.model, "--global-batch-size", "32", "--micro-batch-size", "8"]
    argv = base + ["--seed", "0", "--steps", str(args.steps), *extra]
    grids = [tuple(int(v) for v in g.split(",")) for g in args.grids.split(";")]
    results = {g: run_grid(g, argv, args.steps, args.per_param, args.check) for g in grids}
    if rank == 0 and args.check:
        print("4d drift OK: " + "; ".join(
            f"{g}: {args.steps} steps, loss rel <= {w['loss']:.1e}, norm rel <= "
            f"{w['norm']:.1e}, step-1 grads rel <= {w['grad1']:.1e}, {w['clipped']} clipped"
            for g, w in results.items())
            + f" (tolerances {LOSS_TOL:.0e}, {NORM_TOL:.0e}, {GRAD_TOL:.1e})", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    failfast.run(main)
