"""Holes found reviewing the changes merged on review 41's afternoon (the inference-mode view
note shared by the CPU recorder and the debug tracker, hook_attribute's heal, typing), on the
CPU graph backend."""

from __future__ import annotations

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph


def _foreach_write(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    torch._foreach_add_([x.reshape(-1)], [v])
    return x * 2


@pytest.mark.parametrize("inference", [False, True])
def test_a_segment_writing_its_argument_with_a_foreach_op_is_copied_back(inference: bool) -> None:
    # Under a dispatch mode (the CPU recorder) a _foreach_*_ op bumps no version of the tensors
    # of its written list, so the runner, which finds the arguments a step writes by their
    # versions, never copied the write back to the caller's x (at capture or at replay).
    x = torch.zeros(2, 2)
    with torch.inference_mode(inference):
        runner = BreakableGraphRunner(_foreach_write, device="cpu", warmup_iters=0)
        runner.capture(x, torch.full((4,), 3.0))
        assert x.flatten().tolist() == [3.0] * 4
        x = torch.zeros(2, 2)
        out = runner(x, torch.full((4,), 5.0))
    assert runner.stats.hits == 1
    assert x.flatten().tolist() == [5.0] * 4 and out.flatten().tolist() == [10.0] * 4


@eager_on_graph
def _foreach_copy(x: torch.Tensor, v: torch.Tensor) -> None:
    torch._foreach_copy_([x.reshape(-1)], [v])


def _step_with_foreach_break(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x * 2
    _foreach_copy(x, v)
    return x + y


@pytest.mark.parametrize("inference", [False, True])
def test_bcg_debug_keeps_a_break_s_foreach_write_to_its_argument(
    monkeypatch: pytest.MonkeyPatch, inference: bool
) -> None:
    # The debug check runs each break under its tracker, a dispatch mode: the foreach write
    # bumped no version, so capture() never copied it back into the caller's x.
    monkeypatch.setenv("BCG_DEBUG", "1")
    x = torch.zeros(4)
    with torch.inference_mode(inference):
        runner = BreakableGraphRunner(_step_with_foreach_break, device="cpu")
        runner.capture(x, torch.full((4,), 9.0))
        assert x.tolist() == [9.0] * 4
        x = torch.zeros(4)
        out = runner(x, torch.full((4,), 5.0))
    assert x.tolist() == [5.0] * 4 and out.tolist() == [5.0] * 4
    assert runner.stats.hits == 1
