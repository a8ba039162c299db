"""Regressions found by a second review of one day's merged changes (session 29), on the CPU
graph backend: each test compares with eager or with what held before those changes."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo

from bcg_core import eager_on_graph


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


class _Opaque:
    """An argument dynamo cannot hand an opaque op: the break is a dynamo graph break."""


@eager_on_graph
def _untraceable_break(x: torch.Tensor, o: _Opaque) -> torch.Tensor:
    return x * 2


def test_a_fullgraph_error_at_a_break_names_the_break_s_function() -> None:
    # The dynamo-disabled form of a break wrapped an inner function without the break's name
    # (a0b833d), so torch.compile(fullgraph=True) refused it naming
    # `eager_on_graph.<locals>.decorate.<locals>.run` where it named the user's function.
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: _untraceable_break(x + 1, _Opaque()) + 1, backend="eager", fullgraph=True
    )
    with pytest.raises(Exception, match="_untraceable_break") as info:
        compiled(torch.ones(2))
    assert "<locals>.run" not in str(info.value)
