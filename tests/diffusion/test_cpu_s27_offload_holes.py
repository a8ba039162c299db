"""Session 27: accelerate's CPU offload (a pipeline's enable_model_cpu_offload /
enable_sequential_cpu_offload) under DiTRunner: its hooks give the weights new storage between
pipeline calls, so graphs would read freed memory on CUDA; the runner refuses them as it
refuses diffusers' group offloading (CPU backend: accelerate's real hooks, CPU execution)."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
diffusers = pytest.importorskip("diffusers")

from bcg_core import is_breakable_capture_active  # noqa: E402
from bcg_diffusion import DiTRunner, make_attention_ops_breakable  # noqa: E402


def _flux() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    ).eval()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 3, 8, generator=g),
        "pooled_projections": torch.randn(1, 8, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(4, 3),
        "txt_ids": torch.zeros(3, 3),
    }


@pytest.mark.parametrize("how", ["model", "sequential"])
def test_a_model_under_accelerate_cpu_offload_is_refused_with_what_to_do(how: str) -> None:
    model = _flux()
    if how == "model":  # what enable_model_cpu_offload() installs
        accelerate.cpu_offload_with_hook(model, execution_device=torch.device("cpu"))
        hook = "CpuOffload"
    else:  # what enable_sequential_cpu_offload() installs
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        hook = "AlignDevicesHook"
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with pytest.raises(ValueError, match=f"accelerate {hook}.*enable_model_cpu_offload"):
            runner.capture(**_inputs())
        assert not is_breakable_capture_active()
        assert runner.stats.captures == 0
        out = runner(**_inputs()).sample  # an eager call still serves
        assert torch.equal(out, model(**_inputs()).sample)
    finally:
        runner.close()


def test_accelerate_hooks_that_only_move_inputs_still_capture() -> None:
    model = _flux()
    accelerate.hooks.add_hook_to_module(
        model, accelerate.hooks.AlignDevicesHook(execution_device=torch.device("cpu"))
    )
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        expected = model(**_inputs()).sample
        runner.capture(**_inputs())
        assert runner.stats.captures == 1
        assert torch.equal(runner(**_inputs()).sample, expected)
        assert runner.stats.hits == 1
    finally:
        runner.close()
