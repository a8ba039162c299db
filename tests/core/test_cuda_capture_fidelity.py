"""Faithful capture, torch.compile and profiler names on a real GPU (see
test_cpu_capture_fidelity.py for the scenarios shared with the CPU backend)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import assert_idle, randn, refresh

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph

pytestmark = pytest.mark.cuda

seen: list[float] = []


@eager_on_graph(name="peek")
def peek(x: torch.Tensor) -> torch.Tensor:
    seen.append(float(x.sum().item()))  # what the break sees at capture
    return x * 2


def forward(x: torch.Tensor) -> torch.Tensor:
    return peek(x + 1.5) + 1


def test_break_sees_real_values_and_outputs_are_ready_on_the_callers_stream() -> None:
    x = torch.ones(4, device="cuda")
    forward(x)
    torch.cuda.synchronize()
    seen.clear()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        out = forward(x)
    # The segment before the break ran right after its capture: the break saw 4 * 2.5.
    assert seen == [10.0]
    # No synchronize: the caller's stream was ordered after the capturing stream at exit.
    assert torch.equal(out, torch.full((4,), 6.0, device="cuda"))
    assert_idle()


def test_faithful_off_only_records() -> None:
    x = torch.ones(4, device="cuda")
    forward(x)
    torch.cuda.synchronize()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, faithful=False):
        out = forward(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((4,), 6.0, device="cuda"))


def _compiled_body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(peek(torch.relu(x @ w)) @ w.t()) + 1


def test_break_inside_a_compiled_function_is_recorded_on_cuda() -> None:
    w, x = randn(32, 32), randn(8, 32)
    compiled = torch.compile(_compiled_body, backend="eager")
    compiled(x, w)
    torch.cuda.synchronize()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        out = compiled(x, w)
    assert graph.break_names == ("peek",) and graph.num_segments == 2
    for _ in range(3):
        refresh(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _compiled_body(x, w), rtol=0, atol=0)


def test_profile_names_segments_and_breaks_on_cuda() -> None:
    x = torch.ones(4, device="cuda")
    forward(x)
    torch.cuda.synchronize()
    graph = BreakableCUDAGraph(profile=True)
    with BreakableCUDAGraphCapture(graph):
        forward(x)
    with torch.profiler.profile() as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.name.startswith("bcg.")]
    assert names == ["bcg.segment[0]", "bcg.break:peek", "bcg.segment[1]"]
