"""The ``flux`` workload of ``bcg bench``: diffusers' FluxTransformer2DModel, attention ops as
the breaks (:func:`make_attention_ops_breakable`), projections captured.

Model (random weights from a config, nothing downloaded; bf16 on CUDA): 4 dual + 8 single
blocks, 4 heads x 128 = dim 512, RoPE axes (16, 56, 56), patch 1, 64 input channels (a 32x32
latent grid of 64-channel packed latents, i.e. 1024 image tokens), 64 text tokens of width 4096
(T5's), pooled text 768 (CLIP's), no guidance embedding. One timed step is one Euler step of a
flow-matching loop (transformer call plus the update) on fixed latents, so ``--steps`` timed
steps (20 by default) are one 20-step denoising loop's worth.

Contenders: eager, one full CUDA graph (flag off, attention captured), bcg through
:class:`DiTRunner` (``return_views=True``, as a graph replay returns nothing either) and
torch.compile of the same step, then the compiled kernels: ``compiled_graph`` (the step compiled
in the default mode, one plain CUDA graph) and ``bcg+compile`` (a runner over the compiled step,
attention ops still the breaks), both checked against the compiled step (bitwise where it
reproduces itself; see ``bcg_core.bench.compiled_graph_contender``). The torch.compile contender
is fair: it compiles the same model built from a second import of its diffusers module, which
bcg's patch (module globals) does not reach, so no bcg op is in its graph; its one-graph check
holds. Skipped with the reason when diffusers is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from typing import Any

import torch

from bcg_core.bench import (
    BenchContext,
    Contender,
    Measurement,
    bcg_compile_contender,
    compile_contender,
    compiled_graph_contender,
    full_graph_contender,
    runner_contender,
)
from bcg_diffusion._diffusers import make_attention_ops_breakable
from bcg_diffusion._runner import DiTRunner
from bcg_diffusion._tokens import replay_token_scope

WORKLOAD = "flux"
CONTENDERS = ("eager", "full_graph", "bcg", "torch.compile", "compiled_graph", "bcg+compile")


def flux_workload(ctx: BenchContext) -> list[Measurement]:
    try:
        import diffusers
    except ImportError:
        why = 'diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
        return [Measurement(WORKLOAD, "-", c, None, skipped=why) for c in CONTENDERS]
    cuda = ctx.device.type == "cuda"
    if ctx.smoke:
        heads, head_dim, rope, layers, single = 2, 16, (4, 6, 6), 1, 1
        channels, joint, pooled_dim, grid, text_len = 4, 32, 32, 4, 8
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        heads, head_dim, rope, layers, single = 4, 128, (16, 56, 56), 4, 8
        channels, joint, pooled_dim, grid, text_len = 64, 4096, 768, 32, 64
        dtype = torch.bfloat16
    torch.manual_seed(0)
    flux: Any = diffusers.FluxTransformer2DModel  # untyped library
    model = flux(
        patch_size=1, in_channels=channels, num_layers=layers, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=joint,
        pooled_projection_dim=pooled_dim, axes_dims_rope=rope, guidance_embeds=False,
    ).to(ctx.device, dtype).eval()  # fmt: skip
    device = ctx.device
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, grid * grid, channels, generator=gen).to(device, dtype)
    text = torch.randn(1, text_len, joint, generator=gen)
    pooled = torch.randn(1, pooled_dim, generator=gen)
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    inputs = {
        "encoder_hidden_states": text.to(device, dtype),
        "pooled_projections": pooled.to(device, dtype),
        "img_ids": img_ids.to(device),
        "txt_ids": torch.zeros(text_len, 3, device=device),
    }
    t = torch.full((1,), 0.5, device=device)
    dt = 1.0 / 20

    def euler_step(
        net: torch.nn.Module, x: torch.Tensor, kw: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        v: torch.Tensor = net(hidden_states=x, timestep=t, return_dict=False, **kw)[0]
        return x - dt * v

    def step() -> torch.Tensor:
        return euler_step(model, latents, inputs)

    def exact_output() -> torch.Tensor:
        """The same weights and inputs in float32: what torch.compile is checked against."""
        exact = copy.deepcopy(model).float()
        kw = {k: v.float() for k, v in inputs.items()}
        return euler_step(exact, latents.float(), kw)

    plain = _unpatched_copy(model)  # its own module: bcg's patch below does not reach it

    def plain_step() -> torch.Tensor:
        return euler_step(plain, latents, inputs)

    runner = DiTRunner(
        step,
        breakable_attention=make_attention_ops_breakable(model),
        device=ctx.device,
        return_views=True,
    )

    try:
        with torch.no_grad():
            contenders = [
                Contender("eager", step),
                ctx.build("full_graph", lambda: full_graph_contender(ctx, step, step)),
                ctx.build("bcg", lambda: runner_contender(ctx, runner, step)),
                ctx.build(
                    "torch.compile",
                    lambda: compile_contender(ctx, plain_step, step, exact_output),
                ),
                ctx.build(
                    "compiled_graph",
                    lambda: compiled_graph_contender(ctx, step, (step, exact_output)),
                ),
                ctx.build(
                    "bcg+compile",
                    lambda: bcg_compile_contender(
                        ctx, step, (step, exact_output), replay_context=replay_token_scope
                    ),
                ),
            ]
            case = f"{grid}x{grid} latents, {text_len} text tokens"
            return ctx.compare(WORKLOAD, case, contenders)
    finally:
        runner.close()


def _unpatched_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same model (config, weights, dtype, device) built from a second import of its
    diffusers module, under another name in the same package, which no bcg patch reaches: bcg
    patches the names the model's own modules hold (``dispatch_attention_fn``), and dynamo
    guards on those module globals by module name, so a copy of the model itself (or of its
    processors' code) would see the patch."""
    source = sys.modules[type(model).__module__]
    package, _, leaf = source.__name__.rpartition(".")
    name = f"{package}._bcg_unpatched_{leaf}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, source.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dynamo finds globals through sys.modules
        spec.loader.exec_module(module)
    cls = getattr(module, type(model).__name__)
    plain: torch.nn.Module = cls.from_config(model.config)
    plain.load_state_dict(model.state_dict())
    parameter = next(model.parameters())
    return plain.to(parameter.device, parameter.dtype).eval()
