"""Holes a second review of BreakableGraphRunner's and BreakableCUDAGraph's core semantics
found on the CPU backend: each was a silently wrong value or a raw error, and is now right or
refused clearly."""

from __future__ import annotations

import copy
import functools
import pickle
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
    enable_breakable_cuda_graph,
)


class _Noisy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.drop(self.lin(x)) * scale

    def decode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.drop(self.lin(x)) * scale


@pytest.mark.parametrize("wrap", ["partial", "partial_method", "compiled_method"])
def test_a_module_behind_a_partial_or_a_compiled_method_keeps_its_train_mode(wrap: str) -> None:
    # The runner reads the train()/eval() mode of the module it wraps, of a bound method's
    # module and of torch.compile's module; a functools.partial or a compiled bound method hid
    # the module, so a graph captured in eval() replayed after model.train() without dropout.
    model = _Noisy().eval()
    if wrap == "partial":
        step, call = functools.partial(model, scale=2.0), (torch.ones(3, 4),)
    elif wrap == "partial_method":
        step, call = functools.partial(model.decode, scale=2.0), (torch.ones(3, 4),)
    else:
        step, call = torch.compile(model.decode, backend="eager"), (torch.ones(3, 4), 2.0)
    runner = BreakableGraphRunner(step, device="cpu")
    with torch.no_grad():
        runner.capture(*call)
        assert torch.equal(runner(*call), step(*call)) and runner.stats.hits == 1
        model.train()
        torch.manual_seed(1)
        out = runner(*call)
        torch.manual_seed(1)
        assert torch.equal(out, step(*call))
        assert (out == 0).any()  # dropout ran
        assert runner.stats.hits == 1 and runner.stats.misses == 1


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_runner_or_graph_is_refused_clearly_by_copy_and_pickle(how: Any) -> None:
    # A shallow copy shared the runner's entries and pool: once the original was reset, the
    # copy replayed a reset graph (ReplayError); deepcopy and pickle failed on a lock.
    runner = BreakableGraphRunner(_add_one_step, device="cpu", warmup_iters=0)
    x = torch.ones(2)
    runner.capture(x)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        how(runner)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        y = _add_one(x * 2) * 3
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        how(graph)
    # Nothing was left behind: both still replay.
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(y, torch.full((2,), 15.0))
    assert torch.equal(runner(x), _add_one_step(x)) and runner.stats.hits == 1


@eager_on_graph(name="review16.add_one")
def _add_one(h: torch.Tensor) -> torch.Tensor:
    return h + 1


def _add_one_step(x: torch.Tensor) -> torch.Tensor:
    return _add_one(x * 2) * 3


def _concat(x: torch.Tensor, **parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, *parts.values()]) * 2


def test_keywords_a_step_takes_in_its_kwargs_keep_their_order() -> None:
    # The signature keys keywords by name, and **kwargs holds them in the call's order: a graph
    # captured with (a=, b=) replayed for (b=, a=) concatenated in the capture's order.
    runner = BreakableGraphRunner(_concat, device="cpu", warmup_iters=0)
    x, a, b = torch.zeros(1), torch.ones(2), torch.full((2,), 2.0)
    runner.capture(x, a=a, b=b)
    assert torch.equal(runner(x, a=a, b=b), _concat(x, a=a, b=b))
    assert torch.equal(runner(x, b=b, a=a), _concat(x, b=b, a=a))
    assert runner.stats.hits == 1 and runner.stats.misses == 1
    for _ in range(2):  # and the last hit's guard does not replay the other order either
        assert torch.equal(runner(x, a=a * 3, b=b), _concat(x, a=a * 3, b=b))
        assert torch.equal(runner(x, b=b, a=a * 3), _concat(x, b=b, a=a * 3))
    assert runner.stats.hits == 3 and runner.stats.misses == 3


def test_keywords_bound_by_name_still_share_one_graph_in_any_order() -> None:
    # A step that names its parameters (a module's forward with **kwargs too) sees no order.
    def step(x: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor, **rest: Any) -> torch.Tensor:
        return x + a * 2 - b

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    x, a, b = torch.zeros(2), torch.ones(2), torch.full((2,), 5.0)
    runner.capture(x, a=a, b=b, flag=True)
    assert torch.equal(runner(x, b=b, a=a, flag=True), step(x, a=a, b=b))
    assert runner.stats.hits == 1 and runner.stats.misses == 0


def _double_in_place(h: torch.Tensor) -> torch.Tensor:
    h.mul_(2)
    return h + 1


def test_a_returned_view_passed_back_as_a_written_argument_runs_eagerly() -> None:
    # With return_views=True the caller holds the static output; passed back as an argument
    # the graph writes (h = runner(h)), the copy-back of the argument after the replay
    # overwrote the output it returned: 2h instead of 2h + 1.
    runner = BreakableGraphRunner(_double_in_place, device="cpu", return_views=True)
    out = runner.capture(torch.ones(2))
    eager_arg = out.clone()
    eager = _double_in_place(eager_arg)
    assert torch.equal(runner(out), eager) and torch.equal(out, eager_arg)
    assert runner.stats.misses == 1 and runner.stats.hits == 0
    h = torch.ones(2)  # a fresh argument still replays
    assert torch.equal(runner(h), torch.full((2,), 3.0)) and torch.equal(h, torch.full((2,), 2.0))
    assert runner.stats.hits == 1


def test_a_returned_argument_passed_back_as_itself_replays() -> None:
    def step(h: torch.Tensor) -> torch.Tensor:
        return h.mul_(2)

    runner = BreakableGraphRunner(step, device="cpu", return_views=True)
    h = runner.capture(torch.ones(2))
    for _ in range(2):
        expected = h * 2
        h = runner(h)
        assert torch.equal(h, expected)
    assert runner.stats.hits == 2
