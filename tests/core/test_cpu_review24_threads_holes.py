"""A serving engine's threads on the CPU graph backend: one runner called from several threads,
captures while others replay, resets racing replays, flag blocks in several threads. Every
output is compared bitwise with eager; threads are ordered by barriers and events (never by
sleeps) and joined with a timeout, so a hang fails the test instead of the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import eager_on_graph

_TIMEOUT = 20.0


def _run_threads(targets: list[Callable[[], None]]) -> None:
    """Run each target in a thread of its own; re-raise the first error, fail on a hang."""
    errors: list[BaseException] = []

    def wrap(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # reported in the main thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock)"
    if errors:
        raise errors[0]


@eager_on_graph
def _shift(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _step(x: torch.Tensor) -> torch.Tensor:
    return _shift(x * 2) * 3


def _clean() -> None:
    assert not bcg_core.is_breakable_capture_active()
    assert not bcg_core.is_in_breakable_cuda_graph()
    assert not bcg_core.breakable_graphs_disabled()


@pytest.mark.parametrize(
    ("make", "read"),
    [
        (bcg_core.disable_breakable_graphs, bcg_core.breakable_graphs_disabled),
        (bcg_core.enable_breakable_cuda_graph, bcg_core.is_in_breakable_cuda_graph),
    ],
)
def test_one_flag_block_object_entered_in_two_threads_restores_each_thread(
    make: Callable[[], Any], read: Callable[[], bool]
) -> None:
    """A block made once (``NO_BCG = disable_breakable_graphs()``) and entered by two request
    threads whose blocks interleave: each thread's exit must restore its own flag (the second
    thread's exit left the first thread's block: both kept the flag set)."""
    block = make()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with block:
            a_in.set()
            assert b_in.wait(_TIMEOUT)
            seen["a inside"] = read()
        seen["a after"] = read()
        a_out.set()

    def second() -> None:
        assert a_in.wait(_TIMEOUT)
        with block:
            b_in.set()
            assert a_out.wait(_TIMEOUT)
            seen["b inside"] = read()
        seen["b after"] = read()

    _run_threads([first, second])
    assert seen == {"a inside": True, "a after": False, "b inside": True, "b after": False}
    _clean()
