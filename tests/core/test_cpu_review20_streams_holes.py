"""Holes found in bcg's handling of streams (review 20), each pinned by a test on the CPU
backend: a capture that left the rest of the forward on a stream other than the capturing one,
or stream state behind after an error."""

from __future__ import annotations

import contextvars
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    get_current_stream,
)
from bcg_core._backends import backend_for  # noqa: PLC2701
from bcg_core._backends.cpu import current_cpu_stream  # noqa: PLC2701
from bcg_core._capture.context import active_capture  # noqa: PLC2701
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701


def test_a_break_that_switches_the_current_stream_and_does_not_restore_it_is_refused() -> None:
    # In a copy of the context: the break's block, never exited, is closed by its finaliser
    # once the test drops it, and resetting its stream there made a stale stream current in
    # this context for the tests after it (the leak guard of tests/conftest.py saw it).
    contextvars.copy_context().run(_a_break_that_leaves_a_stream_current)


def _a_break_that_leaves_a_stream_current() -> None:
    # A break that set a side stream current and left it so made the next segment capture on
    # that stream (the segment captures on the current stream), not on the capturing stream
    # get_current_stream() names; on CUDA the rest of the forward then ran unordered with the
    # caller's stream and outside the pool's lane. It is refused at capture, naming the break
    # and the stream, and the capturing stream is current again for the code after it.
    backend = backend_for("cpu")
    side = backend.new_stream()
    entered: list[Any] = []
    seen: list[Any] = []

    @eager_on_graph
    def switches(x: torch.Tensor) -> torch.Tensor:
        context = backend.stream_context(side)
        context.__enter__()  # never exited: the hole
        entered.append(context)
        return x * 2

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = switches(x + 1)
        seen.append(current_cpu_stream())
        return y + 1

    caller = current_cpu_stream()
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(CaptureError, match=r"switches' made <bcg_core CPU stream") as info,
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        try:
            forward(torch.ones(3))
        except CaptureError:
            assert seen == [] and current_cpu_stream() is get_current_stream()
            raise
    assert repr(side) in str(info.value) and "restore" in str(info.value)
    assert current_cpu_stream() is caller and side.capturing is None
    assert active_capture() is None and not hooks_installed()


def test_a_break_that_switches_streams_and_restores_them_is_captured() -> None:
    backend = backend_for("cpu")
    side = backend.new_stream()

    @eager_on_graph
    def uses_a_side_stream(x: torch.Tensor) -> torch.Tensor:
        with backend.stream_context(side):
            out = x * 2
        get_current_stream().wait_stream(side)
        return out

    x = torch.ones(3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = uses_a_side_stream(x + 1) + 1
    assert torch.equal(out, torch.full((3,), 5.0))
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 7.0))


def test_a_cpu_runner_captures_on_its_stream() -> None:
    # runner.stream is documented as the stream warm-ups and captures run on (the capture lane
    # of its pool, made with the pool); the CPU backend made a new stream at every access, so
    # runner.stream was never the same object twice, nor the stream a capture ran on.
    seen: list[Any] = []

    @eager_on_graph
    def notes_the_stream(x: torch.Tensor) -> torch.Tensor:
        seen.append(get_current_stream())
        return x * 2

    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return notes_the_stream(x + 1) + 1

    runner = BreakableGraphRunner(Step(), device="cpu", warmup_iters=1)
    assert runner.stream is runner.stream
    out = runner.capture(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 5.0))
    assert seen and all(s is runner.stream for s in seen)
    assert torch.equal(runner(torch.full((3,), 2.0)), torch.full((3,), 7.0))
    assert runner.stream.capturing is None


def test_a_break_that_switches_streams_and_raises_leaves_the_capturing_stream_current() -> None:
    # In a copy of the context, as above: the block left open is closed late.
    contextvars.copy_context().run(_a_break_that_switches_streams_and_raises)


def _a_break_that_switches_streams_and_raises() -> None:
    # A fallback path that catches a break's error goes on in a new segment: it began on the
    # stream the failed break made current, not on the capturing stream.
    backend = backend_for("cpu")
    side = backend.new_stream()
    entered: list[Any] = []

    @eager_on_graph
    def fails(x: torch.Tensor) -> torch.Tensor:
        context = backend.stream_context(side)
        context.__enter__()  # never exited (held, so collecting it does not exit it either)
        entered.append(context)
        raise RuntimeError("no kernel for this shape")

    @eager_on_graph
    def fallback(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        try:
            y = fails(y)
        except RuntimeError:
            assert current_cpu_stream() is get_current_stream() is not side
            y = fallback(y)
        return y + 1

    x = torch.ones(3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = forward(x)
    assert torch.equal(out, torch.full((3,), 7.0))
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 10.0))
    assert side.capturing is None and active_capture() is None and not hooks_installed()
