"""Holes found by trying, through the public API on the CPU backend, the behaviours that
TensorRT-LLM's and vLLM's breakable / piecewise CUDA graph tests check (TensorRT-LLM's
``test_breakable_cuda_graph.py`` and piecewise cleanup tests; vLLM's ``test_breakable_cudagraph``,
``tests/compile/piecewise``), each pinned by a test that failed before its fix."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    break_graph,
    enable_breakable_cuda_graph,
)

# -- break_graph() inside torch.compile(fullgraph=True) -------------------------------------------


def _sin_split_cos(x: torch.Tensor) -> torch.Tensor:
    y = x.sin() + 1
    break_graph()
    return y.cos()


def test_break_graph_under_fullgraph_says_why_it_cannot_compile() -> None:
    # TensorRT-LLM's break_graph() is an empty break that compiles away inside a
    # torch.compile(fullgraph=True) function. bcg's is a dynamo graph break (DESIGN, "Breaks
    # over compiled code"), which fullgraph=True refuses; the refusal was dynamo's raw "Attempted
    # to call function marked as skipped", naming bcg's internal `_split` in torch/_compile.py
    # and hinting to force dynamo to trace into it.
    torch._dynamo.reset()
    compiled = torch.compile(_sin_split_cos, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"break_graph\(\).*fullgraph=True") as info:
        compiled(torch.randn(3))
    assert "`_split`" not in str(info.value)


def test_break_graph_under_default_compile_still_splits_and_replays() -> None:
    # The message must not cost the default mode its split: still one graph break's worth of
    # segments, replayed equal to the function run eagerly.
    torch._dynamo.reset()
    compiled = torch.compile(_sin_split_cos, backend="aot_eager")
    x = torch.randn(3)
    assert torch.equal(compiled(x), _sin_split_cos(x))  # warm-up: compiles
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        static = compiled(x)
    assert graph.num_segments == 2 and graph.num_breaks == 0
    for _ in range(2):
        x.copy_(torch.randn(3))
        graph.replay()
        assert torch.equal(static, _sin_split_cos(x))
