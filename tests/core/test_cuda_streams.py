"""Side streams on a real GPU: forks and joins inside segments, auto-join, UnjoinedStreamError,
side-stream work left running by a break, and stream hooks removed after every capture."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import assert_idle, randn, refresh

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    ReplayError,
    UnjoinedStreamError,
    eager_on_graph,
)
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701

pytestmark = pytest.mark.cuda

REPLAYS = 3
SLEEP_CYCLES = 20_000_000  # about 10 ms on an H200: long enough to lose any race


def _warm_stream() -> torch.cuda.Stream:
    """A new side stream on which cuBLAS has already run once (as torch's docs advise)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a = randn(64, 64)
        a @ a
    torch.cuda.synchronize()
    return side


@eager_on_graph(name="halve")
def halve(t: torch.Tensor) -> torch.Tensor:
    return t / 2


# -- forks and joins inside a segment ----------------------------------------------------------


@pytest.mark.parametrize("after_break", [False, True], ids=["first-segment", "after-break"])
def test_fork_and_join_with_wait_stream(after_break: bool) -> None:
    x = randn(64, 64)
    side = _warm_stream()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, auto_join=False):
        src = halve(x * 4) if after_break else x
        cap = torch.cuda.current_stream()
        side.wait_stream(cap)
        with torch.cuda.stream(side):
            a = src @ src
        b = src.sin()
        cap.wait_stream(side)
        out = a + b
    assert_idle()
    assert graph.step_kinds == (("graph", "break", "graph") if after_break else ("graph",))
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        s = x * 2 if after_break else x
        torch.testing.assert_close(out, s @ s + s.sin(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fork", ["stream.wait_event", "event.wait"])
@pytest.mark.parametrize("join", ["stream.wait_event", "event.wait", "event.wait-current"])
def test_fork_and_join_with_events(fork: str, join: str) -> None:
    x = randn(4096)
    side = torch.cuda.Stream()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, auto_join=False):
        cap = torch.cuda.current_stream()
        y = x * 3
        forked = torch.cuda.Event()
        forked.record(cap)
        if fork == "stream.wait_event":
            side.wait_event(forked)
        else:
            forked.wait(side)
        with torch.cuda.stream(side):
            a = y.exp()
            done = torch.cuda.Event()
            done.record()  # on the current stream: side
        if join == "stream.wait_event":
            cap.wait_event(done)
        elif join == "event.wait":
            done.wait(cap)
        else:
            done.wait()  # on the current stream: the capturing stream
        out = a - y
    assert_idle()
    assert graph.step_kinds == ("graph",)
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, (x * 3).exp() - x * 3)


@pytest.mark.parametrize("ends_at", ["capture-end", "break"])
def test_unjoined_fork_is_auto_joined(ends_at: str) -> None:
    x = randn(1024)
    side = torch.cuda.Stream()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):  # auto_join=True by default
        y = x * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            z = y.sin() + 1
        # no join: the segment's end joins `side` into the capturing stream
        if ends_at == "break":
            w = halve(z)
    assert_idle()
    assert graph.step_kinds == (("graph", "break") if ends_at == "break" else ("graph",))
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(z, (x * 2).sin() + 1)
        if ends_at == "break":
            torch.testing.assert_close(w, ((x * 2).sin() + 1) / 2)


@pytest.mark.parametrize("ends_at", ["capture-end", "break"])
def test_unjoined_fork_without_auto_join_names_the_stream(ends_at: str) -> None:
    x = randn(1024)
    side = torch.cuda.Stream()
    graph = BreakableCUDAGraph()
    with (
        pytest.raises(UnjoinedStreamError) as info,
        BreakableCUDAGraphCapture(graph, auto_join=False),
    ):
        y = x * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y.add_(1)
        if ends_at == "break":
            halve(y)
    message = str(info.value)
    assert repr(side) in message  # the code names streams by repr()
    assert f"{side.cuda_stream:#x}" in message  # torch's repr carries the handle in hex
    assert_idle()
    assert not graph.is_captured
    with pytest.raises(ReplayError):
        graph.replay()

    # nothing is left capturing (a device-wide sync would fail), the side stream works eagerly
    # again, and the same graph captures once the fork is joined
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        eager = x * 5
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(eager, x * 5)
    graph.reset()
    with BreakableCUDAGraphCapture(graph, auto_join=False):
        cap = torch.cuda.current_stream()
        y = x * 2
        side.wait_stream(cap)
        with torch.cuda.stream(side):
            y.add_(1)
        cap.wait_stream(side)
        out = halve(y)
    assert_idle()
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, (x * 2 + 1) / 2)


# -- side-stream work left running by a break --------------------------------------------------


def test_break_side_stream_work_is_finished_before_next_segment() -> None:
    side = torch.cuda.Stream()
    w = randn(128, 128) / 128**0.5

    @eager_on_graph(name="slow_side_work")
    def slow_side_work(src: torch.Tensor, dst: torch.Tensor) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            acc = src
            for _ in range(8):
                acc = torch.tanh(acc @ w)
            dst.copy_(acc)
        # returns without joining `side`

    def eager_chain(src: torch.Tensor) -> torch.Tensor:
        acc = src
        for _ in range(8):
            acc = torch.tanh(acc @ w)
        return acc

    x = randn(64, 128)
    buf = torch.empty(64, 128, device="cuda")
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        y = x * 2
        slow_side_work(y, buf)
        out = buf + 1
    assert_idle()
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x)
        buf.zero_()  # stale data would show up as zeros in `out`
        graph.replay()
        expected = eager_chain(x * 2)
        torch.testing.assert_close(buf, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out, expected + 1, rtol=1e-4, atol=1e-4)


# -- hooks -------------------------------------------------------------------------------------


def test_break_returning_side_stream_result_is_bridged_after_the_join() -> None:
    # The break returns a tensor computed on a side stream it did not join: at replay the bridge
    # copy (on the replay stream) must wait for that stream, or it copies unfinished data.
    side = torch.cuda.Stream()
    w = randn(128, 128) / 16

    @eager_on_graph(name="side_result")
    def side_result(src: torch.Tensor) -> torch.Tensor:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            acc = src
            for _ in range(8):
                acc = torch.tanh(acc @ w)
        return acc

    def eager(src: torch.Tensor) -> torch.Tensor:
        acc = src * 2
        for _ in range(8):
            acc = torch.tanh(acc @ w)
        return acc + 1

    x = randn(64, 128)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        out = side_result(x * 2) + 1
    assert_idle()
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-4)


def test_hooks_installed_only_while_capturing() -> None:
    x = randn(16)
    original_record = torch.cuda.Event.record
    assert not hooks_installed()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        during = hooks_installed()
        y = halve(x + 1)
        in_break_after = hooks_installed()
        out = y + 1
    assert during and in_break_after
    assert not hooks_installed()
    assert torch.cuda.Event.record is original_record

    failed = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="inside capture"), BreakableCUDAGraphCapture(failed):
        assert hooks_installed()
        raise RuntimeError("inside capture")
    assert not hooks_installed()
    assert torch.cuda.Event.record is original_record
    assert_idle()
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, (x + 1) / 2 + 1)
