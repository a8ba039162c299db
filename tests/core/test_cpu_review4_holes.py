"""Holes a review of the runner's serving-engine use found, on the CPU backend (2026-12-07):
``capture_many`` reports, counters that add up, and shared pools. Each was a silently wrong
result or report, or an unclear error, and is now right or a clear error."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph


@eager_on_graph(name="r4.squash")
def _squash(h: torch.Tensor) -> torch.Tensor:
    return h.tanh()


class _Dropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _squash(self.drop(self.lin(x)))


def test_capture_many_names_why_a_captured_signature_ran_eagerly() -> None:
    # capture_many again for shapes captured in eval() mode, now in train() mode (or under
    # autocast): the calls run eagerly and are reported failed, but the reason given was "an
    # argument the graph writes shares memory with another argument", which nothing here does.
    model = _Dropped().eval()
    runner = BreakableGraphRunner(model, device="cpu", warmup_iters=0)
    calls = [((torch.randn(2, 3),), {})]
    assert len(runner.capture_many(calls).captured) == 1
    model.train()
    (failed,) = runner.capture_many(calls).failed
    assert "train()" in failed[1] and "shares memory" not in failed[1]
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (failed,) = runner.capture_many(calls).failed
    assert "autocast" in failed[1] and "shares memory" not in failed[1]


def _calls(runner: BreakableGraphRunner) -> int:
    s = runner.stats
    return s.hits + s.misses + s.captures + s.failed_captures


def test_every_call_is_counted_once() -> None:
    # hits + misses + captures + failed captures = calls. A capture that disabled the runner
    # (more segments than max_segments) ran the call eagerly and counted it nowhere, and so
    # did a call a break made to its own runner (an eager run, like one inside a capture).
    @eager_on_graph(name="r4.add")
    def add(h: torch.Tensor) -> torch.Tensor:
        return h + 1

    def step(x: torch.Tensor) -> torch.Tensor:
        return add(_squash(x * 2) * 3) * 4

    runner = BreakableGraphRunner(step, device="cpu", max_segments=1, warmup_iters=0)
    x = torch.randn(3)
    assert torch.equal(runner.capture(x), step(x))
    assert runner.disabled_reason is not None
    assert _calls(runner) == 1 and runner.stats.misses == 1
    runner(x)
    assert _calls(runner) == 2

    holder: list[BreakableGraphRunner] = []
    depth = [0]

    @eager_on_graph(name="r4.reenter")
    def reenter(y: torch.Tensor) -> torch.Tensor:
        if depth[0]:
            return y.clone()
        depth[0] += 1
        try:
            return y + holder[0](y + 100)
        finally:
            depth[0] -= 1

    inner = BreakableGraphRunner(lambda y: reenter(y * 2), device="cpu", warmup_iters=0)
    holder.append(inner)
    inner.capture(x)  # one capture, one nested call
    inner(x)  # one hit, one nested call
    assert _calls(inner) == 4
    assert inner.stats.captures == 1 and inner.stats.hits == 1 and inner.stats.misses == 2


@pytest.mark.parametrize(
    ("item", "said"),
    [
        ((torch.ones(2),), "a tuple of 1 item (Tensor)"),
        ((torch.ones(2), torch.ones(2)), "a tuple of 2 items (Tensor, Tensor)"),
        (([torch.ones(2)], {}), "a tuple of 2 items (list, dict)"),
        (torch.ones(2), "Tensor"),
    ],
)
def test_capture_many_says_what_a_malformed_call_is(item: Any, said: str) -> None:
    # An args tuple given without its kwargs dict, or a list of args, was refused with "item 0
    # is tuple": what capture_many asks for is a tuple, so the error named nothing wrong.
    runner = BreakableGraphRunner(lambda x: x * 2, device="cpu")
    with pytest.raises(TypeError, match=re.escape(f"item 0 is {said}")):
        runner.capture_many([item])


def test_a_break_calling_a_runner_of_the_same_pool_runs_it_eagerly() -> None:
    # Graphs of one pool run one at a time: a replay of runner B inside a replay of runner A
    # (A's break calls B) could overwrite intermediates A's graph still reads on CUDA. The
    # re-entry guard was per runner, so B replayed; now B runs eagerly, a miss.
    inner = BreakableGraphRunner(lambda t: t * 3 + 1, device="cpu", warmup_iters=0)

    @eager_on_graph(name="rh4.calls_inner")
    def calls_inner(t: torch.Tensor) -> torch.Tensor:
        return inner(t) + 0

    outer = BreakableGraphRunner(
        lambda t: calls_inner(t * 2) - 1, device="cpu", warmup_iters=0, pool=inner.pool
    )
    x = torch.randn(5)
    inner.capture(x)
    outer.capture(x)
    before = inner.stats
    for _ in range(3):
        y = torch.randn(5)
        assert torch.equal(outer(y), (y * 2) * 3 + 1 - 1)
    after = inner.stats
    assert after.hits == before.hits and after.misses == before.misses + 3
    assert outer.stats.hits == 3
    assert torch.equal(inner(x), x * 3 + 1) and inner.stats.hits == before.hits + 1


def test_reset_from_a_break_of_the_runners_own_replay_is_refused() -> None:
    holder: list[BreakableGraphRunner] = []
    armed = [False]

    @eager_on_graph(name="rh4.resets")
    def resets(t: torch.Tensor) -> torch.Tensor:
        if armed[0]:
            holder[0].reset()
        return t + 1

    runner = BreakableGraphRunner(lambda t: resets(t * 2) * 3, device="cpu", warmup_iters=0)
    holder.append(runner)
    x = torch.randn(4)
    runner.capture(x)
    armed[0] = True
    with pytest.raises(RuntimeError, match="from a break of its own replay"):
        runner(x)
    armed[0] = False
    assert runner.stats.captures == 1  # nothing was reset
    y = torch.randn(4)
    assert torch.equal(runner(y), (y * 2 + 1) * 3)
    runner.reset()
    assert runner.stats.captures == 0
