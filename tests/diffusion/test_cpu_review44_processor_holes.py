"""DiTRunner and attention processors / backends changed after capture (review 44), on the
CPU graph backend: a call under other processors than the graphs' capture runs eagerly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bcg_diffusion import DiTRunner, make_attention_ops_breakable

diffusers = pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor  # noqa: E402
from test_cpu_review43_dit_holes import flux_in, tiny_flux  # noqa: E402


class _Scaled(FluxAttnProcessor):
    """A processor whose output differs from the default's (twice it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(2 * o for o in out)
        return 2 * out


def _runner(model: torch.nn.Module) -> DiTRunner:
    return DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")


def test_a_processor_set_after_capture_is_not_replayed_as_the_old_one() -> None:
    """set_attn_processor after capture: the graph replayed the capture's processors (the new
    processor's output was silently the old one's). The call now runs eagerly, a miss."""
    model = tiny_flux()
    runner = _runner(model)
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0))
            plain = runner(**flux_in(1)).sample
            model.set_attn_processor(_Scaled())
            got = runner(**flux_in(1)).sample
            expected = model(**flux_in(1)).sample
            assert not torch.equal(expected, plain)  # the processor changes the output
            assert torch.equal(got, expected), "the capture's processors replayed"
            assert (runner.stats.hits, runner.stats.misses) == (1, 1)
    finally:
        runner.close()


def test_a_pag_style_swap_and_restore_around_one_call() -> None:
    """A PAG pipeline sets its processors at the start of a call and restores the originals at
    its end: the swapped call runs eagerly, the calls after the restore replay again."""
    model = tiny_flux()
    runner = _runner(model)
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0))
            for step in range(1, 3):
                original = model.attn_processors
                model.set_attn_processor(_Scaled())
                try:
                    swapped = runner(**flux_in(step)).sample
                    expected = model(**flux_in(step)).sample
                finally:
                    model.set_attn_processor(original)
                assert torch.equal(swapped, expected), f"step {step}: the plain graph replayed"
                plain = runner(**flux_in(step)).sample
                assert torch.equal(plain, model(**flux_in(step)).sample)
                assert not torch.equal(plain, swapped)
            assert (runner.stats.hits, runner.stats.misses) == (2, 2)
    finally:
        runner.close()


def test_a_graph_captured_under_a_swapped_processor_is_not_replayed_after_the_restore() -> None:
    """Captured during the swapped call, the swapped graph was replayed for the plain calls
    after the restore. After reset() the next capture takes the processors as they are."""
    model = tiny_flux()
    runner = _runner(model)
    try:
        with torch.no_grad():
            original = model.attn_processors
            model.set_attn_processor(_Scaled())
            try:
                runner.capture(**flux_in(0))
                swapped = runner(**flux_in(1)).sample
                assert torch.equal(swapped, model(**flux_in(1)).sample)
            finally:
                model.set_attn_processor(original)
            plain = runner(**flux_in(1)).sample
            assert torch.equal(plain, model(**flux_in(1)).sample), "the swapped graph replayed"
            assert (runner.stats.hits, runner.stats.misses) == (1, 1)
            runner.reset()
            runner.capture(**flux_in(0))
            assert torch.equal(runner(**flux_in(2)).sample, model(**flux_in(2)).sample)
            assert runner.stats.hits == 1
    finally:
        runner.close()


def test_fuse_qkv_projections_after_capture_runs_eagerly() -> None:
    """fuse_qkv_projections() after capture: the graph replayed the unfused projections (whose
    weights a caller may then drop or change). The call now runs eagerly, as eager does."""
    model = tiny_flux()
    runner = _runner(model)
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0))
            model.fuse_qkv_projections()
            for attn in model.modules():
                if getattr(attn, "fused_projections", False):
                    attn.to_qkv.weight.mul_(2)  # the fused weights are now the ones used
            got = runner(**flux_in(1)).sample
            assert torch.equal(got, model(**flux_in(1)).sample), "the unfused graph replayed"
            assert runner.stats.misses == 1
    finally:
        runner.close()


