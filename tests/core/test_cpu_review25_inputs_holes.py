"""Holes found by the input-zoo review (session 25), on the CPU graph backend: unusual but
legal inputs and outputs, every replay compared with eager."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from bcg_core import BreakableGraphRunner


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


def _concat_kwargs(x: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, *kw.values()])


def test_a_capture_passes_the_step_s_kwargs_in_the_call_s_order() -> None:
    # The static call was built with the keywords sorted by name (the signature's walk order),
    # so a capture of f(x, b=b, a=a) ran the step with **kwargs in a, b order: the capture and
    # every replay returned [x, a, b] where eager returns [x, b, a].
    runner = BreakableGraphRunner(_concat_kwargs, device="cpu")
    x, b, a = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert torch.equal(runner.capture(x, b=b, a=a), _concat_kwargs(x, b=b, a=a))
    for i in range(3):
        x, b, a = torch.randn(1), torch.randn(1), torch.randn(1)
        kw: dict[str, Any] = {"b": b, "a": a}
        assert torch.equal(runner(x, **kw), _concat_kwargs(x, **kw)), i
    assert runner.stats.hits == 3
