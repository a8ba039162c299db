"""After a failed capture, torch itself is usable again: eager CUDA random numbers work and the
same graph captures and replays (the library, not a test fixture, repairs torch's state)."""

from __future__ import annotations

import pytest
import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, is_breakable_capture_active

pytestmark = pytest.mark.cuda


def test_eager_rng_and_recapture_work_after_a_failed_capture() -> None:
    x = torch.ones(64, device="cuda")
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError), BreakableCUDAGraphCapture(graph):
        y = x * 2
        y.sum().item()  # a host sync inside a segment invalidates the capture
    assert not is_breakable_capture_active()
    assert not torch.cuda.is_current_stream_capturing()
    noise = torch.randn(1024, device="cuda")  # fails if the generator were left capturing
    assert noise.std().item() > 0.5
    graph.reset()
    with BreakableCUDAGraphCapture(graph):
        out = x * 3 + torch.rand(64, device="cuda") * 0
    for value in (1.0, 2.0, 5.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full((64,), 3 * value, device="cuda"))
