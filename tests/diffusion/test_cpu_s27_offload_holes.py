"""Session 27: accelerate's CPU offload (a pipeline's enable_model_cpu_offload /
enable_sequential_cpu_offload) under DiTRunner: its hooks give the weights new storage between
pipeline calls, so graphs would read freed memory on CUDA; the runner refuses them as it
refuses diffusers' group offloading (CPU backend: accelerate's real hooks, CPU execution)."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
diffusers = pytest.importorskip("diffusers")

from test_cpu_review43_dit_holes import flux_in, tiny_flux  # noqa: E402

from bcg_core import is_breakable_capture_active  # noqa: E402
from bcg_diffusion import DiTRunner, make_attention_ops_breakable  # noqa: E402


@pytest.mark.parametrize("how", ["model", "sequential"])
def test_a_model_under_accelerate_cpu_offload_is_refused_with_what_to_do(how: str) -> None:
    model = tiny_flux(1)
    if how == "model":  # what enable_model_cpu_offload() installs
        accelerate.cpu_offload_with_hook(model, execution_device=torch.device("cpu"))
        hook = "CpuOffload"
    else:  # what enable_sequential_cpu_offload() installs
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        hook = "AlignDevicesHook"
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with pytest.raises(ValueError, match=f"accelerate {hook}.*enable_model_cpu_offload"):
            runner.capture(**flux_in(1))
        assert not is_breakable_capture_active()
        assert runner.stats.captures == 0
        out = runner(**flux_in(1)).sample  # an eager call still serves
        assert torch.equal(out, model(**flux_in(1)).sample)
    finally:
        runner.close()


def test_accelerate_hooks_that_only_move_inputs_still_capture() -> None:
    model = tiny_flux(1)
    accelerate.hooks.add_hook_to_module(
        model, accelerate.hooks.AlignDevicesHook(execution_device=torch.device("cpu"))
    )
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        expected = model(**flux_in(1)).sample
        runner.capture(**flux_in(1))
        assert runner.stats.captures == 1
        assert torch.equal(runner(**flux_in(1)).sample, expected)
        assert runner.stats.hits == 1
    finally:
        runner.close()
