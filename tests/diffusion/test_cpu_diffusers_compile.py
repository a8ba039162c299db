"""A diffusers Flux whose attention ops are breaks, under torch.compile: one dynamo graph (no
graph break: each attention op is one opaque op), and a DiTRunner over the compiled step
records the breaks and replays equal to eager (CPU graph backend; see
tests/core/test_cpu_compile.py for why captures there run the frame uncompiled)."""

from __future__ import annotations

import pytest
import torch

from bcg_core import enable_breakable_cuda_graph
from bcg_diffusion import DiTRunner, make_attention_ops_breakable

pytest.importorskip("diffusers")

from test_cpu_diffusers import flux_model


def test_flux_with_breakable_attention_ops_is_one_dynamo_graph() -> None:
    torch._dynamo.reset()
    model, step, latents = flux_model()
    with make_attention_ops_breakable(model), torch.no_grad():
        explained = torch._dynamo.explain(step)(latents, torch.tensor([0.5]))
        with enable_breakable_cuda_graph():
            flagged = torch._dynamo.explain(step)(latents, torch.tensor([0.5]))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert flagged.graph_break_count == 0 and flagged.graph_count == 1


def test_dit_runner_over_compiled_flux_records_every_attention_op() -> None:
    torch._dynamo.reset()
    model, step, latents = flux_model()
    t = torch.tensor([0.5])
    compiled = torch.compile(step, backend="aot_eager")
    runner = DiTRunner(
        compiled, breakable_attention=make_attention_ops_breakable(model), device="cpu"
    )
    try:
        with torch.no_grad():
            runner.capture(latents, t)
            (entry,) = runner.stats.entries
            assert entry.breaks == 4  # 2 dual + 2 single blocks, one attention op each
            fresh = torch.randn_like(latents)
            torch.testing.assert_close(runner(fresh, t), step(fresh, t), rtol=0, atol=0)
            assert runner.stats.hits == 1
    finally:
        runner.close()