def test_set_attention_backend_after_capture_runs_eagerly() -> None:
    """diffusers' attention_backend() context and set_attention_backend() after capture: the
    graph had the capture's backend. Such a call now runs eagerly; out of the context, calls
    replay again."""
    from diffusers.models.attention_dispatch import (
        _AttentionBackendRegistry,  # noqa: PLC2701  (set_attention_backend sets it)
        attention_backend,
    )

    active = _AttentionBackendRegistry._active_backend
    model = tiny_flux()
    runner = _runner(model)
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0))
            with attention_backend("_native_math"):
                got = runner(**flux_in(1)).sample
                assert torch.equal(got, model(**flux_in(1)).sample)
            assert (runner.stats.hits, runner.stats.misses) == (0, 1)
            assert torch.equal(runner(**flux_in(2)).sample, model(**flux_in(2)).sample)
            assert (runner.stats.hits, runner.stats.misses) == (1, 1)
            model.set_attention_backend("_native_math")
            got = runner(**flux_in(3)).sample
            assert torch.equal(got, model(**flux_in(3)).sample)
            assert (runner.stats.hits, runner.stats.misses) == (1, 2)
    finally:
        runner.close()
        _AttentionBackendRegistry.set_active_backend(active)  # set_attention_backend set it


def test_plain_calls_still_replay_and_close_releases_the_counting_patches() -> None:
    """Nothing changed: every call replays (and re-setting the same processor classes does not
    make a miss); close() releases the setters' patches."""
    model = tiny_flux()
    runner = _runner(model)
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0))
            for step in range(1, 4):
                assert torch.equal(runner(**flux_in(step)).sample, model(**flux_in(step)).sample)
            model.set_attn_processor(model.attn_processors)
            assert torch.equal(runner(**flux_in(4)).sample, model(**flux_in(4)).sample)
            assert (runner.stats.hits, runner.stats.misses) == (4, 0)
    finally:
        runner.close()
    from diffusers.models.attention import AttentionModuleMixin

    assert not hasattr(AttentionModuleMixin.set_processor, "__wrapped__")


def test_a_pag_pipelines_own_processor_swap_is_seen() -> None:
    """diffusers' PAG pipelines (PixArt-Sigma, Sana...) set their PAG processors by assigning
    ``module.processor`` in ``PAGMixin._set_pag_attn_processor`` (no setter) at the start of a
    call, and restore the originals with set_attn_processor at its end: the perturbed calls
    replayed the plain graph."""
    from diffusers.pipelines.pag.pag_utils import PAGMixin

    torch.manual_seed(0)
    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=32,
        norm_type="ada_norm_single", use_additional_conditions=False,
    ).eval()  # fmt: skip

    class _Pipe(PAGMixin):
        transformer = model

    pipe = _Pipe()
    pipe.set_pag_applied_layers(["transformer_blocks.0"])
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(2, 8, 32, generator=gen)
    conditions = {"resolution": None, "aspect_ratio": None}

    def inputs(seed: int) -> dict[str, Any]:
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
        t = torch.full((2,), 500.0)
        return {"hidden_states": x, "encoder_hidden_states": text, "timestep": t,
                "added_cond_kwargs": conditions}  # fmt: skip

    runner = _runner(model)
    try:
        with torch.no_grad():
            runner.capture(**inputs(0))
            original = model.attn_processors
            pipe._set_pag_attn_processor(pipe.pag_applied_layers, do_classifier_free_guidance=False)
            try:
                perturbed = runner(**inputs(1)).sample
                expected = model(**inputs(1)).sample
            finally:
                model.set_attn_processor(original)
            plain = runner(**inputs(1)).sample
            assert torch.equal(plain, model(**inputs(1)).sample)
            assert not torch.equal(plain, expected)  # PAG changes the output
            assert torch.equal(perturbed, expected), "the plain graph replayed"
            assert (runner.stats.hits, runner.stats.misses) == (1, 1)
    finally:
        runner.close()
