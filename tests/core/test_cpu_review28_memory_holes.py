"""Holes found by the memory review (session 28), on the CPU graph backend: the memory figures
an engine sizes its KV cache from (:meth:`BreakableGraphRunner.graph_memory`), and what the
graphs keep alive."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from graph_helpers import capture

from bcg_core import BreakableCUDAGraph, BreakableGraphRunner, ReplayError, eager_on_graph


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


@eager_on_graph(name="review28_double")
def _double_in_place(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2)  # returns its argument: the static buffer, bridged as it is


def test_a_break_returning_its_static_argument_is_counted_once() -> None:
    # The bridge held the static input buffer itself; graph_memory() counted its storage as a
    # static buffer and again as a bridge (128 + 128 bytes for one 128-byte buffer), where
    # DESIGN.md promises "storages counted once".
    runner = BreakableGraphRunner(lambda x: _double_in_place(x).sin(), device="cpu")
    with runner.warmup():
        runner(torch.randn(4, 8))
    memory = runner.graph_memory()
    assert memory.static_bytes == 4 * 8 * 4
    assert memory.bridge_bytes == 0
    x = torch.randn(4, 8)
    assert torch.equal(runner(x.clone()), (x * 2).sin())


def test_a_shared_pool_forgets_the_memory_of_a_reset_graph() -> None:
    # The CPU pool kept the address of every storage its captures ever wrote (a set that grew
    # with each capture into a shared pool). A 0-dim tensor from outside the graph that the
    # allocator later placed at such an address was taken for graph memory: its change since
    # capture replayed silently, where a fresh pool raises ReplayError (DESIGN.md, "0-dim
    # operands from outside the graph").
    first = BreakableCUDAGraph(backend="cpu")
    x = torch.randn(64, 4)
    _, sums = capture(lambda: [x[i].sum() for i in range(64)], first)
    written = {t.untyped_storage().data_ptr() for t in sums}
    del sums
    first.reset()
    gc.collect()
    held: list[torch.Tensor] = []  # the misses stay alive, so each try gets a new address
    sigma = None
    for _ in range(2000):
        t = torch.tensor(0.5)
        if t.untyped_storage().data_ptr() in written:
            sigma = t
            break
        held.append(t)
    if sigma is None:
        pytest.skip("the allocator reused none of the reset graph's addresses")
    second = BreakableCUDAGraph(pool=first.pool(), backend="cpu")
    y = torch.ones(3)
    capture(lambda: y * sigma, second)
    sigma.fill_(0.7)
    with pytest.raises(ReplayError, match="0-dim tensor from outside the graph"):
        second.replay()
