"""Holes an adversarial review found in breaks and graphs, on the CPU backend (2026-12-04):
each was a silently wrong replay or a raw error, and is now right or a clear error."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from graph_helpers import cpu_capture

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
)

_views = {"same": True}


@eager_on_graph(name="bh.views")
def _views_of_one(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = t * 2
    return (y, y[1:]) if _views["same"] else (y, (t * 3)[1:])


def test_outputs_that_view_one_tensor_must_view_one_tensor_again() -> None:
    # Copying two separate tensors into bridges that overlap overwrote one with the other.
    x = torch.arange(5.0)
    graph, out = cpu_capture(lambda: tuple(v + 0 for v in _views_of_one(x)))
    x.copy_(torch.arange(5.0) + 1)
    graph.replay()
    assert torch.equal(out[0], (x * 2)) and torch.equal(out[1], (x * 2)[1:])
    _views["same"] = False
    try:
        with pytest.raises(BreakOutputError, match="views of one tensor"):
            graph.replay()
    finally:
        _views["same"] = True


class _Mode(enum.IntEnum):
    SHORT = 3
    LONG = 5


_lengths: dict[str, Any] = {}


@eager_on_graph(name="bh.length")
def _length(lens: torch.Tensor) -> Any:
    return _lengths["kind"](lens.numpy().max())


@pytest.mark.parametrize(
    ("kind", "first", "then"),
    [(np.int64, 3, 5), (np.float64, 3, 5), (lambda v: _Mode(int(v)), 3, 5)],
    ids=["numpy int", "numpy float", "int enum"],
)
def test_a_non_python_number_a_break_returns_is_frozen_and_checked(
    kind: Callable[[Any], Any], first: int, then: int
) -> None:
    _lengths["kind"] = kind
    lens, x = torch.tensor([first]), torch.arange(10.0)
    graph, out = cpu_capture(lambda: x[: int(_length(lens))].sum().reshape(1))
    graph.replay()
    assert out.item() == sum(range(first))
    lens.fill_(then)
    with pytest.raises(BreakOutputError, match="at replay but was"):
        graph.replay()


@eager_on_graph(name="bh.transpose")
def _transpose_in_place(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h.t_()
    return h @ w


def test_a_break_changing_an_argument_layout_in_place_is_refused_at_capture() -> None:
    # Replays passed the transposed tensor and transposed it back: every other replay computed
    # with the untransposed one.
    x, w = torch.randn(3, 3), torch.randn(3, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(CaptureError, match=r"changed the layout of a tensor argument in place"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        _transpose_in_place(x + 1, w)
    assert not is_breakable_capture_active()
    graph.reset()
    graph, out = cpu_capture(lambda: (x + 1) @ w)
    graph.replay()
    assert torch.equal(out, (x + 1) @ w)


@eager_on_graph(name="bh.into")
def _into(h: torch.Tensor, out: torch.Tensor) -> None:
    out.resize_(h.shape)
    out.copy_(h * 2)


def test_a_break_filling_an_empty_out_buffer_replays() -> None:
    buf, x = torch.empty(0), torch.randn(4)
    graph, _ = cpu_capture(lambda: _into(x + 1, buf))
    x.copy_(torch.ones(4))
    graph.replay()
    assert torch.equal(buf, torch.full((4,), 4.0))


@eager_on_graph(name="bh.fast")
def _fast_path(t: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("no fast kernel for this shape")


def test_code_catching_a_break_error_at_capture_goes_on_in_a_new_segment() -> None:
    x = torch.randn(4)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        try:
            y = _fast_path(x)
        except NotImplementedError:
            y = x.softmax(-1)  # the fallback, captured
        out = y * 2
    for _ in range(2):
        x.copy_(torch.randn(4))
        graph.replay()
        assert torch.equal(out, x.softmax(-1) * 2)


@eager_on_graph(name="bh.double")
def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_an_inference_mode_capture_replays_outside_inference_mode() -> None:
    x = torch.randn(4)
    graph = BreakableCUDAGraph(backend="cpu")
    with torch.inference_mode(), enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = _double(x + 1) + 1
    x.copy_(torch.randn(4))
    graph.replay()  # the bridge is an inference tensor: torch refused the copy outside the mode
    assert torch.equal(out, (x + 1) * 2 + 1)


@eager_on_graph(name="bh.scores")
def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (q @ k.T).softmax(-1).float()  # a bf16 matmul under autocast


_k, _w = torch.randn(8, 16), torch.randn(16, 16)


def _attention_step(x: torch.Tensor) -> torch.Tensor:
    return _scores((x @ _w).float(), _k) * 2


def test_breaks_replay_under_the_autocast_they_were_captured_under() -> None:
    x = torch.randn(8, 16)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        out = _attention_step(x)
    x.copy_(torch.randn(8, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _attention_step(x)
    graph.replay()  # outside autocast: the break recomputed in float32 before
    assert torch.equal(out, want)


def test_a_runner_call_under_another_autocast_runs_eagerly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = BreakableGraphRunner(_attention_step, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner.capture(torch.randn(8, 16))
    x = torch.randn(8, 16)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        assert torch.equal(runner(x), _attention_step(x))
    assert "captured with autocast" in caplog.text
    assert runner.stats.hits == 0 and runner.stats.misses == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = runner(x)
        assert torch.equal(got, _attention_step(x))
    assert runner.stats.hits == 1
