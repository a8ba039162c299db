"""Holes found by injecting failures at every point of a capture and a replay (a break, its
stub, the barrier, a caught error, a runner method called from a break), through the public API
on the CPU backend; each pinned by a test that failed before its fix. After every failure the
state is checked clean and the same graph or runner captures and replays right again."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
)


def _assert_idle() -> None:
    assert not is_breakable_capture_active()
    assert not is_in_breakable_cuda_graph()
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0
    assert "tolist" not in torch.Tensor.__dict__  # the CPU backend's host-read hooks are gone


def _capture(graph: BreakableCUDAGraph, fn: Callable[[], Any]) -> Any:
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        return fn()


def _notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", []))


# -- an error raised in a break is said to be raised in that break --------------------------------

_fail_in: dict[str, BaseException | None] = {"break": None, "stub": None, "barrier": None}


def _take(where: str) -> None:
    exc = _fail_in[where]
    if exc is not None:
        _fail_in[where] = None
        raise exc


@eager_on_graph(name="faults.triple")
def _triple(h: torch.Tensor) -> torch.Tensor:
    _take("break")
    return h * 3


def _stub(h: torch.Tensor) -> torch.Tensor:
    _take("stub")
    return h * 3


@eager_on_graph(name="faults.triple", capture_stub=_stub)
def _stubbed_triple(h: torch.Tensor) -> torch.Tensor:
    return h * 3


def _barrier() -> None:
    _take("barrier")


@pytest.mark.parametrize("where", ["break", "stub", "barrier"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_raised_in_a_break_at_capture_is_noted_in_that_break(
    where: str, error: type[BaseException]
) -> None:
    # The note said "raised in graph segment 2 (after break 'faults.triple')": the segment after
    # the break had begun by the time the capture's exit wrote it, so the user was sent to the
    # code after the break for an error of the break, its stub or the barrier.
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    brk = _stubbed_triple if where == "stub" else _triple

    def step() -> torch.Tensor:
        return brk(x + 1) - 2

    raised = _fail_in[where] = error("injected")
    with (
        pytest.raises(error, match="injected") as info,
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, barrier_fn=_barrier),
    ):
        step()
    assert info.value is raised
    assert _notes(raised) == [
        "bcg: raised in break 'faults.triple' of a breakable CUDA graph capture"
    ]
    _assert_idle()
    graph.reset()
    out = _capture(graph, step)
    x.copy_(torch.arange(4.0) * 5)
    graph.replay()
    assert torch.equal(out, step())


def test_an_error_raised_after_a_caught_break_error_is_noted_where_it_is_raised() -> None:
    # The break's error is caught by the step (a fallback path) and another error is raised
    # later: that one is noted in the segment it was raised in.
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    _fail_in["break"] = ValueError("break failed")
    with (
        pytest.raises(KeyError) as info,
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        try:
            _triple(x)
        except ValueError:
            raise KeyError("fallback failed") from None
    where = "in graph segment 2 (after break 'faults.triple')"
    assert _notes(info.value) == [f"bcg: raised {where} of a breakable CUDA graph capture"]
    _assert_idle()


# -- an error that ended a segment's capture, caught by the captured code ------------------------


@eager_on_graph(name="faults.shift")
def _shift(h: torch.Tensor) -> torch.Tensor:
    return h + 1


def _step_catching_the_failed_segment(x: torch.Tensor) -> torch.Tensor:
    with contextlib.suppress(RuntimeError):
        (x * 2).sum().item()  # a host sync, swallowed: the segment's capture is invalidated
    try:
        return _shift(x * 3)  # the segment ends here, with the host sync's error
    except RuntimeError:
        return x * 10  # a fallback path, run after the capture was lost


def test_a_capture_whose_segment_failed_cannot_succeed_by_catching_the_error() -> None:
    # The segment ended with HostSyncError at the break; the step caught it and went on. The
    # capture then succeeded, holding one segment with none of the step's ops, so every replay
    # silently returned the capture's values (on CUDA the stream had left capture mode there).
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    with pytest.raises(CaptureError, match="caught the error that ended") as info:
        _capture(graph, lambda: _step_catching_the_failed_segment(x))
    assert "operation not permitted when stream is capturing" in str(info.value.__cause__)
    assert not graph.is_captured
    _assert_idle()
    graph.reset()
    out = _capture(graph, lambda: _shift(x * 3) * 2)
    x.copy_(torch.arange(4.0) * 7)
    graph.replay()
    assert torch.equal(out, (x * 3 + 1) * 2)
