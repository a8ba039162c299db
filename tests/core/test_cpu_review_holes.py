"""Holes a review of the public capture API and the runner found, on the CPU backend
(2026-12-05): each was a crash with an unclear error, a silently wrong result, or capture state
left behind, and is now right or a clear error."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphError,
    BreakableGraphRunner,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
)


@eager_on_graph(name="rh.strict", strict=True)
def _strict_returning(t: torch.Tensor) -> torch.Tensor:
    return t * 2  # refused: a strict break returns no device tensor


@eager_on_graph(name="rh.transpose")
def _transpose_in_place(t: torch.Tensor) -> torch.Tensor:
    t.t_()  # refused: changes an argument's layout in place
    return t * 2


@eager_on_graph(name="rh.plain")
def _plain(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _refuse_barrier() -> None:
    raise BreakableGraphError("barrier refused")


_REFUSALS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[], None] | None]] = {
    "strict output": (_strict_returning, None),
    "layout changed": (_transpose_in_place, None),
    "barrier raised": (_plain, _refuse_barrier),
}


@pytest.mark.parametrize("refusal", sorted(_REFUSALS))
def test_code_catching_a_refused_break_goes_on_capturing(refusal: str) -> None:
    # A break that raises leaves the capture in a new segment; one that bcg refused after it
    # ran (or whose barrier raised) left none: the fallback's ops were not recorded and the
    # capture's exit failed an internal assertion ("end_segment() outside a segment").
    fn, barrier = _REFUSALS[refusal]
    x = torch.randn(3, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph, barrier_fn=barrier):
        try:
            y = fn(x + 1)
        except BreakableGraphError:
            y = (x + 1) * 3  # the fallback, captured
        out = y + 1
    assert not is_breakable_capture_active()
    for _ in range(2):
        x.copy_(torch.randn(3, 3))
        graph.replay()
        assert torch.equal(out, (x + 1) * 3 + 1)


class _Lengths:
    """Host metadata an engine hands to its eager attention (a plain object)."""

    def __init__(self, n: int) -> None:
        self.n = n


@eager_on_graph(name="rh.attention")
def _attention(h: torch.Tensor, meta: _Lengths) -> torch.Tensor:
    return h[: meta.n].sum().reshape(1).expand(4).clone()


def _step(x: torch.Tensor, meta: _Lengths) -> torch.Tensor:
    return _attention(x + 1, meta) * 2


def test_an_equal_object_replays_only_while_the_captured_one_still_equals_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An object argument is keyed by its contents and passed to the graph as itself: the
    # replay's breaks read the object of the capture. An engine with two metadata objects
    # (double buffering) passed the second while the first had changed since: the replay read
    # the first one's length, silently (30 where eager gives 12).
    x = torch.arange(8.0)
    first = _Lengths(3)
    runner = BreakableGraphRunner(_step, device="cpu", warmup_iters=0)
    runner.capture(x, first)
    second = _Lengths(3)
    assert torch.equal(runner(x, second), _step(x, second))  # the captured one equals it
    assert runner.stats.hits == 1
    first.n = 5
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        assert torch.equal(runner(x, second), _step(x, second))
    assert "changed since the capture" in caplog.text
    assert runner.stats.hits == 1 and runner.stats.misses == 1
    assert torch.equal(runner(x, first), _step(x, first))  # a miss: n=5 is not captured
    first.n = 3
    assert torch.equal(runner(x, second), _step(x, second))
    assert runner.stats.hits == 2


def _inner(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_runner_called_inside_another_capture_runs_its_step_into_it() -> None:
    # A runner for a submodule, called while a bigger step is captured (by hand or by another
    # runner): its replay raised ReplayError and failed the outer capture, and its capture
    # window failed and blocked the signature for good.
    inner = BreakableGraphRunner(_inner, device="cpu", warmup_iters=0)
    x = torch.randn(4)
    inner.capture(x)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = inner(x + 1) * 3
    x.copy_(torch.randn(4))
    graph.replay()
    assert torch.equal(out, _inner(x + 1) * 3)

    fresh = BreakableGraphRunner(_inner, device="cpu", warmup_iters=0)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = fresh.capture(x + 1) * 3
    assert not fresh.blocked_signatures and fresh.stats.failed_captures == 0
    x.copy_(torch.randn(4))
    graph.replay()
    assert torch.equal(out, _inner(x + 1) * 3)
    fresh.capture(x)  # captured now that no other capture is open
    assert fresh.stats.captures == 1 and torch.equal(fresh(x + 1), _inner(x + 1))

    outer = BreakableGraphRunner(lambda t: inner(t + 1) * 3, device="cpu", warmup_iters=1)
    outer.capture(x)
    assert outer.stats.captures == 1 and not outer.blocked_signatures
    x.copy_(torch.randn(4))
    assert torch.equal(outer(x), _inner(x + 1) * 3)
    assert outer.stats.hits == 1


def _scale(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * n


def test_a_lifted_int_beyond_int64_is_a_constant_not_a_slot() -> None:
    # An int named in as_tensor is written into an int64 slot: one beyond its range raised
    # torch's raw overflow error at a replay (eager computes x * 2**63), and at a capture it
    # blocked the signature of every int for good.
    x = torch.randn(3)
    runner = BreakableGraphRunner(_scale, device="cpu", warmup_iters=0, as_tensor=(1,))
    runner.capture(x, 3)
    big = 2**63
    assert torch.equal(runner(x, big), _scale(x, big))
    assert torch.equal(runner(x, 5), _scale(x, 5)) and runner.stats.hits == 1

    fresh = BreakableGraphRunner(_scale, device="cpu", warmup_iters=0, as_tensor=(1,))
    with pytest.raises(OverflowError):
        fresh.capture(x, 2**64)  # eager's own error: torch cannot multiply by it either
    fresh.capture(x, 3)
    assert fresh.stats.captures == 1
    assert torch.equal(fresh(x, -7), _scale(x, -7)) and fresh.stats.hits == 1


@eager_on_graph(name="rh.stubbed", capture_stub=torch.zeros_like)
def _stubbed(h: torch.Tensor) -> torch.Tensor:
    return h.softmax(-1)


def _stubbed_step(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    y = _stubbed(x * 2) + 1
    out.copy_(y)  # an argument written in place: copied back to the caller
    return y


def test_a_runner_capture_with_a_capture_stub_returns_the_calls_result() -> None:
    # A runner returns the capture's own output (the capture executed the step), but where a
    # capture_stub ran instead of a break that output was computed from the stub's values:
    # the first call of every signature returned ones here, and wrote them into `out`.
    x = torch.randn(4)
    runner = BreakableGraphRunner(_stubbed_step, device="cpu", warmup_iters=1)
    out, want = torch.empty(4), torch.empty(4)
    assert torch.equal(runner.capture(x, out), _stubbed_step(x, want))
    assert torch.equal(out, want)
    assert runner.stats.entries[0].capture_runs == 3  # warm-up, capture, the replay after it
    x = torch.randn(4)
    assert torch.equal(runner(x, out), _stubbed_step(x, want)) and torch.equal(out, want)


@pytest.mark.parametrize("wrap", ["module", "bound method", "compiled"])
def test_a_graph_captured_in_eval_mode_is_not_replayed_in_train_mode(
    wrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The graph holds the capture's mode: batch norm in eval() reads the running statistics,
    # in train() the batch's (and updates the running ones). model.train() after an eval()
    # capture used to replay the eval graph silently.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    with torch.no_grad():
        model[1].running_mean.fill_(3.0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    reference.load_state_dict(model.state_dict())
    stepped: Any = {
        "module": model,
        "bound method": model.forward,
        "compiled": torch.compile(model, backend="eager"),
    }[wrap]
    runner = BreakableGraphRunner(stepped, device="cpu", warmup_iters=0)
    x = torch.randn(6, 4)
    with torch.no_grad():
        runner.capture(x)
        model.train()
        reference.train()
        with caplog.at_level(logging.WARNING, logger="bcg_core"):
            got = runner(x)
        assert torch.equal(got, reference(x))
        assert torch.equal(model[1].running_mean, reference[1].running_mean)
        assert "captured in eval() mode" in caplog.text
        assert runner.stats.hits == 0
        model.eval()
        reference.eval()
        assert torch.equal(runner(x), reference(x))
        assert runner.stats.hits == 1
