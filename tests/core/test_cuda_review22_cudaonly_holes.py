"""Holes of review 22 in code that only runs on CUDA (the CPU backend has one device and no
stream hooks). The runner tests need two GPUs (the nvidia-h100-x2 device kind)."""

from __future__ import annotations

import warnings

import pytest
import torch
from cuda_helpers import assert_idle, randn, refresh

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
)

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 20_000_000  # about 10 ms on an H200: long enough to lose any race


@eager_on_graph(name="plus_one22")
def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1


def _step(x: torch.Tensor) -> torch.Tensor:
    return _plus_one(x * 2) * 3


two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (the nvidia-h100-x2 device kind)",
)


@two_gpus
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


def test_a_side_stream_a_break_enters_with_its_own_context_manager_is_joined() -> None:
    # `with side:` (torch.Stream's context manager) sets the current stream in C++, past the
    # torch.cuda.set_stream hook: the break's side stream went unnoticed, so neither the capture
    # nor a replay ordered the next segment after the side stream's work.
    side = torch.cuda.Stream()
    torch.cuda.synchronize()

    @eager_on_graph(name="side_fill22")
    def side_fill(dst: torch.Tensor) -> None:
        with side:  # no event: what it writes depends on nothing the caller's stream does
            torch.cuda._sleep(SLEEP_CYCLES)
            dst.fill_(7.0)

    buf = torch.zeros(64, device="cuda")
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        x = buf * 0
        side_fill(buf)
        out = buf + x + 1
    assert_idle()
    assert "__enter__" not in torch.cuda.Stream.__dict__  # the hook is gone, torch.Stream's back
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(3):
        buf.zero_()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == [8.0] * 64


@two_gpus
def test_a_break_side_stream_is_joined_into_the_capture_device_replay_stream() -> None:
    # A replay of a runner on cuda:1 called with cuda:0 current joined the break's side stream
    # into cuda:0's current stream; the bridge copy, on cuda:1's, read the side stream's
    # unfinished result.
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    side = torch.cuda.Stream(dev)

    @eager_on_graph(name="side_result22")
    def side_result(src: torch.Tensor) -> torch.Tensor:
        side.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            return src * 3

    runner = BreakableGraphRunner(lambda x: side_result(x + 1) - 1, device=dev)
    runner.capture(torch.zeros(256, device=dev))
    for value in (1.0, 4.0):
        out = runner(torch.full((256,), value, device=dev))
        torch.cuda.synchronize(dev)
        assert out.tolist() == [(value + 1) * 3 - 1] * 256
    assert (runner.stats.hits, runner.stats.failed_captures) == (2, 0)


def test_a_segment_waiting_on_an_event_a_break_recorded_captures() -> None:
    # A break records an event on its side stream (a prefetch) and the next segment waits on
    # it: the tracker had forgotten the break's records when that segment began, so the wait
    # was made, and CUDA refused a capturing stream's wait on uncaptured work. It is dropped
    # silently now: the break's side stream is joined after it, at capture and at each replay.
    side = torch.cuda.Stream()
    done = torch.cuda.Event()

    @eager_on_graph(name="prefetch22")
    def prefetch(src: torch.Tensor, dst: torch.Tensor) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            dst.copy_(src * 3)
        done.record(side)

    x = randn(64)
    buf = torch.zeros(64, device="cuda")
    graph = BreakableCUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with BreakableCUDAGraphCapture(graph):
            y = x + 1
            prefetch(y, buf)
            torch.cuda.current_stream().wait_event(done)
            out = buf - 1
    assert not [w for w in caught if "bcg" in str(w.message)]
    assert_idle()
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(3):
        refresh(x)
        buf.zero_()  # stale data would show up as -1 in `out`
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, (x + 1) * 3 - 1)


def test_an_event_recorded_on_a_torch_accelerator_stream_forks_a_side_stream() -> None:
    # torch.accelerator.current_stream() is a torch.Stream, not a torch.cuda.Stream: it has no
    # cuda_stream, and the tracker's bookkeeping of a wait on an event recorded on it failed the
    # capture with an AttributeError.
    side = torch.cuda.Stream()
    x = randn(64)
    torch.cuda.synchronize()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        y = x * 2
        fork = torch.cuda.Event()
        fork.record(torch.accelerator.current_stream())
        side.wait_event(fork)
        with torch.cuda.stream(side):
            z = y + 1
        torch.cuda.current_stream().wait_stream(side)
        out = _plus_one(z)
    assert_idle()
    for _ in range(3):
        refresh(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x * 2 + 2)
