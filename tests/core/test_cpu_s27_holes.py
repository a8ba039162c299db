"""Holes found in session 27 by the lead (CPU backend)."""

from __future__ import annotations

import warnings

import pytest
import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, BreakableGraphRunner


def test_a_runner_over_a_step_without_device_work_warns_nothing() -> None:
    # The empty-capture warning is for code run on another device than the graph's; the
    # runner picks its backend from the arguments, so a step returning a view of its argument
    # (nothing to record) is no such mistake and must not warn.
    runner = BreakableGraphRunner(lambda x: x[1:], device="cpu")
    x = torch.arange(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.capture(x)
        out = runner(x)
    assert runner.stats.hits >= 1
    assert torch.equal(out, x[1:])


def test_a_direct_capture_that_records_nothing_still_warns() -> None:
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.warns(UserWarning, match="recorded no graph work"),
        BreakableCUDAGraphCapture(graph),
    ):
        pass
