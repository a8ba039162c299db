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


def test_the_flux_bench_compiles_a_fair_model_no_bcg_patch_reaches() -> None:
    """The flux workload's torch.compile contender: the same model built from a second import
    of diffusers' Flux module, which bcg's patch (module globals, which dynamo guards on by
    module name) does not reach: one dynamo graph without any bcg op, same outputs."""
    from bcg_diffusion._flux_workload import _unpatched_copy  # noqa: PLC2701

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    def bcg_ops(gm: torch.fx.GraphModule) -> list[str]:
        return [str(n.target) for n in gm.graph.nodes if "nonstrict" in str(n.target)]

    torch._dynamo.reset()
    model, step, latents = flux_model()
    plain = _unpatched_copy(model)
    t = torch.tensor([0.5])
    with make_attention_ops_breakable(model), torch.no_grad():
        expected = step(latents, t)
        torch.compile(step, backend=keep, fullgraph=True)(latents, t)
        model_forward = model.forward
        model.forward = plain.forward  # type: ignore[method-assign]  # same step, plain model
        try:
            got = torch.compile(step, backend=keep, fullgraph=True)(latents, t)
        finally:
            model.forward = model_forward  # type: ignore[method-assign]
    patched, fair = graphs
    assert len(bcg_ops(patched)) == 4 and bcg_ops(fair) == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
