"""The basic contract on a real GPU: segments + one break, replayed with new inputs."""

from __future__ import annotations

import pytest
import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph

pytestmark = pytest.mark.cuda

calls: list[str] = []


@eager_on_graph
def host_side_scale(x: torch.Tensor) -> torch.Tensor:
    calls.append("break")
    factor = float(x.abs().max().item()) + 1.0  # a host sync: uncapturable
    return x / factor


def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)
    h = host_side_scale(h)
    return torch.tanh(h @ w.t()) + 1


def test_one_break_replays_with_new_inputs() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda")
    static_x = torch.randn(8, 64, device="cuda")
    forward(static_x, w)  # warm-up
    torch.cuda.synchronize()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        static_out = forward(static_x, w)
    assert graph.num_segments == 2
    assert graph.step_kinds == ("graph", "break", "graph")
    assert graph.break_names == ("host_side_scale",)
    calls.clear()
    for _ in range(3):
        new = torch.randn(8, 64, device="cuda")
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, forward(new, w), rtol=0, atol=0)
    assert calls == ["break"] * 6  # three replays + three eager references
