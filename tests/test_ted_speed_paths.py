"""Single-process checks of the TED MoE layer's compute shortcuts against the plain
computation they replace (training/ted/model.py)."""

import pytest
import torch

from training.models import llama
from training.models.gpt import ACTIVATIONS, MLP, GPTConfig
from training.ted.model import ExpertFFN, ParallelSwiGLU, run_occupied
from training.tensor_parallel.comm import TensorComms


def _gpt_expert(bias: bool, activation: str = "gelu") -> ExpertFFN:
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=bias,
                    activation=activation)
    torch.manual_seed(1)
    serial = MLP(cfg)
    with torch.no_grad():
        for p in serial.parameters():
            p.normal_(0, 0.3)
    return ExpertFFN(serial, TensorComms.single(), "e", approximate=ACTIVATIONS[activation])


def _swiglu_expert() -> ParallelSwiGLU:
    cfg = llama.LlamaConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=16,
                            intermediate_size=24, block_size=8, vocab_size=32)
    torch.manual_seed(2)
    return ParallelSwiGLU(llama.MLP(cfg), TensorComms.single(), "e")


def _slots(d: int) -> torch.Tensor:
    """A received buffer (2 sources, 2 local experts, 6 slots, d): tokens, empty slots
    (zero rows), and one token whose row is all zeros (source 1, expert 0, slot 1: an
    output gradient reaches it, unlike an empty slot's)."""
    torch.manual_seed(3)
    x = torch.randn(2, 2, 6, d)
    x[0, 0, 4:] = 0.0
    x[0, 1, 1:] = 0.0
    x[1, 0, 1] = 0.0
    x[1, 0, 3:] = 0.0
    x[1, 1, 2:] = 0.0
    return x


def _empty(x: torch.Tensor) -> torch.Tensor:
    """The empty slots of _slots: its zero rows but the token's."""
    empty = x.eq(0).all(-1)
    empty[1, 0, 1] = False
    return empty


def _grads(modules, x, fn, gy):
    params = [(f"{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters()]
    for _, p in params:
        p.grad = None
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(gy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in params if p.grad is not None}


def _each(experts, x):
    """Every expert on all its rows, empty slots included (the plain computation)."""
    return torch.stack([e.partial(x[:, i].reshape(-1, x.shape[-1])).view(x[:, i].shape)
                        for i, e in enumerate(experts)], dim=1)


@pytest.mark.parametrize("make", [lambda: _gpt_expert(True), lambda: _gpt_expert(False),
                                  lambda: _gpt_expert(True, "gelu_tanh"), _swiglu_expert],
                         ids=["gelu-bias", "gelu-nobias", "gelu-tanh", "swiglu"])
def test_run_occupied_matches_the_whole_buffer(make):
    """Outputs, parameter gradients and input gradients of run_occupied equal those of
    each expert on all its rows (empty slots included), to fp32 rounding (the rows of
    a weight gradient are summed in another order)."""
    experts = [make(), make()]
    with torch.no_grad():
        for p in experts[1].parameters():
            p.mul_(-0.7)
    x = _slots(16)
    gy = torch.randn(x.shape)
    gy[_empty(x)] = 0.0   # empty slots: gate 0
    want = _grads(experts, x, lambda v: _each(experts, v), gy)
    got = _grads(experts, x, lambda v: run_occupied(experts, v), gy)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    # the zero token's input gradient: the Jacobian at 0 (zero for SwiGLU)
    assert got[1][1, 0, 1].abs().sum() > 0 or isinstance(experts[0], ParallelSwiGLU)
    assert want[2] and sorted(got[2]) == sorted(want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-5)


def test_run_occupied_runs_the_experts_on_the_filled_rows_only():
    """Each expert's matmuls see its filled rows and one zero row, not the buffer."""
    experts = [_gpt_expert(True), _gpt_expert(True)]
    seen = []
    for e in experts:
        e.partial = (lambda f: lambda h: (seen.append(h.shape[0]), f(h))[1])(e.partial)
    x = _slots(16)
    run_occupied(experts, x)
    filled = (~x.eq(0).all(-1)).sum(dim=(0, 2))
    assert seen == [int(filled[0]) + 1, int(filled[1]) + 1] == [4 + 2 + 1, 1 + 2 + 1], seen


@pytest.mark.parametrize("bias", [True, False])
def test_expert_partial_is_the_parallel_linears(bias):
    """ExpertFFN.partial (torch's linear on the local blocks) equals the N/T-layers'
    partial calls it replaces: outputs and gradients of the input and the weights."""
    expert = _gpt_expert(bias)
    x = torch.randn(7, 16)
    gy = torch.randn(7, 16)

    def layers(h):
        a = expert.c_fc.partial(h)
        if expert.c_fc.bias is not None:
            a = a + expert.c_fc.bias
        return expert.c_proj.partial(torch.nn.functional.gelu(a))

    want = _grads([expert], x, layers, gy)
    got = _grads([expert], x, expert.partial, gy)
    for a, b in ((got[0], want[0]), (got[1], want[1])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert sorted(got[2]) == sorted(want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-6, atol=1e-7)
