"""Holes found by the fourteenth review (DiTRunner over diffusers transformers: weight hooks,
prompts, timesteps, attention patches), each pinned by a test that failed before its fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from bcg_core import disable_breakable_graphs
from bcg_diffusion import DiTRunner, bucket_for, make_attention_ops_breakable, pad_prompt

diffusers = pytest.importorskip("diffusers")


def _flux() -> Any:
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip


def _flux_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "timestep": torch.rand(1, generator=gen),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
    }


def _cast_layerwise(model: Any) -> Any:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return model


def test_a_model_casting_its_weights_at_every_forward_is_refused_at_capture() -> None:
    """enable_layerwise_casting() gives every weight new storage around each forward (cast to
    the compute dtype and back). Was: captured, and each replay ran the capture's casts from
    the capture-time storage into the parameters, so a weight updated in place after capture
    (a LoRA-style delta) was lost in the replay and in every eager call after it."""
    model, twin = _cast_layerwise(_flux()), _cast_layerwise(_flux())
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match="layerwise_casting"):
                runner.capture(**_flux_inputs())
            assert runner.stats.entries == ()
            for net in (model, twin):  # the same update on both
                for p in net.parameters():
                    p.copy_(p.float() * 2)
            expected = twin(**_flux_inputs(1)).sample
            assert torch.equal(runner(**_flux_inputs(1)).sample, expected)  # eager, no window
            assert torch.equal(model(**_flux_inputs(1)).sample, expected)
        assert runner.stats.captures == 0
    finally:
        runner.close()


def _design_as_tensor_step() -> str:
    """The step DESIGN.md gives for ``as_tensor`` timesteps of a DiT transformer."""
    design = Path(__file__).parents[2] / "packages" / "bcg-diffusion" / "DESIGN.md"
    text = " ".join(design.read_text().split())
    found = re.search(r"`(lambda x, t, \*\*kw: model\(.*?\))`", text)
    assert found is not None, "DESIGN.md's as_tensor step is gone"
    return found.group(1)


def test_the_documented_as_tensor_step_runs_on_every_eager_path() -> None:
    """DESIGN.md's step for a Python-float timestep named in as_tensor: the runner passes the
    float as given whenever it serves a call eagerly (a miss, graphs disabled). Was
    ``t.reshape(1)``: AttributeError ('float' object has no attribute 'reshape') there."""
    model = _flux()
    step = eval(_design_as_tensor_step(), {"model": model, "torch": torch})
    cond = _flux_inputs()
    x, _ = cond.pop("hidden_states"), cond.pop("timestep")
    runner = DiTRunner(
        step, breakable_attention=make_attention_ops_breakable(model), device="cpu",
        as_tensor=("t",),
    )  # fmt: skip
    try:
        with torch.no_grad():
            runner.capture(x, 1.0, **cond)
            for t in (0.75, 0.25):
                expected = model(x, timestep=torch.tensor([t]), **cond).sample
                assert torch.equal(runner(x, t, **cond).sample, expected)  # a replay
                wider = {**cond, "txt_ids": torch.zeros(8, 3, dtype=torch.float64)}
                assert torch.equal(runner(x, t, **wider).sample, expected)  # a miss
            assert runner.stats.hits == 2 and runner.stats.misses == 2
            with disable_breakable_graphs():  # as BCG_DISABLE=1 or a machine without CUDA
                expected = model(x, timestep=torch.tensor([0.5]), **cond).sample
                assert torch.equal(runner(x, 0.5, **cond).sample, expected)
    finally:
        runner.close()


def test_buckets_of_numpy_or_tensor_integers_are_lengths() -> None:
    """Was ValueError 'buckets must be positive int lengths, got [np.int64(64), ...]': only
    Python ints passed, so buckets made with NumPy or torch were refused though they are
    positive integer lengths. Floats and bools stay refused."""
    np = pytest.importorskip("numpy")
    embeds = torch.randn(2, 70, 8)
    for buckets in (np.arange(64, 257, 64), torch.tensor([128, 64, 192])):
        assert bucket_for(70, buckets) == 128 and type(bucket_for(70, buckets)) is int
        padded, mask = pad_prompt(embeds, None, buckets)
        assert padded.shape == (2, 128, 8) and int(mask.sum()) == 2 * 70
        assert torch.equal(padded[:, :70], embeds) and not padded[:, 70:].any()
    for bad in ([64.0], [True], [np.float32(64)]):
        with pytest.raises(ValueError, match="positive int lengths"):
            bucket_for(3, bad)
