"""Unbounded growth in a long-running process: registries that grew with every new class,
failed signature or trace, driven many cycles on the CPU backend."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from bcg_core import BreakableGraphRunner, signature_of


def test_classes_made_in_a_loop_are_not_kept_alive_by_the_signature_walk() -> None:
    """A plain object of a class made per request (a local class, a dynamic config type) in a
    call's arguments: the walk's slot-name cache held every class, and so every class object
    (and what it references), forever."""
    refs = []
    for i in range(300):

        class Options:
            __slots__ = ("scale",)

            def __init__(self, scale: int) -> None:
                self.scale = scale

        signature_of((torch.ones(2), Options(i)), {})
        refs.append(weakref.ref(Options))
        del Options
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 256, alive


def test_a_runner_keeps_a_bounded_number_of_blocked_signatures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A serving loop whose captures fail for each new shape (capture() called per new shape,
    or a warm-up window left open): every failed signature stayed blocked, with its reason,
    until reset(), so the runner's memory grew with each new shape. Output unchanged: a
    forgotten signature is captured again at its next capture call and blocked again."""

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return inp * inp.max().item()  # syncs: its capture fails on every backend

    runner = BreakableGraphRunner(forward, device="cpu")
    with caplog.at_level(logging.CRITICAL, logger="bcg_core"):
        for n in range(1, 400):
            inp = torch.randn(n)
            assert torch.equal(runner.capture(inp), forward(inp))
    assert runner.stats.failed_captures == 399
    assert 1 <= len(runner.blocked_signatures) <= 256
    # The latest failures are the ones kept: the newest signature still runs eagerly, untried.
    inp = torch.randn(399)
    assert torch.equal(runner(inp), forward(inp))
    assert runner.stats.failed_captures == 399
