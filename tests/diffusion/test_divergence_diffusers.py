"""The README's diffusers recipe: the divergence check says ok for Flux, SD3 and Wan (every
attention op a break), and ``DiTRunner`` replays a capture that differs from the calls only in
``return_dict``. On the CPU graph backend, and on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import check_divergence
from bcg_diffusion import DiTRunner, make_attention_ops_breakable

diffusers = pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)

from test_cpu_diffusers import MODELS, Step, wan_model  # noqa: E402

FAMILIES: dict[str, Callable[..., tuple[Any, Step, Any]]] = {**MODELS, "wan": wan_model}


def check_recipe(family: str, device: str, dtype: torch.dtype) -> None:
    model, step, latents = FAMILIES[family](device, dtype)
    gen = torch.Generator().manual_seed(5)
    sets = [
        (torch.randn(latents.shape, generator=gen).to(device, dtype), torch.full((1,), t))
        for t in (1.0, 0.75, 0.5)
    ]
    sets = [(x, t.to(device)) for x, t in sets]
    with torch.no_grad(), make_attention_ops_breakable(model):
        report = check_divergence(step, sets)
        assert report.ok, str(report)
        assert report.breaks > 0 and report.segments == report.breaks + 1
    with torch.no_grad():
        handle = make_attention_ops_breakable(model)
        runner = DiTRunner(step, breakable_attention=handle, device=device)
        try:
            runner.capture(*sets[0])
            report = runner.check_divergence(*sets[1])
            assert report.ok, str(report)
        finally:
            runner.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_diffusers_recipe_checks_ok_on_cpu(family: str) -> None:
    check_recipe(family, "cpu", torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_diffusers_recipe_checks_ok_on_cuda(family: str) -> None:
    check_recipe(family, "cuda", torch.bfloat16)


def test_return_dict_differing_between_capture_and_call_still_replays() -> None:
    model, _, latents = MODELS["flux"]()
    gen = torch.Generator().manual_seed(1)
    cond = {
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
    }
    t = torch.ones(1)
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            captured = runner.capture(hidden_states=latents, timestep=t, **cond)
            as_tuple = runner(hidden_states=latents, timestep=t, **cond, return_dict=False)
            as_dict = runner(hidden_states=latents, timestep=t, **cond, return_dict=True)
            eager = model(hidden_states=latents, timestep=t, **cond, return_dict=False)
        assert isinstance(captured, diffusers.models.modeling_outputs.Transformer2DModelOutput)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], eager[0])
        assert torch.equal(as_dict.sample, eager[0])
        stats = runner.stats
        assert (stats.hits, stats.misses, stats.captures) == (2, 0, 1)
    finally:
        runner.close()
