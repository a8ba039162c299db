"""Parity with torch.cuda.graphs' contracts that only a GPU shows (review 43)."""

from __future__ import annotations

import warnings

import pytest
import torch
from cuda_helpers import randn

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph
from bcg_core._backends import backend_for  # noqa: PLC2701

pytestmark = pytest.mark.cuda


@eager_on_graph(name="plus43")
def _plus(t: torch.Tensor) -> torch.Tensor:
    return t + 1


def test_a_cuda_graph_captured_over_cpu_tensors_warns_that_it_replays_nothing() -> None:
    # torch warns "The CUDA Graph is empty" for such a graph; bcg silences that per segment
    # (adjacent breaks make empty ones), so the capture replayed nothing and said nothing.
    x = torch.ones(4)  # on the CPU: nothing reaches the capturing stream
    graph = BreakableCUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with BreakableCUDAGraphCapture(graph):
            out = x * 2
    ours = [w for w in caught if "recorded no graph work" in str(w.message)]
    assert len(ours) == 1 and "'cuda'" in str(ours[0].message)
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    assert graph.num_segments == 0 and graph.num_breaks == 0
    x.fill_(5.0)
    graph.replay()
    assert out.tolist() == [2.0] * 4  # what the warning said: the replay did nothing


def test_a_capture_with_a_break_or_device_work_does_not_warn() -> None:
    x = randn(8)
    for step in (lambda: _plus(x), lambda: x * 2):
        graph = BreakableCUDAGraph()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with BreakableCUDAGraphCapture(graph):
                step()
        assert not [w for w in caught if "recorded no graph work" in str(w.message)]


def test_a_cpu_stream_is_refused_by_a_cuda_capture_before_it_reaches_the_driver() -> None:
    # The constructor accepted any object with a cuda_stream attribute: the CPU stream's
    # negative handle went to cudaStreamIsCapturing at __enter__.
    graph = BreakableCUDAGraph()
    with pytest.raises(TypeError, match=r"stream must be a torch\.cuda\.Stream"):
        BreakableCUDAGraphCapture(graph, stream=backend_for("cpu").new_stream())
    x = randn(8)
    with BreakableCUDAGraphCapture(graph, stream=torch.cuda.Stream()):
        out = _plus(x) * 2
    graph.replay()
    torch.testing.assert_close(out, (x + 1) * 2)
