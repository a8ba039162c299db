"""Tiny diffusers Flux (bf16) through DiTRunner on a real GPU, attention ops as breaks: every
replay of a denoising loop equals eager bit for bit."""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion import DiTRunner, make_attention_ops_breakable

pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)

from test_cpu_diffusers import MODELS, attention_ops, euler

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", sorted(MODELS))
def test_attention_ops_as_breaks_replay_equal_eager(family: str) -> None:
    torch.manual_seed(0)
    model, step, latents = MODELS[family]("cuda", torch.bfloat16)
    ops = attention_ops(step, latents)
    runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model))
    try:
        with torch.no_grad():
            runner.capture(latents, torch.ones(1, device="cuda"))
            (entry,) = runner.stats.entries
            assert entry.breaks == ops
            expected = euler(step, latents, 4)
            got = euler(runner, latents, 4)
        assert runner.stats.hits == 4
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)
    finally:
        runner.close()
