"""Failure modes on a real GPU: every bad input and every failed capture leaves no state behind,
exceptions propagate unchanged, the same graph captures again after reset(), and two threads can
capture concurrently in thread_local mode."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cuda_helpers import assert_idle, randn, refresh

import bcg_core
from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    ReplayError,
    eager_on_graph,
)

pytestmark = pytest.mark.cuda

REPLAYS = 3


@eager_on_graph(name="shift")
def shift(t: torch.Tensor) -> torch.Tensor:
    return t + 0.5


def _forward(x: torch.Tensor) -> torch.Tensor:
    return shift(x.sin() * 2).exp()


def _expected(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2 + 0.5).exp()


def _capture_and_check(graph: BreakableCUDAGraph, x: torch.Tensor) -> None:
    """Capture `_forward` into `graph` and check it over several replays."""
    with BreakableCUDAGraphCapture(graph):
        out = _forward(x)
    assert_idle()
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, _expected(x))


# -- bad arguments -----------------------------------------------------------------------------


BAD_ARGUMENTS: dict[str, tuple[type[Exception], str, dict[str, Any]]] = {
    "capture_error_mode": (ValueError, "capture_error_mode", {"capture_error_mode": "strict"}),
    "barrier_fn": (TypeError, "barrier_fn", {"barrier_fn": 42}),
    "auto_join": (TypeError, "auto_join", {"auto_join": "yes"}),
    "stream": (TypeError, "stream", {"stream": "cuda:0"}),
}


def test_wrong_graph_type() -> None:
    with pytest.raises(TypeError, match="BreakableCUDAGraph"):
        BreakableCUDAGraphCapture(torch.cuda.CUDAGraph())  # type: ignore[arg-type]
    assert_idle()


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_leave_no_state(case: str) -> None:
    error, match, kwargs = BAD_ARGUMENTS[case]
    graph = BreakableCUDAGraph()
    with pytest.raises(error, match=match):
        BreakableCUDAGraphCapture(graph, **kwargs)
    assert_idle()
    assert not graph.is_captured
    _capture_and_check(graph, randn(64))  # still empty and usable


# -- misuse during and around capture ----------------------------------------------------------


def test_nested_capture() -> None:
    x = randn(64)
    outer = BreakableCUDAGraph()
    inner = BreakableCUDAGraph()
    with pytest.raises(CaptureError, match="nested"), BreakableCUDAGraphCapture(outer):
        x.cos()
        with BreakableCUDAGraphCapture(inner):
            pass
    assert_idle()
    assert not outer.is_captured
    with pytest.raises(ReplayError, match="failed"):
        outer.replay()
    _capture_and_check(inner, x)  # the inner graph was never touched


@pytest.mark.parametrize("which", ["other-graph", "same-graph"])
def test_replay_during_capture(which: str) -> None:
    x = randn(64)
    done = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(done):
        done_out = _forward(x)
    graph = BreakableCUDAGraph()
    with pytest.raises(ReplayError), BreakableCUDAGraphCapture(graph):
        x.cos()
        (done if which == "other-graph" else graph).replay()
    assert_idle()
    assert not graph.is_captured
    for _ in range(REPLAYS):  # the captured graph is unaffected
        refresh(x)
        done.replay()
        torch.testing.assert_close(done_out, _expected(x))
    _capture_and_check(BreakableCUDAGraph(), x)


def test_replay_of_never_captured_graph() -> None:
    graph = BreakableCUDAGraph()
    with pytest.raises(ReplayError, match="no capture"):
        graph.replay()
    assert_idle()


def test_replay_of_failed_graph() -> None:
    x = randn(64)
    graph = BreakableCUDAGraph()
    with pytest.raises(ValueError, match="boom"), BreakableCUDAGraphCapture(graph):
        x.cos()
        raise ValueError("boom")
    with pytest.raises(ReplayError, match="failed"):
        graph.replay()
    assert_idle()


def test_capture_into_captured_graph_needs_reset() -> None:
    x = randn(64)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        out = _forward(x)
    with pytest.raises(CaptureError, match="reset"), BreakableCUDAGraphCapture(graph):
        x.tan()
    assert_idle()
    assert graph.is_captured
    for _ in range(REPLAYS):  # the existing capture is intact
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, _expected(x))


# -- exceptions from the captured code ---------------------------------------------------------


class CustomError(Exception):
    pass


@eager_on_graph(name="exploding")
def exploding(t: torch.Tensor) -> torch.Tensor:
    raise ValueError("boom in break")


def _raise_in_first_segment(x: torch.Tensor) -> None:
    x.cos()
    raise ValueError("boom in segment")


def _raise_in_break(x: torch.Tensor) -> None:
    exploding(x.cos())


def _raise_in_later_segment(x: torch.Tensor) -> None:
    y = shift(x.cos())  # one segment and one break recorded before the failure
    y.sin()
    raise CustomError("boom after a break")


RAISERS: dict[str, tuple[Callable[[torch.Tensor], None], type[Exception], str]] = {
    "segment": (_raise_in_first_segment, ValueError, "boom in segment"),
    "break": (_raise_in_break, ValueError, "boom in break"),
    "later-segment": (_raise_in_later_segment, CustomError, "boom after a break"),
}


@pytest.mark.parametrize("where", sorted(RAISERS))
def test_exception_propagates_and_leaves_clean_state(where: str) -> None:
    body, error, message = RAISERS[where]
    x = randn(64)
    graph = BreakableCUDAGraph()
    with pytest.raises(error) as info, BreakableCUDAGraphCapture(graph):
        body(x)
    assert info.type is error
    assert str(info.value) == message
    if sys.version_info >= (3, 11):
        notes = getattr(info.value, "__notes__", [])
        assert any("breakable CUDA graph capture" in note for note in notes)
    assert_idle()
    assert not graph.is_captured
    with pytest.raises(ReplayError):
        graph.replay()
    graph.reset()
    _capture_and_check(graph, x)


# -- host syncs --------------------------------------------------------------------------------


def _normalize_in_segment(x: torch.Tensor) -> torch.Tensor:
    peak = x.abs().max().item()  # host sync: not capturable
    return x / (peak + 1)


@eager_on_graph(name="host_peak")
def host_peak(x: torch.Tensor) -> torch.Tensor:
    peak = x.abs().max().item()
    return x / (peak + 1)


def test_host_sync_in_segment_fails_cleanly_and_works_in_a_break() -> None:
    x = randn(256)
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError), BreakableCUDAGraphCapture(graph):
        y = x * 2
        _normalize_in_segment(y)
    assert_idle()
    torch.cuda.synchronize()  # nothing is left capturing
    assert not graph.is_captured

    graph.reset()
    with BreakableCUDAGraphCapture(graph):
        y = x * 2
        out = host_peak(y).tanh()
    assert_idle()
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, _normalize_in_segment(x * 2).tanh())


# -- concurrent captures -----------------------------------------------------------------------


@eager_on_graph(name="thread_break")
def thread_break(t: torch.Tensor, k: float) -> torch.Tensor:
    return t * k - 1


def test_thread_local_captures_in_two_threads() -> None:
    n = 2
    inputs = [randn(32, 32) for _ in range(n)]
    graphs = [BreakableCUDAGraph() for _ in range(n)]
    outs: list[torch.Tensor | None] = [None] * n
    errors: list[BaseException] = []
    both_inside = threading.Barrier(n, timeout=60)
    active_inside: list[bool] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            x = inputs[i]
            with BreakableCUDAGraphCapture(
                graphs[i], stream=stream, capture_error_mode="thread_local"
            ):
                y = x * (i + 2)
                both_inside.wait()  # both threads are inside their captures now
                z = thread_break(y, float(i + 1))
                both_inside.wait()
                outs[i] = z.sin() + x
                with lock:
                    active_inside.append(bcg_core.is_breakable_capture_active())
        except BaseException as exc:
            both_inside.abort()
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    if errors:  # re-raise the root cause, not the other thread's BrokenBarrierError
        first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (first or errors)[0]
    assert active_inside == [True, True]
    assert_idle()
    for i in range(n):
        assert graphs[i].step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        for i in range(n):
            refresh(inputs[i])
            graphs[i].replay()
        for i in range(n):
            x = inputs[i]
            out = outs[i]
            assert out is not None
            torch.testing.assert_close(out, (x * (i + 2) * (i + 1) - 1).sin() + x)


# -- garbage collection during capture ---------------------------------------------------------


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it (and what it holds)."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.me = self


def test_collection_during_capture_does_not_destroy_a_graph_mid_capture() -> None:
    # A dead plain graph caught in a cycle (an old runner's, say). If the collector ran inside
    # the capture, its destructor would destroy a CUDA graph, which invalidates a "global" capture.
    x = randn(64)
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x.add(1)
    graph = BreakableCUDAGraph()
    gc.collect()  # a fresh count: nothing collects the cycle before the capture starts
    dead = weakref.ref(cycle := _Cycle(old))
    del old, cycle
    thresholds = gc.get_threshold()
    try:
        with BreakableCUDAGraphCapture(graph):
            gc.set_threshold(1)  # any new container would start an automatic collection
            junk = [[i] for i in range(100)]
            out = _forward(x)
            assert dead() is not None  # nothing was collected inside the capture
    finally:
        gc.set_threshold(*thresholds)
    del junk
    assert gc.isenabled()
    assert_idle()
    gc.collect()
    assert dead() is None
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, _expected(x))
