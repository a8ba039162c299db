"""Stream holes of review 20 that only a GPU shows (the CPU backend installs no stream hooks)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import assert_idle, randn, refresh

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph

pytestmark = pytest.mark.cuda


@eager_on_graph(name="halve20")
def _halve(t: torch.Tensor) -> torch.Tensor:
    return t / 2


def test_a_fork_joined_after_a_break_is_reported_as_auto_joined() -> None:
    # A side stream forked in one segment and joined in the next (after a break) is joined by
    # auto_join when its segment ends; the later join's wait is then on a stream that is not
    # capturing and was dropped with a warning that it "holds work issued outside the capture",
    # which it never did. The warning now says the fork was joined when its segment ended.
    x = randn(64, 64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ x  # cuBLAS's first use on this stream, outside the capture
    torch.cuda.synchronize()
    graph = BreakableCUDAGraph()
    with (
        pytest.warns(RuntimeWarning, match=r"forked in an earlier segment .* \(auto_join\)"),
        BreakableCUDAGraphCapture(graph),
    ):
        cap = torch.cuda.current_stream()
        side.wait_stream(cap)
        with torch.cuda.stream(side):
            a = x @ x
        h = _halve(x)
        cap.wait_stream(side)
        out = a + h
    assert_idle()
    for _ in range(3):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, x @ x + x / 2, rtol=1e-4, atol=1e-4)
