"""Holes found by the memory review (session 28), on the CPU graph backend: the memory figures
an engine sizes its KV cache from (:meth:`BreakableGraphRunner.graph_memory`), and what the
graphs keep alive."""

from __future__ import annotations

import logging

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph


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
