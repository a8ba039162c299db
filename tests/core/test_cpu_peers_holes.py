"""Holes found by trying, through the public API on the CPU backend, the behaviours that other
breakable-graph implementations test (sglang, vLLM, TensorRT-LLM, Meta's breakable-cuda-graphs),
each pinned by a test that failed before its fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    keep_alive_ok,
)


def _dispatch_modes() -> list[Any]:
    return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]


# -- breaks inside autograd's backward (a whole training step captured) -------------------------


@eager_on_graph(strict=True, name="peers.relu_forward")
def _relu_forward(h: torch.Tensor, out: torch.Tensor) -> None:
    torch.clamp(h, min=0, out=out)


@eager_on_graph(strict=True, name="peers.relu_backward")
def _relu_backward(h: torch.Tensor, grad_out: torch.Tensor, grad_in: torch.Tensor) -> None:
    torch.mul(grad_out, h > 0, out=grad_in)


class _BreakReLU(torch.autograd.Function):
    """ReLU whose forward and backward each run as a break writing into a buffer."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(h)
        _relu_forward(h, out)
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        grad_in = torch.empty_like(h)
        _relu_backward(h, grad_out.contiguous(), grad_in)
        return grad_in


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 12)
        self.fc3 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two break-ReLUs: two breaks in forward, two in backward (in separate autograd nodes)
        return self.fc3(_BreakReLU.apply(self.fc2(_BreakReLU.apply(self.fc1(x)))))


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, t: torch.Tensor
) -> None:
    nn.functional.mse_loss(model(x), t).backward()
    opt.step()


def test_a_training_step_with_breaks_in_backward_replays_like_eager() -> None:
    # Meta's package and bcg's own CUDA suite capture forward, backward (a custom Function whose
    # backward is a break) and the optimizer step as one graph. On the CPU backend autograd ran
    # each backward node under the dispatch-mode stack of the backward() call, so after the
    # break the ended segment's recorder was back on the stack: the capture failed ("dispatch
    # mode(s) _CompilingRecorder ... still active") and left that recorder on the stack for
    # good, refusing every later torch.equal / .item() of the process as a host sync.
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, t = torch.randn(5, 6), torch.randn(5, 3)
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        _train_step(model, opt, x, t)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    graph = BreakableCUDAGraph(backend="cpu")
    opt.zero_grad(set_to_none=False)
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        _train_step(model, opt, x, t)
    assert _dispatch_modes() == []
    assert not is_breakable_capture_active()
    assert graph.break_names.count("peers.relu_backward") == 2
    ref_opt.zero_grad(set_to_none=False)
    _train_step(reference, ref_opt, x.clone(), t.clone())  # the capture was one real step
    for _ in range(3):
        new_x, new_t = torch.randn(5, 6), torch.randn(5, 3)
        x.copy_(new_x)
        t.copy_(new_t)
        opt.zero_grad(set_to_none=False)
        with torch.no_grad():  # (a break's arguments that required grad: the next test)
            graph.replay()
        ref_opt.zero_grad(set_to_none=False)
        _train_step(reference, ref_opt, new_x, new_t)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad)
            assert torch.equal(p, q)


def test_a_capture_failing_after_a_break_in_backward_leaves_no_recorder() -> None:
    # The user's code raises after the backward: the recorder autograd put back on the stack
    # stayed there (recording, and refusing host reads, for the rest of the process).
    torch.manual_seed(0)
    model = _Net()
    x, t = torch.randn(5, 6), torch.randn(5, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(ValueError, match="after backward"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        nn.functional.mse_loss(model(x), t).backward()
        raise ValueError("after backward")
    assert _dispatch_modes() == []
    assert not is_breakable_capture_active()
    assert torch.equal(torch.ones(2), torch.ones(2))  # a host read, outside any capture


# -- a break given a tensor that requires grad, replayed in grad mode ------------------------------


@eager_on_graph(name="peers.scale_into")
def _scale_into(h: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(h, 2, out=out)


def test_a_break_argument_that_required_grad_replays_without_autograd() -> None:
    # On CUDA a break's tensor arguments are replayed through aliases, which carry no autograd
    # history. The CPU backend kept an argument that required grad as itself, so a replay in
    # grad mode ran the break with autograd: an out= op raised "functions with out=...
    # arguments don't support automatic differentiation" (and a break's result depended on
    # the replay's grad mode).
    w = torch.ones(3, requires_grad=True)
    x = torch.tensor([1.0, 2.0, 3.0])
    out = torch.zeros(3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        h = x * w  # requires grad
        with torch.no_grad():  # as in an autograd.Function's forward
            _scale_into(h, out)
    x.copy_(torch.tensor([4.0, 5.0, 6.0]))
    graph.replay()  # in grad mode
    assert torch.equal(out, torch.tensor([8.0, 10.0, 12.0]))


# -- the debug check (BCG_DEBUG / debug=): tensors a break keeps without returning them ----------

_kept: list[torch.Tensor] = []

_LIB = torch.library.Library("bcg_peers_test", "DEF")
_LIB.define("scaled_copy(Tensor src) -> Tensor")


def _scaled_copy_kernel(src: torch.Tensor) -> torch.Tensor:
    _kept.append(src * 3)  # kept, not returned: what the debug check exists to report
    return src.clone()


_LIB.impl("scaled_copy", _scaled_copy_kernel, "CPU")


@torch.library.custom_op("bcg_peers_test::bump", mutates_args=["x"])
def _bump(x: torch.Tensor) -> None:
    _kept.append(x * 5)
    x.add_(1)


@eager_on_graph(name="peers.via_library_op")
def _via_library_op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.bcg_peers_test.scaled_copy(x)


@eager_on_graph(name="peers.via_custom_op")
def _via_custom_op(x: torch.Tensor) -> None:
    torch.ops.bcg_peers_test.bump(x)


@pytest.mark.parametrize("call", [_via_library_op, _via_custom_op], ids=["library", "custom_op"])
def test_the_debug_check_sees_a_tensor_kept_inside_a_custom_op(call: Any) -> None:
    # sglang's debug check reports a tensor kept by a custom op's kernel (old Library.impl and
    # torch.library.custom_op). bcg's dispatch mode saw only the custom op itself (a mode is
    # popped while it handles an op), so the kernel's kept tensor was never reported.
    _kept.clear()
    x = torch.ones(8)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(CaptureError, match="neither returned nor wrote"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, debug="strict"),
    ):
        call(x * 1)
    assert len(_kept) == 1  # the kernel ran once, under the check
    _kept.clear()


_BIG = 10_000_000  # 40 MB: the C allocator maps it, and maps a freed one at the same address


def test_keep_alive_ok_exempts_a_storage_not_its_address() -> None:
    # sglang keys its exemption by a weak reference to the storage. bcg kept the address: a
    # marked tensor that died exempted the next tensor the break made and kept at that address.
    kept: list[torch.Tensor] = []
    reused: list[bool] = []

    @eager_on_graph(name="peers.marks_then_keeps")
    def marks_then_keeps(x: torch.Tensor) -> None:
        table = keep_alive_ok(x * 2)
        address = table.untyped_storage().data_ptr()
        del table
        kept.append(x * 3)
        reused.append(kept[0].untyped_storage().data_ptr() == address)

    x = torch.ones(_BIG)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(CaptureError, match="neither returned nor wrote"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, debug="strict"),
    ):
        marks_then_keeps(x)
    assert reused  # (reused or not, the kept tensor is a leak)
