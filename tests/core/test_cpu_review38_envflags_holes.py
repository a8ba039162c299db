"""Holes in bcg's environment flags, debug mode and logging, found on the CPU graph backend
(review 38): BCG_DEBUG must not change any result, flags are read when documented, and the
``bcg_core`` logger stays unconfigured and cheap when its level is off."""

from __future__ import annotations

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph


@eager_on_graph
def _write_through_reshape(x: torch.Tensor, v: torch.Tensor) -> None:
    x.reshape(-1)[:1] = v


def _step_writing_argument(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x * 2
    _write_through_reshape(x, v)
    return x + y


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("inference_tensor", [False, True])
def test_bcg_debug_keeps_a_break_write_through_a_reshape_in_inference_mode(
    monkeypatch: pytest.MonkeyPatch, debug: str, inference_tensor: bool
) -> None:
    # The debug check runs each break under a dispatch mode; in inference mode the reshape
    # reached it whole and its view shared no version counter with x, so under BCG_DEBUG=1
    # the runner's capture() never copied the break's write back into the caller's x.
    monkeypatch.setenv("BCG_DEBUG", debug)
    with torch.inference_mode(inference_tensor):
        x = torch.zeros(4)
    with torch.inference_mode():
        runner = BreakableGraphRunner(_step_writing_argument, device="cpu")
        runner.capture(x, torch.full((1,), 9.0))
        assert x.tolist() == [9.0, 0.0, 0.0, 0.0]
        for i in range(2):
            with torch.inference_mode(inference_tensor):
                x = torch.zeros(4)
            out = runner(x, torch.full((1,), float(i + 5)))
            assert x.tolist() == [i + 5.0, 0.0, 0.0, 0.0]
            assert out.tolist() == [i + 5.0, 0.0, 0.0, 0.0]
    assert runner.stats.hits == 2
