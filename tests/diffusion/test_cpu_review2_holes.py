"""Holes found in a second review of bcg-diffusion's runner and adapters, on the CPU graph
backend (tiny models, random weights, float32):

- a closed ``DiTRunner`` (its attention patches released) still captured: the new graph held
  the attention it was made to break, so state that attention reads (a processor's scale, a
  class attribute) replayed stale, silently; a closed runner now serves every call eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from bcg_diffusion import DiTRunner, is_breakable_attention_installed


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


class _ScaledAttention(nn.Module):
    """Attention reading host state at every call (as an IP-Adapter processor reads its
    ``scale``): captured into the graph, a later scale would replay stale."""

    scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1) * type(self).scale


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.attn = _ScaledAttention()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.attn(self.inp(x)))
        return out


def test_a_closed_runner_serves_eagerly_instead_of_capturing_without_its_breaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _Model().eval()
    x = torch.randn(2, 4)
    runner = DiTRunner(model, attention_classes=(_ScaledAttention,), device="cpu")
    with torch.no_grad():
        runner.capture(x)
        assert runner.stats.entries[0].breaks == 1
        runner.close()
        assert not is_breakable_attention_installed(_ScaledAttention)
        runner.capture(x)  # was: a graph with the attention captured, no break
        report = runner.capture_many([((x,), {})])
        assert runner.stats.captures == 0 and runner.stats.entries == ()
        assert len(report.failed) == 1 and "closed" in report.failed[0][1]
        runner.reset()  # still closed: reset does not bring the released breaks back
        runner.capture(x)
        assert runner.stats.captures == 0
        monkeypatch.setattr(_ScaledAttention, "scale", 2.0)
        assert torch.equal(runner(x), model(x))  # was: the scale-1 graph replayed
    assert runner.serves_eagerly and "closed" in (runner.disabled_reason or "")
