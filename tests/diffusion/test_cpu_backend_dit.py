"""DiTRunner on the CPU graph backend: the toy DiT replays bit-identically to eager."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bcg_diffusion import DiTRunner, is_breakable_attention_installed, uninstall_breakable_attention
from bcg_diffusion._toy_dit import DiTConfig, DiTSelfAttention, ToyDiT  # noqa: PLC2701

CFG = DiTConfig(hidden=64, depth=2, heads=4, text_dim=32, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _unpatch() -> Iterator[None]:
    yield
    uninstall_breakable_attention(DiTSelfAttention)


def _inputs(gen: torch.Generator, res: int = 8, prompt: int = 6) -> tuple[torch.Tensor, ...]:
    latents = torch.randn(2, CFG.in_channels, res, res, generator=gen)
    t = torch.rand(2, generator=gen) * 1000
    text = torch.randn(2, prompt, CFG.text_dim, generator=gen)
    return latents, t, text


def test_dit_runner_on_cpu_equals_eager() -> None:
    model = ToyDiT(CFG, seed=0).eval()
    runner = DiTRunner(model, attention_classes=(DiTSelfAttention,), device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        first = _inputs(gen)
        torch.testing.assert_close(runner.capture(*first), model(*first), rtol=0, atol=0)
        (entry,) = runner.stats.entries
        assert entry.breaks == CFG.depth and entry.segments == CFG.depth + 1
        for step in range(4):
            args = _inputs(gen)
            got = runner(*args)
            torch.testing.assert_close(got, model(*args), rtol=0, atol=0, msg=f"call {step}")
    stats = runner.stats
    assert stats.captures == 1 and stats.hits == 4 and stats.misses == 0
    runner.close()
    assert not is_breakable_attention_installed(DiTSelfAttention)
