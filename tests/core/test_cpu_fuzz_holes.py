"""Holes found by a randomized differential fuzzer on the CPU graph backend: random step
programs (views, in-place ops, casts, reductions, breaks returning new tensors, views, tuples,
dicts, None or their written argument) run eagerly, through a hand capture and through
``BreakableGraphRunner``, compared bitwise over replays with fresh input values. A small seeded
run of the fuzzer is kept here, with the minimized regressions."""

from __future__ import annotations

import warnings

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
    enable_breakable_cuda_graph,
)

# -- minimized regressions -------------------------------------------------------------------


def _write_first(x: torch.Tensor) -> torch.Tensor:
    x[0].add_(1)  # x expanded: its one element is seen at every position
    return x * 2


def test_an_expanded_argument_the_graph_writes_runs_eagerly() -> None:
    runner = BreakableGraphRunner(_write_first, device="cpu")
    runner.capture(torch.zeros(2))
    x = torch.zeros(1).expand(2)
    out = runner(x)  # raised torch's raw "more than one element of the written-to tensor"
    ref = torch.zeros(1).expand(2)
    assert torch.equal(out, _write_first(ref))
    assert torch.equal(x, ref)
    assert runner.stats.misses == 1
    # Dense arguments still replay.
    y = torch.zeros(2)
    assert torch.equal(runner(y), torch.tensor([2.0, 0.0]))
    assert runner.stats.hits == 1


def test_an_expanded_argument_the_capture_writes_is_served_eagerly() -> None:
    runner = BreakableGraphRunner(_write_first, device="cpu")
    x = torch.zeros(1).expand(2)
    out = runner.capture(x)  # raised the same raw error after the capture
    ref = torch.zeros(1).expand(2)
    assert torch.equal(out, _write_first(ref))
    assert torch.equal(x, ref)
    assert runner.stats.captures == 0
    y = torch.zeros(2)
    runner.capture(y)  # the signature is not blocked: dense tensors capture
    assert runner.stats.captures == 1


@eager_on_graph
def _and_its_tail(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + 1
    return y, y[1:]  # empty for one row


def test_a_break_returning_an_empty_view_of_its_output_replays() -> None:
    x = torch.zeros(1, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        y, tail = _and_its_tail(x)
        out = y * 2
    x.fill_(5)
    graph.replay()  # raised BreakOutputError: the empty view's data_ptr() is 0
    assert torch.equal(out, torch.full((1, 3), 12.0))
    assert tail.shape == (0, 3)


def _set_through_reshape(x: torch.Tensor) -> torch.Tensor:
    x.reshape(-1)[..., :1] = 7
    return x + 1


def test_an_argument_written_through_a_reshape_in_inference_mode_is_copied_back() -> None:
    with torch.inference_mode():
        runner = BreakableGraphRunner(_set_through_reshape, device="cpu")
        runner.capture(torch.zeros(2))
        x = torch.zeros(2)
        out = runner(x)
    assert runner.stats.hits == 1
    assert torch.equal(out, torch.tensor([8.0, 1.0]))
    assert torch.equal(x, torch.tensor([7.0, 0.0]))  # was left [0, 0]: the write was not seen


def test_a_write_through_a_reshape_in_inference_mode_bumps_the_version() -> None:
    with torch.inference_mode(False):
        s = torch.zeros(2)
    with torch.inference_mode():
        graph = BreakableCUDAGraph(backend="cpu")
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            before = s._version
            _set_through_reshape(s)
        assert s._version != before  # as on CUDA, where no dispatch mode records the ops


def test_a_vector_matmul_in_inference_mode_captures_without_a_warning() -> None:
    v, m = torch.randn(4), torch.randn(4, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "output ... was resized" (eager warns nothing)
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            out = v @ m
        v.copy_(torch.randn(4))
        graph.replay()
    assert torch.equal(out, v @ m)
