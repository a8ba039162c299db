"""Holes found comparing the graph object and the capture context with torch.cuda.graphs'
contracts (torch's own test_graph_* cases), on the CPU graph backend."""

from __future__ import annotations

import warnings

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    eager_on_graph,
    enable_breakable_cuda_graph,
    get_current_stream,
    is_breakable_capture_active,
)
from bcg_core._backends import backend_for  # noqa: PLC2701


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


def test_a_capture_that_records_nothing_warns_as_torch_does() -> None:
    # torch warns when a captured graph has no node ("The CUDA Graph is empty. This usually
    # means that the graph was attempted to be captured on wrong device or stream"); bcg drops
    # empty segments silently, so a CUDA graph captured over CPU tensors replayed nothing and
    # said nothing. A capture with a break is not empty (the break runs at every replay).
    x = torch.ones(3)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.warns(UserWarning, match="recorded no graph work and no break"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        x.view(-1)  # a view is no kernel
    graph.replay()  # legal, does nothing

    @eager_on_graph
    def doubled(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    only_break = BreakableCUDAGraph(backend="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not empty: the break runs at every replay
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(only_break):
            out = doubled(x)
    x.fill_(3.0)
    only_break.replay()
    assert out.tolist() == [6.0] * 3


def test_a_stream_of_another_backend_is_refused_when_the_capture_is_made() -> None:
    # The constructor accepted anything with a cuda_stream attribute: a CPU stream given to a
    # CUDA graph's capture sent its negative handle to the CUDA driver at __enter__ (a failed
    # query disables cuda-bindings for the process and ends in an ImportError saying to install
    # them), and a foreign stream given to a CPU capture failed only at __enter__.
    cpu_stream = backend_for("cpu").new_stream()
    with pytest.raises(TypeError, match=r"stream must be a torch\.cuda\.Stream"):
        BreakableCUDAGraphCapture(BreakableCUDAGraph(), stream=cpu_stream)

    class _Foreign:
        cuda_stream = 7

    with pytest.raises(TypeError, match="captures on its own streams"):
        BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu"), stream=_Foreign())
    # A stream of the graph's backend is taken, and captured on.
    x = torch.ones(2)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph, stream=cpu_stream):
        assert get_current_stream() is cpu_stream
        out = x + 1
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == [3.0, 3.0]
