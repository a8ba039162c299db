"""A diffusion runtime driving DiTRunner on the CPU graph backend (review 43): guiders,
hooks, schedulers and runner reuse, each replay compared with eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bcg_diffusion import DiTRunner, make_attention_ops_breakable

diffusers = pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)


def tiny_flux(num_layers: int = 2) -> torch.nn.Module:
    """A tiny Flux (random weights) in eval mode; shared by the DiT hole tests."""
    torch.manual_seed(0)
    model: torch.nn.Module = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=num_layers, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip
    return model


def flux_in(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "timestep": torch.rand(1, generator=gen),
        "img_ids": torch.randn(16, 3, generator=gen),
        "txt_ids": torch.zeros(8, 3),
    }


def _skip_on(model: torch.nn.Module) -> None:
    """What a skip-layer guider does before its perturbed call."""
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    apply_layer_skip(model, LayerSkipConfig(indices=[0], fqn="transformer_blocks"))


def _skip_off(model: torch.nn.Module) -> None:
    """What the guider does after it (apply_layer_skip's hooks are named layer_skip_hook)."""
    from diffusers.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(model).remove_hook("layer_skip_hook", recurse=True)


def test_layer_skip_hooks_of_a_guider_are_not_replayed_as_the_plain_graph() -> None:
    """diffusers' guiders (skip-layer, perturbed-attention, auto guidance) add layer-skip hooks
    around the perturbed call and remove them after it, with the same inputs: the runner
    replayed the plain call's graph for it (silently not eager's skip output), and a graph
    captured while the hooks were on was replayed for the plain calls. Calls made under other
    diffusers hooks than the graphs' capture now run eagerly."""
    model = tiny_flux()
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0))
            for step in range(1, 4):  # one guided step: plain call, skip call, plain call
                plain = runner(**flux_in(step)).sample
                assert torch.equal(plain, model(**flux_in(step)).sample)
                _skip_on(model)
                try:
                    skipped = runner(**flux_in(step)).sample
                    expected = model(**flux_in(step)).sample
                finally:
                    _skip_off(model)
                assert not torch.equal(expected, plain)  # the hook changes the output
                assert torch.equal(skipped, expected), f"step {step}: the plain graph replayed"
            assert runner.stats.hits == 3
            assert runner.stats.misses == 3
    finally:
        runner.close()


def test_a_graph_captured_under_layer_skip_hooks_is_not_replayed_without_them() -> None:
    """The other way round: captured during a guider's perturbed call, the skip graph was
    replayed for every plain call after the hooks were removed. After reset() the next capture
    takes the hooks as they are then."""
    model = tiny_flux()
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            _skip_on(model)
            try:
                runner.capture(**flux_in(0))
                skipped = runner(**flux_in(1)).sample
                assert torch.equal(skipped, model(**flux_in(1)).sample)
            finally:
                _skip_off(model)
            plain = runner(**flux_in(2)).sample
            assert torch.equal(plain, model(**flux_in(2)).sample), "the skip graph replayed"
            assert (runner.stats.hits, runner.stats.misses) == (1, 1)
            runner.reset()
            runner.capture(**flux_in(0))
            plain = runner(**flux_in(3)).sample
            assert torch.equal(plain, model(**flux_in(3)).sample)
            assert runner.stats.hits == 1
    finally:
        runner.close()
    from diffusers.hooks.hooks import HookRegistry as Registry

    assert not hasattr(Registry.register_hook, "__wrapped__")  # close() released the patch


def test_layer_skip_hooks_are_seen_through_torch_compile() -> None:
    """DiTRunner(torch.compile(model)): the compiled wrapper is torch's module, so the hook
    counter must be set up from the diffusers modules inside it, not the wrapper's class."""
    model = tiny_flux()
    compiled = torch.compile(model, backend="eager")
    runner = DiTRunner(
        compiled, breakable_attention=make_attention_ops_breakable(model), device="cpu"
    )
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0))
            _skip_on(model)
            try:
                skipped = runner(**flux_in(1)).sample
                expected = model(**flux_in(1)).sample
            finally:
                _skip_off(model)
            assert torch.equal(skipped, expected), "the plain graph replayed"
            assert (runner.stats.hits, runner.stats.misses) == (0, 1)
    finally:
        runner.close()
