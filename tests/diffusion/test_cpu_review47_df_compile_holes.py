"""torch.compile + bcg over diffusers families, found by review 47 (CPU graph backend,
``aot_eager``: captures there run the compiled frame uncompiled, so compile structure is
checked by dynamo's counters and replays against the compiled call)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from bcg_diffusion import DiTRunner, make_attention_ops_breakable

pytest.importorskip("diffusers")

from test_cpu_diffusers import flux_model, sd3_model

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@pytest.mark.parametrize("build", [flux_model, sd3_model], ids=["dispatch", "functional"])
def test_a_compiled_step_keeps_one_dynamo_graph_across_runners_and_their_handles(
    build: Callable[[], tuple[nn.Module, Step, torch.Tensor]],
) -> None:
    """A runner per generation, each with its own make_attention_ops_breakable handle, over one
    compiled step: one dynamo graph for all of them (was: every handle made new breaks, whose
    ids dynamo guards on, so each runner recompiled the step, and the 9th hit
    recompile_limit: FailOnRecompileLimitHit under fullgraph=True, eager kernels without)."""
    from torch._dynamo.utils import counters  # noqa: PLC2701

    torch._dynamo.reset()
    counters.clear()
    model, step, latents = build()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    t = torch.tensor([0.5])
    with torch.no_grad():
        expected = step(latents, t)
        for _ in range(torch._dynamo.config.recompile_limit + 1):
            runner = DiTRunner(
                compiled, breakable_attention=make_attention_ops_breakable(model), device="cpu"
            )
            try:
                runner.capture(latents, t)
                got = runner(latents, t)
                assert runner.stats.hits == 1
            finally:
                runner.close()
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            torch.testing.assert_close(compiled(latents, t), expected, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 2  # the patched step and the plain one
