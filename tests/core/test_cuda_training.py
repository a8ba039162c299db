"""A whole training step (forward, backward, SGD update) captured as one breakable graph, with a
break in forward and a break in backward, checked step by step against an eager copy."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from cuda_helpers import randn
from torch import nn

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    eager_on_graph,
    is_breakable_capture_active,
)
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701

pytestmark = pytest.mark.cuda

STEPS = 4
LR = 0.05
WARMUP = 3
TOL: dict[str, float] = {"rtol": 1e-4, "atol": 1e-5}

calls: list[tuple[str, bool]] = []


@eager_on_graph(strict=True, name="act_forward")
def act_forward(h: torch.Tensor, out: torch.Tensor) -> None:
    calls.append(("forward", is_breakable_capture_active()))
    torch.mul(h, torch.sigmoid(h), out=out)  # SiLU


@eager_on_graph(strict=True, name="act_backward")
def act_backward(h: torch.Tensor, grad_out: torch.Tensor, grad_in: torch.Tensor) -> None:
    calls.append(("backward", is_breakable_capture_active()))
    s = torch.sigmoid(h)
    torch.mul(grad_out, s * (1 + h * (1 - s)), out=grad_in)


class BreakSiLU(torch.autograd.Function):
    """SiLU whose forward and backward both run as eager breaks writing into buffers."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(h)
        act_forward(h, out)
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        grad_in = torch.empty_like(h)
        act_backward(h, grad_out.contiguous(), grad_in)
        return grad_in


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = BreakSiLU.apply(self.fc1(x))
        return self.fc2(h)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(LR * p.grad)
    return loss.detach()


def test_eager_silu_matches_autograd() -> None:
    torch.manual_seed(0)
    h = randn(8, 64).requires_grad_()
    ours = BreakSiLU.apply(h)
    (g_ours,) = torch.autograd.grad(ours.sum(), h)
    theirs = nn.functional.silu(h)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), h)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(g_ours, g_theirs)


def _warmed_up_model() -> tuple[Net, Net, torch.Tensor, torch.Tensor]:
    """The model after a few eager steps on a side stream (as torch's "whole network capture"
    example does), an eager copy of it, and the static input and target buffers."""
    torch.manual_seed(0)
    model = Net().cuda()
    static_x = randn(8, 32)
    static_t = randn(8, 16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            model.zero_grad(set_to_none=True)
            train_step(model, static_x, static_t)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    reference = copy.deepcopy(model)  # same parameters as the model about to be captured
    model.zero_grad(set_to_none=True)  # grads are allocated from the graph's pool at capture
    return model, reference, static_x, static_t


def _check_steps(
    graph: BreakableCUDAGraph,
    model: Net,
    reference: Net,
    static: tuple[torch.Tensor, torch.Tensor],
    static_loss: torch.Tensor,
) -> None:
    """Replay several steps with new inputs; compare loss, grads and parameters with eager.

    Capture is faithful (each segment is launched right after it is captured), so the capture
    block was one real training step on the static inputs: the reference takes it too."""
    reference.zero_grad(set_to_none=True)
    train_step(reference, static[0].clone(), static[1].clone())
    assert graph.break_names == ("act_forward", "act_backward")
    assert graph.step_kinds == ("graph", "break", "graph", "break", "graph")
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    static_x, static_t = static
    for _ in range(STEPS):
        new_x = randn(8, 32)
        new_t = randn(8, 16)
        static_x.copy_(new_x)
        static_t.copy_(new_t)
        calls.clear()
        graph.replay()
        assert calls == [("forward", False), ("backward", False)]

        reference.zero_grad(set_to_none=True)
        ref_loss = train_step(reference, new_x, new_t)
        torch.testing.assert_close(static_loss, ref_loss, **TOL)
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and p_ref.grad is not None
            torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(p, p_ref, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # the static grads are the same tensors at every step
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))


def test_whole_training_step_with_breaks_in_forward_and_backward() -> None:
    model, reference, static_x, static_t = _warmed_up_model()
    calls.clear()
    graph = BreakableCUDAGraph()
    # Autograd runs this backward on its CUDA device thread, so the break in backward ends one
    # segment and begins the next on that thread. CUDA only allows that in relaxed mode.
    with BreakableCUDAGraphCapture(graph, capture_error_mode="relaxed"):
        static_loss = train_step(model, static_x, static_t)
    assert calls == [("forward", True), ("backward", True)]
    assert not is_breakable_capture_active()
    assert not hooks_installed()
    _check_steps(graph, model, reference, (static_x, static_t), static_loss)


def _is_capturing(stream: torch.cuda.Stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


def test_backward_break_in_global_mode_works_or_fails_cleanly() -> None:
    model, reference, static_x, static_t = _warmed_up_model()
    calls.clear()
    graph = BreakableCUDAGraph()
    stream = torch.cuda.Stream()
    try:
        with BreakableCUDAGraphCapture(graph, stream=stream):  # capture_error_mode="global"
            static_loss = train_step(model, static_x, static_t)
    except RuntimeError as exc:
        # A non-relaxed capture may only be ended by the thread that began it (CUDA's
        # cudaErrorStreamCaptureWrongThread), and autograd runs this backward on its device
        # thread. Failing is acceptable, provided the error says so and nothing is left behind.
        assert "thread" in str(exc).lower()
        assert not graph.is_captured
        assert not is_breakable_capture_active()
        assert not hooks_installed()
        assert torch.cuda.current_stream().cuda_stream == torch.cuda.default_stream().cuda_stream
        assert not _is_capturing(stream), "the capturing stream was left in capture mode"
        torch.cuda.synchronize()
        return
    _check_steps(graph, model, reference, (static_x, static_t), static_loss)
