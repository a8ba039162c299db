"""Holes found in session 25, on the CPU graph backend."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from bcg_core import BreakableGraphRunner

_SHAPE = (7, 13)  # no other tensor in the process has it
_seen: list[int] = []


def _host_sync_step(x: torch.Tensor) -> torch.Tensor:
    _seen.append(
        sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.shape == _SHAPE)
    )
    return x * float(x.sum().item())  # a host sync: the capture fails


def test_the_eager_run_after_a_failed_capture_does_not_keep_the_capture_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The runner served a failed capture's call eagerly from inside its except block, so the
    # error's traceback kept the capture's frames, and with them its static buffers (and on
    # CUDA its graph and pool), alive through the eager run: two copies of the step's memory
    # at the peak.
    caplog.set_level(logging.CRITICAL, logger="bcg_core")
    runner = BreakableGraphRunner(_host_sync_step, device="cpu", warmup_iters=0)
    x = torch.randn(_SHAPE)
    _seen.clear()
    out = runner.capture(x)
    assert torch.equal(out, x * float(x.sum().item()))
    assert runner.stats.failed_captures == 1
    # The capture's run saw x and its static copy; the eager run after it sees x alone.
    assert _seen == [2, 1]
