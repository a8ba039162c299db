"""Holes adversarial tests found in the runner and the bridges, on the CPU backend: each was a
silently wrong result or a wrong report, and is now a miss, an eager run or a clear error."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
)


def test_negative_zero_is_another_signature_than_zero() -> None:
    runner = BreakableGraphRunner(lambda x, s: x / s, device="cpu", warmup_iters=0)
    x = torch.ones(2)
    assert torch.equal(runner.capture(x, 0.0), torch.full((2,), float("inf")))
    for _ in range(2):  # the second call would meet the last hit's guard
        assert torch.equal(runner(x, -0.0), torch.full((2,), -float("inf")))
        assert torch.equal(runner(x, 0.0), torch.full((2,), float("inf")))
    assert runner.stats.hits == 2 and runner.stats.misses == 2


@eager_on_graph(name="th.maybe")
def _relu_if_needed(y: torch.Tensor) -> torch.Tensor:
    return y if bool((y >= 0).all()) else y.clamp(min=0)


@eager_on_graph(name="th.pair")
def _pair(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = y + 1
    return (t, t) if bool((y >= 0).all()) else (t, t.abs())


def test_a_break_that_returned_its_argument_and_then_a_new_tensor_raises() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        return _relu_if_needed(y) + 10 * y

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    assert torch.equal(runner.capture(torch.tensor([1.0, 2.0])), torch.tensor([11.0, 22.0]))
    assert torch.equal(runner(torch.tensor([3.0, 4.0])), torch.tensor([33.0, 44.0]))
    with pytest.raises(BreakOutputError, match=r"th\.maybe.*shared with one of its arguments"):
        runner(torch.tensor([-1.0, 2.0]))


def test_one_tensor_returned_twice_must_stay_one_tensor() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        a, b = _pair(x * 1)
        return a + 10 * b

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    assert torch.equal(runner.capture(torch.tensor([1.0, 2.0])), torch.tensor([22.0, 33.0]))
    # a fresh tensor twice again is fine (one copy feeds both)
    assert torch.equal(runner(torch.tensor([2.0, 3.0])), torch.tensor([33.0, 44.0]))
    with pytest.raises(BreakOutputError, match=r"th\.pair.*output\[1\]"):
        runner(torch.tensor([-3.0, 1.0]))


def test_a_break_calling_its_own_runner_gets_an_eager_run() -> None:
    holder: list[BreakableGraphRunner] = []
    depth = [0]

    @eager_on_graph(name="th.reenter")
    def reenter(y: torch.Tensor) -> torch.Tensor:
        if depth[0] == 0:
            depth[0] += 1
            try:
                return y + holder[0](y + 100)
            finally:
                depth[0] -= 1
        return y.clone()

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return reenter(y) + y

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    holder.append(runner)
    for x in (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])):
        want = step(x)
        assert torch.equal(runner.capture(x) if not runner.stats.entries else runner(x), want)
    assert runner.stats.failed_captures == 0 and runner.stats.captures == 1


def test_a_replay_that_raised_is_not_a_hit() -> None:
    boom = [False]

    @eager_on_graph(name="th.boom")
    def brk(x: torch.Tensor) -> torch.Tensor:
        if boom[0]:
            raise ValueError("boom")
        return x + 1

    runner = BreakableGraphRunner(lambda x: brk(x * 2), device="cpu")
    runner.capture(torch.ones(2))
    boom[0] = True
    for _ in range(3):
        with pytest.raises(ValueError, match="boom"):
            runner(torch.ones(2))
    boom[0] = False
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 3.0))
    assert runner.stats.hits == 1 and runner.stats.entries[0].replays == 1


def test_capture_many_reports_a_capture_spoiled_by_another_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inside, release = threading.Event(), threading.Event()

    @eager_on_graph(name="th.hold")
    def hold(h: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(timeout=30)
        return h + 1

    def other_thread() -> None:
        g = BreakableCUDAGraph(backend="cpu")
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(g):
            hold(torch.ones(2))

    def step(x: torch.Tensor) -> torch.Tensor:
        if is_breakable_capture_active():  # what CUDA raises while another thread captures
            raise RuntimeError("operation not permitted when stream is capturing")
        return x * 2

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert inside.wait(30)
        with caplog.at_level(logging.CRITICAL, logger="bcg_core"):
            report = runner.capture_many([((torch.ones(3),), {})], progress=False)
    finally:
        release.set()
        thread.join()
    assert report.captured == ()
    assert len(report.failed) == 1 and "ConcurrentCaptureError" in report.failed[0][1]
