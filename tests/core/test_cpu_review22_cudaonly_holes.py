"""Holes of review 22 in logic that runs only on CUDA, driven here through a CPU capture: the
CPU backend installs no stream hooks, so each test reports to the capture's stream tracker what
the CUDA hooks report for the same calls (``_backends/cuda.py``)."""

from __future__ import annotations

import warnings

import torch
from graph_helpers import cpu_capture

from bcg_core import eager_on_graph
from bcg_core._backends.cpu import CpuEvent, CpuStream  # noqa: PLC2701
from bcg_core._capture.context import active_capture  # noqa: PLC2701


def test_a_wait_on_an_event_a_break_recorded_is_dropped_silently() -> None:
    # A break that records an event on a side stream (a prefetch) for a later segment to wait
    # on: the tracker forgot the break's records when the next segment began, so the wait was
    # made, and CUDA refused it as a wait on uncaptured work (failing the capture). The break's
    # streams are joined after it (at capture and at every replay): the wait holds already.
    side, done = CpuStream(), CpuEvent()

    @eager_on_graph(name="prefetch22")
    def prefetch(t: torch.Tensor) -> torch.Tensor:
        state = active_capture()
        assert state is not None
        state.tracker.on_record(done, side)  # what done.record(side) reports on CUDA
        return t + 1

    dropped: list[bool] = []

    def step() -> torch.Tensor:
        y = prefetch(torch.ones(3) * 2)
        state = active_capture()
        assert state is not None
        # What torch.cuda.current_stream().wait_event(done) asks on CUDA.
        dropped.append(state.tracker.drops_wait(state.stream, done))
        return y * 3

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silently: the wait holds
        graph, out = cpu_capture(step)
    assert dropped == [True]
    assert graph.break_names == ("prefetch22",)
    assert out.tolist() == [9.0] * 3


def test_waits_on_events_of_an_earlier_segment_or_of_the_capturing_stream_are_dropped() -> None:
    # Session 25: the tracker forgot a segment's records when the next began, and a break's
    # record on the capturing stream itself was checked as a capturing stream's (made): both
    # waits reached CUDA, which refused them (the capture failed with a raw error). Both are
    # ordered before the segment that waits, at capture and at every replay.
    side, early, in_break = CpuStream(), CpuEvent(), CpuEvent()

    @eager_on_graph(name="mark25")
    def mark(t: torch.Tensor) -> torch.Tensor:
        state = active_capture()
        assert state is not None
        state.tracker.on_record(in_break, state.stream)  # in_break.record() on the caller's
        return t + 1

    dropped: list[bool] = []

    def step() -> torch.Tensor:
        state = active_capture()
        assert state is not None
        state.tracker.on_record(early, side)  # early.record(side) in the first segment
        y = mark(torch.ones(3) * 2)
        dropped.append(state.tracker.drops_wait(state.stream, early))
        dropped.append(state.tracker.drops_wait(state.stream, in_break))
        return y * 3

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph, out = cpu_capture(step)
    assert dropped == [True, True]
    assert graph.break_names == ("mark25",)
    assert out.tolist() == [9.0] * 3
