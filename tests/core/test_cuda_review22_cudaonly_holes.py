"""Holes of review 22 in code that only runs on CUDA (the CPU backend has one device and no
stream hooks). The tests below need two GPUs (the nvidia-h100-x2 device kind); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (the nvidia-h100-x2 device kind)",
    ),
]


@eager_on_graph(name="plus_one22")
def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1


def _step(x: torch.Tensor) -> torch.Tensor:
    return _plus_one(x * 2) * 3


def test_a_runner_on_the_second_gpu_captures_its_kernels_while_the_first_is_current() -> None:
    # The runner's warm-ups and capture took the lane of the *current* device (cuda:0): the
    # step's kernels on cuda:1 tensors went to cuda:1's own stream, uncaptured, so the graph
    # held no segment and every replay returned what the capture computed.
    torch.cuda.set_device(0)
    runner = BreakableGraphRunner(_step, device="cuda:1")
    first = runner.capture(torch.full((4,), 1.0, device="cuda:1"))
    torch.cuda.synchronize(1)
    assert first.tolist() == [12.0] * 4
    for value in (2.0, 5.0):
        out = runner(torch.full((4,), value, device="cuda:1"))
        torch.cuda.synchronize(1)
        assert out.tolist() == [(value * 2 + 1) * 3] * 4
    stats = runner.stats
    assert (stats.captures, stats.hits, stats.failed_captures) == (1, 2, 0)
    assert stats.entries[0].segments == 2
    assert torch.cuda.current_device() == 0
    assert torch.cuda.current_stream(1).cuda_stream == torch.cuda.default_stream(1).cuda_stream
