"""The ``dit`` workload of ``bcg bench``: one toy-DiT denoising step per timed step.

Registered under the ``bcg.workloads`` entry-point group (see pyproject.toml), so bcg-core's
CLI finds it without importing bcg-diffusion. Contenders: eager, one full CUDA graph (attention
captured too), the DiTRunner (attention as the break), and torch.compile with the attention as
a graph break.
"""

from __future__ import annotations

import dataclasses

import torch

from bcg_core.bench import (
    BenchContext,
    Contender,
    Measurement,
    compile_contender,
    full_graph_contender,
    runner_contender,
)
from bcg_diffusion._runner import DiTRunner
from bcg_diffusion._toy_dit import DiTConfig, DiTSelfAttention, ToyDiT


def dit_workload(ctx: BenchContext) -> list[Measurement]:
    cuda = ctx.device.type == "cuda"
    if ctx.smoke:
        dtype = torch.bfloat16 if cuda else torch.float32
        cfg = DiTConfig(hidden=64, depth=2, heads=4, text_dim=32, dtype=dtype)
        res, text_len = 8, 8
    else:
        cfg = DiTConfig(hidden=384, depth=12, heads=6, text_dim=256)
        res, text_len = 32, 16
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, cfg.in_channels, res, res, generator=gen).to(ctx.device, cfg.dtype)
    t = torch.full((1,), 500.0, device=ctx.device)
    text = torch.randn(1, text_len, cfg.text_dim, generator=gen).to(ctx.device, cfg.dtype)
    model = ToyDiT(cfg).to(ctx.device).eval()
    compiled_model = ToyDiT(cfg).to(ctx.device).eval()
    for block in compiled_model.blocks:  # attention as a graph break, as in the bcg runner
        block.attn.forward = torch.compiler.disable(block.attn.forward)  # type: ignore[no-untyped-call,union-attr]

    def step() -> torch.Tensor:
        out: torch.Tensor = model(latents, t, text)
        return out

    def compiled_step() -> torch.Tensor:
        out: torch.Tensor = compiled_model(latents, t, text)
        return out

    def exact_output() -> torch.Tensor:
        """The same weights and inputs in float32: what torch.compile is checked against."""
        exact_model = ToyDiT(dataclasses.replace(cfg, dtype=torch.float32)).to(ctx.device).eval()
        out: torch.Tensor = exact_model(latents.float(), t, text.float())
        return out

    runner = DiTRunner(model, attention_classes=(DiTSelfAttention,), device=ctx.device)
    try:
        with torch.no_grad():
            contenders = [
                Contender("eager", step),
                ctx.build("full_graph", lambda: full_graph_contender(ctx, step, step)),
                ctx.build("bcg", lambda: runner_contender(ctx, runner, step, latents, t, text)),
                ctx.build(
                    "torch.compile",
                    lambda: compile_contender(ctx, compiled_step, step, exact_output),
                ),
            ]
            return ctx.compare("dit", f"{res}x{res} latents, {text_len} text tokens", contenders)
    finally:
        runner.close()
