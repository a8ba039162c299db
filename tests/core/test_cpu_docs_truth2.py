"""Second pass over what the docs promise (README, DESIGN.md, public docstrings, the CLI's own
help), on the CPU backend: each test is a documented behaviour, run."""

from __future__ import annotations

import warnings

import pytest
import torch

from bcg_core import (
    BreakableGraphRunner,
    check_capture,
    eager_on_graph,
)


@eager_on_graph
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _step(x: torch.Tensor) -> torch.Tensor:
    return _plus_one(x * 2) * 3


def test_an_unknown_bcg_debug_word_counts_as_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # _env.py: "another value counts as off, with a warning once per value", as BCG_DISABLE and
    # BCG_PROFILE do. BCG_DEBUG=verbose raised ValueError in every capture's constructor: a
    # runner blocked every signature (served eagerly), check_capture raised.
    monkeypatch.setenv("BCG_DEBUG", "verbose-typo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = BreakableGraphRunner(_step, device="cpu")
        out = runner.capture(torch.ones(2))
        check = check_capture(_step, torch.ones(2))
    assert torch.equal(out, torch.full((2,), 9.0))
    assert runner.stats.captures == 1 and runner.blocked_signatures == {}
    assert torch.equal(runner(torch.zeros(2)), torch.full((2,), 3.0))
    assert runner.stats.hits == 1
    assert check.ok, check
    said = [w for w in caught if "BCG_DEBUG='verbose-typo'" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "strict" in str(said[0].message)


def test_the_debug_argument_still_refuses_another_word() -> None:
    from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture

    with pytest.raises(ValueError, match="debug must be"):
        BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu"), debug="verbose")
