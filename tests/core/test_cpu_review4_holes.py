"""Holes a review of the runner's serving-engine use found, on the CPU backend (2026-12-07):
``capture_many`` reports, counters that add up, and shared pools. Each was a silently wrong
result or report, or an unclear error, and is now right or a clear error."""

from __future__ import annotations

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
