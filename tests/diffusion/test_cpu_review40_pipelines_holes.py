"""Real diffusers pipelines (review 40) with their transformer served by a DiTRunner on the CPU
graph backend: tiny random models from configs, prompt embeddings passed directly (no text
encoder), the pipeline's own scheduler, CFG, callbacks and VAE. Every run is compared bitwise
with the plain pipeline (float32), and a second run of each case must replay, not capture.
No hole was found here; the file holds the end-to-end coverage the review ran."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from bcg_diffusion import DiTRunner, make_attention_ops_breakable

diffusers = pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)


def _vae() -> Any:
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=4, sample_size=16, shift_factor=0.1,
        scaling_factor=0.5,
    ).eval()  # fmt: skip


def _flux() -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=_vae(), text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=model,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    pe, pooled = torch.randn(1, 8, 32, generator=gen), torch.randn(1, 32, generator=gen)
    base = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled, "height": 16, "width": 16}
    cases = [
        {},
        {  # true CFG: a second transformer call per step, two images per prompt
            "true_cfg_scale": 2.0,
            "negative_prompt_embeds": pe * 0.5,
            "negative_pooled_prompt_embeds": pooled * 0.5,
            "num_images_per_prompt": 2,
        },
        {"height": 32, "width": 16, "output_type": "pil"},  # a new resolution
        {"prompt_embeds": torch.randn(1, 12, 32, generator=gen), "output_type": "pt"},
    ]
    return pipe, base, cases


def _sd3() -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
    ).eval()  # fmt: skip
    pipe = diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=_vae(), text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
        tokenizer_3=None, transformer=model,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    base = {
        "prompt_embeds": torch.randn(1, 8, 32, generator=gen),
        "pooled_prompt_embeds": torch.randn(1, 32, generator=gen),
        "negative_prompt_embeds": torch.randn(1, 8, 32, generator=gen),
        "negative_pooled_prompt_embeds": torch.randn(1, 32, generator=gen),
        "guidance_scale": 4.0,  # CFG: the batch is doubled
        "height": 16, "width": 16,
    }  # fmt: skip
    cases = [
        {},
        {"guidance_scale": 1.0},
        {"height": 32, "width": 16, "output_type": "pil"},
        {  # skip-layer guidance: a list constant in the signature, a third call per step
            "skip_guidance_layers": [1],
            "skip_layer_guidance_start": 0.0,
            "skip_layer_guidance_stop": 1.0,
        },
    ]
    return pipe, base, cases


def _wan() -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
    ).eval()  # fmt: skip
    vae = diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()  # fmt: skip
    pipe = diffusers.WanPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=model,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    base = {
        "prompt_embeds": torch.randn(1, 8, 32, generator=gen),
        "negative_prompt_embeds": torch.randn(1, 8, 32, generator=gen),
        "guidance_scale": 4.0, "height": 16, "width": 16, "num_frames": 5,
    }  # fmt: skip
    cases = [{}, {"height": 32, "width": 16, "output_type": "np"}]
    return pipe, base, cases


def _scale_latents(pipe: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
    kw["latents"] = kw["latents"] * 0.9
    return kw


def _images(out: Any) -> Any:
    images = getattr(out, "images", None)
    return out.frames if images is None else images


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


PIPELINES: dict[str, Callable[[], tuple[Any, dict[str, Any], list[dict[str, Any]]]]] = {
    "flux": _flux,
    "sd3": _sd3,
    "wan": _wan,
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_served_by_dit_runner_equals_plain_and_replays(name: str) -> None:
    pipe, base, cases = PIPELINES[name]()
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer

    def run(case: dict[str, Any]) -> Any:
        args = {
            **base, "num_inference_steps": 3, "output_type": "latent",
            "generator": torch.Generator().manual_seed(5),
            "callback_on_step_end": _scale_latents,
            "callback_on_step_end_tensor_inputs": ["latents"], **case,
        }  # fmt: skip
        with torch.no_grad():
            return _images(pipe(**args))

    expected = [run(case) for case in cases]
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        pipe.transformer = runner
        for case, want in zip(cases, expected, strict=True):
            with runner.warmup():
                first = run(case)
            captures = runner.stats.captures
            hits = runner.stats.hits
            second = run(case)
            assert _equal(first, want), case
            assert _equal(second, want), case
            assert runner.stats.captures == captures, case  # the second run only replays
            assert runner.stats.misses == 0, case
            assert runner.stats.hits > hits, case
        assert runner.stats.failed_captures == 0
    finally:
        runner.close()
