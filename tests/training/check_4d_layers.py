"""The 4D layers on their own, under ``mpiexec -n 2`` (one launch; rank 0 prints a line
per check, "4d layers OK" at the end):

- ParallelLayerNorm over G_y = 2 against torch's layer_norm of the whole hidden
  dimension: tokens whose mean is large against their spread (mean 4, spread 0.2; the
  one-pass E[x^2] - mean^2 gave negative variances and NaN in bf16), bf16 and fp32, the
  forward and the gradients of the input, the weight and the bias.
- The Z weight-gather schedule (G_z = 2) with and without prefetch: a forward that
  raised does not break later ones, and a second model on the same comms runs.
- Splits that the grid does not divide are refused at construction, naming the
  parameter.
- Trainer4D refuses a grid whose degrees differ from its config's.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mcrdl  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from training.core.topology import GridError, ProcessGrid  # noqa: E402
from training.models.gpt import GPTConfig  # noqa: E402
from training.parallel4d.model import GPT4D  # noqa: E402
from training.parallel4d.trainer import Trainer4D, build_comms  # noqa: E402
from training.tensor_parallel.comm import Overlap  # noqa: E402
from training.tensor_parallel.layers import ParallelLayerNorm, ParallelLinear  # noqa: E402


def comms_for(x=1, y=1, z=1, data=1, overlap="none"):
    grid = ProcessGrid({"x": x, "y": y, "z": z, "data": data}, order=["x", "y", "z", "data"])
    grid.make_groups()
    return build_comms(grid, {}, Overlap.from_level(overlap))


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def layer_norm(rank: int) -> None:
    comms = comms_for(y=2)
    r, C = comms.y.rank, 64
    cols = slice(r * C // 2, (r + 1) * C // 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, C, generator=g, dtype=torch.float64) * 0.2 + 4.0
    w = 1 + 0.1 * torch.randn(C, generator=g, dtype=torch.float64)
    b = 0.1 * torch.randn(C, generator=g, dtype=torch.float64)
    dout = torch.randn(4, 16, C, generator=g, dtype=torch.float64)
    # against float64 on the same rounded inputs (torch's own bf16 layer_norm is off by
    # 2e-2 in the weight gradient here; this one by 3e-3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        ln = ParallelLayerNorm(w.to(dtype), b.to(dtype), comms, name="ln").to(dtype)
        xl = x[..., cols].to(dtype).contiguous().requires_grad_()
        out = ln(xl)
        (out.double() * dout[..., cols]).sum().backward()
        xr, wr, br = (t.to(dtype).double().requires_grad_() for t in (x, w, b))
        ref = F.layer_norm(xr, (C,), wr, br)
        (ref * dout).sum().backward()
        assert out.dtype == dtype and torch.isfinite(out).all(), out
        checks = {"output": (out, ref[..., cols]), "input grad": (xl.grad, xr.grad[..., cols]),
                  "weight grad": (ln.weight.grad, wr.grad[cols]),
                  "bias grad": (ln.bias.grad, br.grad[cols])}
        worst = {}
        for name, (got, want) in checks.items():
            err = ((got.double() - want.double()).abs().max() /
                   want.double().abs().max().clamp_min(1e-12)).item()
            assert err <= tol, (dtype, name, err)
            worst[name] = err
        say(rank, f"4d layernorm {str(dtype)[6:]} G_y=2, tokens of mean 4 and spread 0.2: "
                  "max rel error against float64 " +
                  ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def gather_schedule(rank: int) -> None:
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=96)
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    for level in ("none", "all"):
        comms = comms_for(z=2, overlap=level)
        model = GPT4D(cfg, comms, seed=3)
        try:
            model(torch.zeros(2, 17, dtype=torch.long))  # one token past block_size
            raise AssertionError("a sequence longer than block_size ran")
        except (IndexError, RuntimeError, ValueError):
            pass
        first = model(idx)
        again = model(idx)
        assert torch.equal(first, again)
        other = GPT4D(cfg, comms, seed=3)  # a second model on the same comms
        assert torch.equal(other(idx), first)
        assert torch.equal(model(idx), first)  # and back to the first
        say(rank, f"4d gathers --overlap {level} G_z=2: a failed forward, then forwards of "
                  "two models on one comms, equal outputs")


def refused_splits(rank: int) -> None:
    cases = [(comms_for(z=2), torch.randn(3, 3), "lin.weight: its block of 9 elements"),
             (comms_for(x=2), torch.randn(5, 4), "lin: out-features 5 are not divisible"),
             (comms_for(y=2), torch.randn(4, 5), "lin: in-features 5 are not divisible")]
    for comms, weight, words in cases:
        try:
            ParallelLinear(weight, None, comms, name="lin")
            raise AssertionError(f"{tuple(weight.shape)} on {comms.sizes()} was accepted")
        except ValueError as e:
            assert words in str(e), e
    say(rank, "4d splits OK: shapes the grid does not divide are refused, named")


def grid_mismatch(rank: int) -> None:
    from tests.training.check_4d import config, token_data
    directory = scratch_dir(f"mcrdl-4d-layers-{rank}-")
    token_data(directory)
    cfg = config(directory, "h4", 2, (2, 1, 1, 1))
    grid = ProcessGrid({"x": 1, "y": 1, "z": 2, "data": 1}, order=["x", "y", "z", "data"])
    grid.make_groups()
    try:
        Trainer4D(cfg, grid=grid)
        raise AssertionError("a grid of other degrees than the config's was accepted")
    except GridError as e:
        assert "differs from the config's G_x=2" in str(e), e
    say(rank, "4d grid OK: a grid other than the config's is refused")


def main() -> None:
    mcrdl.init(["mpi"])
    rank = mcrdl.get_rank()
    assert mcrdl.get_size() == 2, "run with mpiexec -n 2"
    torch.set_num_threads(1)
    layer_norm(rank)
    gather_schedule(rank)
    refused_splits(rank)
    grid_mismatch(rank)
    say(rank, "4d layers OK")
    mcrdl.finalize()


if __name__ == "__main__":
    main()
