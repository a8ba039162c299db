"""Holes found by injecting failures at every point of a capture and a replay (a break, its
stub, the barrier, a caught error, a runner method called from a break), through the public API
on the CPU backend; each pinned by a test that failed before its fix. After every failure the
state is checked clean and the same graph or runner captures and replays right again."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
)
from bcg_diffusion import DiTRunner, is_breakable_attention_installed


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


# -- runner methods called from a break of the runner's own replay ----------------------------

_from_break: dict[str, Callable[[], object] | None] = {"call": None}


@eager_on_graph(name="faults.meddle")
def _meddle(h: torch.Tensor) -> torch.Tensor:
    call = _from_break["call"]
    if call is not None:
        _from_break["call"] = None
        call()
    return h * 3


def _meddled(x: torch.Tensor) -> torch.Tensor:
    return _meddle(x + 1) * x  # the segment after the break reads the static input again


def test_check_divergence_from_a_break_of_its_runners_replay_is_refused() -> None:
    # The check loaded its own inputs into the static buffers and replayed the graph inside
    # the running replay, which then went on with the check's inputs: the call returned
    # 30300 everywhere (the check's input is 100) where eager gives 330, 396, 468, 546, and the
    # pool's busy mark was cleared under the running replay.
    runner = BreakableGraphRunner(_meddled, device="cpu")
    runner.capture(torch.arange(4.0))
    y = torch.arange(4.0) + 10
    _from_break["call"] = lambda: runner.check_divergence(torch.full((4,), 100.0))
    with pytest.raises(RuntimeError, match=r"check_divergence\(\) was called from a break"):
        runner(y)
    assert runner._turn.busy is None
    _assert_idle()
    assert torch.equal(runner(y), _meddled(y))
    assert runner.check_divergence(y).ok
    assert runner.stats.hits == 1


class _Attention(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _meddle(h)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x + 1) * x


def test_dit_runner_close_from_a_break_of_its_replay_leaves_it_open() -> None:
    # close() marked the runner closed before its reset() was refused: its patches stayed
    # installed and its graphs kept replaying, but the next reset() disabled it, saying its
    # patches were released; and the error named reset(), which the caller never called.
    model = _Model()
    runner = DiTRunner(model, attention_classes=(_Attention,), device="cpu")
    x = torch.arange(4.0)
    runner.capture(x)
    _from_break["call"] = runner.close
    with pytest.raises(RuntimeError, match="called from a break") as info:
        runner(x + 1)
    assert "bcg: raised by DiTRunner.close(), which resets the runner first" in _notes(info.value)
    _assert_idle()
    assert is_breakable_attention_installed(_Attention)
    runner.reset()
    assert runner.disabled_reason is None  # still open: it captures and replays again
    y = torch.arange(4.0) * 3
    assert torch.equal(runner.capture(y), model(y))
    assert torch.equal(runner(y + 1), model(y + 1))
    assert runner.stats.hits == 1
    runner.close()
    assert not is_breakable_attention_installed(_Attention)
    assert runner.disabled_reason is not None


# -- a break returning a tensor without fixed memory at a replay ---------------------------------

_returns: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {"as": None}


@eager_on_graph(name="faults.layout")
def _layout(h: torch.Tensor) -> torch.Tensor:
    make = _returns["as"]
    return h * 3 if make is None else make(h * 3)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize(
    ("kind", "make"),
    [
        ("sparse_coo", torch.Tensor.to_sparse),
        ("nested", lambda t: torch.nested.as_nested_tensor(list(t))),
        ("_mkldnn", torch.Tensor.to_mkldnn),
    ],
)
def test_a_break_returning_a_tensor_without_fixed_memory_at_replay_says_so(
    kind: str, make: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    # Refused with BreakOutputError at capture, but at replay torch's raw "Cannot access data
    # pointer of Tensor that doesn't have storage" (sparse, mkldnn) or "Internal error:
    # NestedTensorImpl doesn't support sizes. Please file an issue." (nested) came out.
    x = torch.arange(6.0).reshape(2, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    out = _capture(graph, lambda: _layout(x + 1) - 2)
    _returns["as"] = make
    try:
        with pytest.raises(BreakOutputError, match=f"returned output \\(a {kind}") as info:
            graph.replay()
    finally:
        _returns["as"] = None
    assert "Return its dense form" in str(info.value)
    assert "bcg: raised at replay by break 'faults.layout' (step 2 of 3)" in _notes(info.value)
    x.copy_(torch.arange(6.0).reshape(2, 3) * 4)
    graph.replay()  # the graph is unharmed
    assert torch.equal(out, (x + 1) * 3 - 2)


# -- an interrupt at any call the capture's entry makes ------------------------------------------


class _Interrupt(KeyboardInterrupt):
    pass


def _interrupt_call(at: int) -> Callable[..., Any]:
    """A trace function raising :class:`_Interrupt` at the ``at``-th call made directly by
    ``BreakableCUDAGraphCapture.__enter__`` (as a signal handler raising there would)."""
    calls = [0]

    def tracer(frame: Any, event: str, arg: Any) -> None:
        caller = frame.f_back
        if (
            event == "call"
            and caller is not None
            and caller.f_code is BreakableCUDAGraphCapture.__enter__.__code__
        ):
            calls[0] += 1
            if calls[0] == at:
                raise _Interrupt(f"call {at}")

    return tracer


def test_an_interrupt_at_any_call_entering_a_capture_leaves_nothing_behind() -> None:
    # Interrupted at ExitStack() (after the graph was marked capturing) the graph stayed
    # capturing for good: reset() and every capture refused it. Interrupted at
    # stack.callback(exit_capture, ...) the capture stayed active in this context: every later
    # capture was refused as nested.
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    at = 1
    while True:
        sys.settrace(_interrupt_call(at))
        try:
            with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
                _shift(x)
        except _Interrupt:
            pass
        else:
            break  # no call left to interrupt
        finally:
            sys.settrace(None)
        _assert_idle()
        graph.reset()
        out = _capture(graph, lambda: _shift(x * 3) * 2)
        x.copy_(torch.arange(4.0) * at)
        graph.replay()
        assert torch.equal(out, (x * 3 + 1) * 2), at
        graph.reset()
        at += 1
    assert at > 10  # every call was interrupted once
