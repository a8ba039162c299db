"""A diffusers Flux compiled by inductor, its attention ops breaks, captured by a DiTRunner on a
real GPU: replays equal the compiled step run without a graph, bit for bit."""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion import DiTRunner, make_attention_ops_breakable

pytest.importorskip("diffusers")

from test_cpu_diffusers import flux_model

pytestmark = pytest.mark.cuda


def test_compiled_flux_through_the_dit_runner_equals_the_compiled_step() -> None:
    torch._dynamo.reset()
    model, step, latents = flux_model("cuda", torch.bfloat16)
    handle = make_attention_ops_breakable(model)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    runner = DiTRunner(compiled, breakable_attention=handle)
    t = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            runner.capture(latents, t)
            (entry,) = runner.stats.entries
            assert entry.breaks == 4 and runner.stats.failed_captures == 0
            for seed in range(3):
                fresh = torch.randn(
                    latents.shape, generator=torch.Generator().manual_seed(seed)
                ).to("cuda", latents.dtype)
                assert torch.equal(runner(fresh, t), compiled(fresh, t))
        assert runner.stats.hits == 3
    finally:
        runner.close()
