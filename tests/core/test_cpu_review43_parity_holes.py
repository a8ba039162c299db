"""Holes found comparing the graph object and the capture context with torch.cuda.graphs'
contracts (torch's own test_graph_* cases), on the CPU graph backend."""

from __future__ import annotations

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    enable_breakable_cuda_graph,
    get_current_stream,
    is_breakable_capture_active,
)


def test_a_capture_on_the_default_stream_is_refused_as_on_cuda() -> None:
    # torch's CUDAGraph.capture_begin refuses the default stream ("CUDA graphs must be captured
    # on a non-default stream"); the CPU backend captured on it, so code passing
    # stream=get_current_stream() passed every CPU test and failed on its first GPU run.
    x = torch.ones(3)
    default = get_current_stream()
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(RuntimeError, match="non-default stream"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, stream=default),
    ):
        x + 1
    assert not is_breakable_capture_active()
    assert get_current_stream() is default
    # Failed as on CUDA: reset() and a capture on the pool's lane work.
    graph.reset()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = x + 1
    x.fill_(4.0)
    graph.replay()
    assert out.tolist() == [5.0] * 3
