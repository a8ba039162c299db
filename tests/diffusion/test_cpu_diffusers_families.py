"""More diffusers transformer families (tiny configs, random weights, float32) on the CPU graph
backend, found by adversarial testing: every attention op is a break, replays of new latents and
timesteps equal eager bit for bit, and the step traces to one dynamo graph. Models that read
tensor values on the host outside attention are refused at capture with the line that does it
(and serve eagerly); a processor that does so inside attention (Mochi) is one whole break."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from bcg_core import BreakableGraphRunner, enable_breakable_cuda_graph, is_in_breakable_cuda_graph
from bcg_diffusion import DiTRunner, make_attention_ops_breakable

D = pytest.importorskip("diffusers")

from test_cpu_diffusers import attention_ops  # noqa: E402

Kwargs = Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]
Family = Callable[[], tuple[nn.Module, Kwargs, torch.Tensor]]
FAMILIES: dict[str, Family] = {}


def _family(fn: Family) -> Family:
    FAMILIES[fn.__name__] = fn
    return fn


def R(*shape: int, seed: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape) if seed is None else seed)
    return torch.randn(*shape, generator=gen)


@_family
def hunyuan_video():
    m = D.HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    text, pooled, mask = R(1, 12, 16), R(1, 8), torch.ones(1, 12)
    g = torch.tensor([3.0])
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            timestep=t * 1000,
            encoder_hidden_states=text,
            encoder_attention_mask=mask,
            pooled_projections=pooled,
            guidance=g,
        ),
        R(1, 4, 1, 8, 8),
    )


@_family
def cogvideox():
    m = D.CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=4,
        text_embed_dim=8,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=8,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
    )
    text = R(1, 8, 8)
    return (
        m,
        lambda x, t: dict(hidden_states=x, encoder_hidden_states=text, timestep=(t * 1000).long()),
        R(1, 2, 4, 8, 8),
    )


@_family
def mochi():
    m = D.MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        pooled_projection_dim=16,
        in_channels=4,
        out_channels=None,
        qk_norm="rms_norm",
        text_embed_dim=16,
        time_embed_dim=4,
        activation_fn="swiglu",
        max_sequence_length=16,
    )
    text, mask = R(1, 16, 16), torch.ones(1, 16)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=(t * 1000),
            encoder_attention_mask=mask,
        ),
        R(1, 4, 2, 8, 8),
    )


@_family
def lumina2():
    m = D.Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=24,
        num_layers=2,
        num_refiner_layers=1,
        num_attention_heads=3,
        num_kv_heads=1,
        multiple_of=2,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        scaling_factor=1.0,
        axes_dim_rope=(4, 2, 2),
        axes_lens=(128, 128, 128),
        cap_feat_dim=8,
    )
    text, mask = R(1, 8, 8), torch.ones(1, 8, dtype=torch.bool)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_attention_mask=mask
        ),
        R(1, 4, 8, 8),
    )


@_family
def sana():
    m = D.SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=8,
        sample_size=8,
        patch_size=1,
    )
    text = R(1, 8, 8)
    return (
        m,
        lambda x, t: dict(hidden_states=x, encoder_hidden_states=text, timestep=t * 1000),
        R(1, 4, 8, 8),
    )


@_family
def auraflow():
    m = D.AuraFlowTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=64,
    )
    text = R(1, 8, 16)
    return (
        m,
        lambda x, t: dict(hidden_states=x, encoder_hidden_states=text, timestep=t * 1000),
        R(1, 4, 8, 8),
    )


@_family
def hidream():
    m = D.HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[8, 4],
        text_emb_dim=8,
        num_routed_experts=2,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32),
        llama_layers=(0, 1),
        force_inference_output=True,
    )
    t5, llama, pooled = R(1, 8, 8), R(2, 1, 8, 4), R(1, 8)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states_t5=t5,
            encoder_hidden_states_llama3=llama,
            pooled_embeds=pooled,
            timesteps=t * 1000,
        ),
        R(1, 4, 16, 16),
    )


@_family
def qwenimage():
    m = D.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    text, mask = R(1, 7, 16), torch.ones(1, 7, dtype=torch.long)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            timestep=t,
            img_shapes=[(1, 4, 4)],
        ),
        R(1, 16, 16),
    )


@_family
def chroma():
    m = D.ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 4, 8),
        approximator_num_channels=8,
        approximator_hidden_dim=16,
        approximator_layers=1,
    )
    text = R(1, 8, 32)
    img_ids, txt_ids = torch.zeros(16, 3), torch.zeros(8, 3)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
        ),
        R(1, 16, 4),
    )


@_family
def allegro():
    m = D.AllegroTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        cross_attention_dim=16,
        sample_width=8,
        sample_height=8,
        sample_frames=8,
        caption_channels=8,
    )
    text = R(1, 8, 8)
    return (
        m,
        lambda x, t: dict(hidden_states=x, encoder_hidden_states=text, timestep=t * 1000),
        R(1, 4, 2, 8, 8),
    )


@_family
def skyreels_v2():
    m = D.SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    text = R(1, 12, 16)
    return (
        m,
        lambda x, t: dict(hidden_states=x, timestep=t * 1000, encoder_hidden_states=text),
        R(1, 4, 2, 8, 8),
    )


@_family
def hunyuan_dit():
    m = D.HunyuanDiT2DModel(
        sample_size=8,
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        in_channels=4,
        cross_attention_dim=32,
        cross_attention_dim_t5=32,
        pooled_projection_dim=16,
        hidden_size=24,
        activation_fn="gelu-approximate",
        text_len=8,
        text_len_t5=8,
    )
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    text, mask = R(1, 8, 32), torch.ones(1, 8)
    t5, mask5 = R(1, 8, 32, seed=3), torch.ones(1, 8)
    meta = torch.tensor([[8, 8, 8, 8, 0, 0]], dtype=torch.float32)
    style = torch.zeros(1, dtype=torch.long)
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4))
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            timestep=t * 1000,
            encoder_hidden_states=text,
            text_embedding_mask=mask,
            encoder_hidden_states_t5=t5,
            text_embedding_mask_t5=mask5,
            image_meta_size=meta,
            style=style,
            image_rotary_emb=rope,
        ),
        R(1, 4, 8, 8),
    )


@_family
def wan_vace():
    m = D.WanVACETransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=256,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        vace_layers=[0, 2],
        vace_in_channels=8,
    )
    text, ctrl = R(1, 12, 16), R(1, 8, 2, 8, 8)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            timestep=t * 1000,
            encoder_hidden_states=text,
            control_hidden_states=ctrl,
        ),
        R(1, 4, 2, 8, 8),
    )


@_family
def flux2():
    m = D.Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],
    )
    text = R(1, 8, 32)
    img_ids = torch.cartesian_prod(
        torch.arange(1), torch.arange(4), torch.arange(4), torch.arange(1)
    )[None]
    txt_ids = torch.cartesian_prod(
        torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(8)
    )[None]
    g = torch.tensor([1.0])
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            img_ids=img_ids,
            txt_ids=txt_ids,
            timestep=t,
            guidance=g,
        ),
        R(1, 16, 4),
    )


@_family
def ltx2():
    m = D.LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=16,
        rope_double_precision=False,
    )
    audio, text, atext = R(1, 5, 4), R(1, 8, 16), R(1, 8, 16, seed=5)
    mask = torch.ones(1, 8).bool()
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            audio_hidden_states=audio,
            encoder_hidden_states=text,
            audio_encoder_hidden_states=atext,
            timestep=t * 1000,
            encoder_attention_mask=mask,
            num_frames=2,
            height=4,
            width=4,
            audio_num_frames=5,
            fps=25.0,
        ),
        R(1, 32, 4),
    )


@_family
def cogview4():
    m = D.CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=4,
        num_attention_heads=4,
        text_embed_dim=8,
        time_embed_dim=8,
        condition_dim=4,
    )
    text = R(1, 8, 8)
    os_, ts, cc = torch.tensor([[8.0, 8.0]]), torch.tensor([[8.0, 8.0]]), torch.tensor([[0.0, 0.0]])
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=t * 1000,
            original_size=os_,
            target_size=ts,
            crop_coords=cc,
        ),
        R(1, 4, 8, 8),
    )


@_family
def kandinsky5():
    m = D.Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        in_text_dim=16,
        in_text_dim2=8,
        time_dim=16,
        out_visual_dim=4,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(8, 4, 4),
    )
    text, pooled = R(1, 8, 16), R(1, 8)
    trp, vrp = torch.arange(8), (torch.arange(2), torch.arange(4), torch.arange(4))
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=t * 1000,
            pooled_projections=pooled,
            visual_rope_pos=vrp,
            text_rope_pos=trp,
        ),
        R(1, 2, 8, 8, 4),
    )


@_family
def hunyuan_image():
    m = D.HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=(1, 1),
        text_embed_dim=16,
        rope_axes_dim=(4, 4),
    )
    text, mask = R(1, 8, 16), torch.ones(1, 8)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            timestep=t * 1000,
            encoder_hidden_states=text,
            encoder_attention_mask=mask,
        ),
        R(1, 4, 8, 8),
    )


@_family
def latte():
    m = D.LatteTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=1,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        norm_type="ada_norm_single",
        caption_channels=16,
        video_length=2,
    )
    text = R(1, 8, 16)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            timestep=t * 1000,
            encoder_hidden_states=text,
            enable_temporal_attentions=True,
        ),
        R(1, 4, 2, 8, 8),
    )


@_family
def cogview3plus():
    m = D.CogView3PlusTransformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=4,
        num_attention_heads=2,
        out_channels=4,
        text_embed_dim=8,
        time_embed_dim=8,
        condition_dim=2,
        pos_embed_max_size=8,
        sample_size=8,
    )
    text = R(1, 8, 8)
    os_, ts, cc = torch.tensor([[8.0, 8.0]]), torch.tensor([[8.0, 8.0]]), torch.tensor([[0.0, 0.0]])
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=t * 1000,
            original_size=os_,
            target_size=ts,
            crop_coords=cc,
        ),
        R(1, 4, 8, 8),
    )


@_family
def zimage():
    m = D.ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[8, 4, 4],
        axes_lens=[64, 32, 32],
    )
    cap = [R(8, 16)]
    return m, lambda x, t: dict(x=[x[0]], t=t, cap_feats=cap), R(1, 4, 1, 8, 8)


@_family
def sana_video():
    m = D.SanaVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=8,
        sample_size=8,
        patch_size=(1, 2, 2),
    )
    text = R(1, 8, 8)
    return (
        m,
        lambda x, t: dict(hidden_states=x, encoder_hidden_states=text, timestep=t * 1000),
        R(1, 4, 2, 8, 8),
    )


@_family
def bria():
    m = D.BriaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=[0, 4, 4],
    )
    text = R(1, 8, 16)
    img_ids, txt_ids = torch.zeros(16, 3), torch.zeros(8, 3)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=t * 1000,
            img_ids=img_ids,
            txt_ids=txt_ids,
        ),
        R(1, 16, 4),
    )


@_family
def longcat_image():
    m = D.LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=[4, 6, 6],
    )
    text = R(1, 8, 16)
    img_ids, txt_ids = torch.zeros(16, 3), torch.zeros(8, 3)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
        ),
        R(1, 16, 4),
    )


@_family
def prx():
    m = D.PRXTransformer2DModel(
        in_channels=4,
        patch_size=2,
        context_in_dim=16,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=2,
        axes_dim=[8, 8],
    )
    text, mask = R(1, 8, 16), torch.ones(1, 8, dtype=torch.bool)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x, timestep=t, encoder_hidden_states=text, attention_mask=mask
        ),
        R(1, 4, 8, 8),
    )


@_family
def chronoedit():
    m = D.ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    text = R(1, 12, 16)
    return (
        m,
        lambda x, t: dict(hidden_states=x, timestep=t * 1000, encoder_hidden_states=text),
        R(1, 4, 2, 8, 8),
    )


@_family
def dit():
    m = D.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        num_layers=2,
        norm_num_groups=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    labels = torch.tensor([1])
    return (
        m,
        lambda x, t: dict(hidden_states=x, timestep=(t * 9).long(), class_labels=labels),
        R(1, 4, 8, 8),
    )


@_family
def stable_audio():
    m = D.StableAudioDiTModel(
        sample_size=8,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        num_key_value_attention_heads=1,
        out_channels=4,
        cross_attention_dim=16,
        time_proj_dim=8,
        global_states_input_dim=16,
        cross_attention_input_dim=16,
    )
    text, glob = R(1, 6, 16), R(1, 1, 16)
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    rope = get_1d_rotary_pos_embed(4, 8 + 1, use_real=True, repeat_interleave_real=False)
    return (
        m,
        lambda x, t: dict(
            hidden_states=x,
            timestep=t * 1000,
            encoder_hidden_states=text,
            global_hidden_states=glob,
            rotary_embedding=rope,
        ),
        R(1, 4, 8),
    )


# The attention ops each model runs that are no break: HunyuanDiT's pooled text embedding calls
# F.multi_head_attention_forward (torch's own attention, inside torch: captured).
UNPATCHED_OPS = {"hunyuan_dit": 1}
# Models reading tensor values on the host outside attention: refused at capture, served eagerly.
HOST_READERS = {
    "lumina2": "Tensor.tolist",  # the RoPE embedder's caption lengths (Python lists)
    "hidream": "bincount",  # the MoE's tokens per expert (and the unpatchify's image sizes)
}
REPLAYED = sorted(set(FAMILIES) - set(HOST_READERS))


def _step(family: str) -> tuple[nn.Module, Callable[..., torch.Tensor], Kwargs, torch.Tensor]:
    model, kwargs, latents = FAMILIES[family]()
    model.eval()

    def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(**kwargs(x, t), return_dict=False)
        out = out[0] if isinstance(out, tuple) else out
        return torch.stack(out) if isinstance(out, list) else out  # Z-Image: a list per sample

    return model, step, kwargs, latents


def _calls(latents: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    xs = [latents] + [torch.randn(latents.shape, generator=gen) for _ in range(2)]
    return [(x, torch.full((1,), 1.0 - i / 3)) for i, x in enumerate(xs)]


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


@pytest.mark.parametrize("family", REPLAYED)
def test_family_breaks_at_every_attention_op_and_replays_equal_eager(family: str) -> None:
    model, step, _, latents = _step(family)
    ops = attention_ops(step, latents)
    calls = _calls(latents)
    with torch.no_grad():
        expected = [step(*c) for c in calls]
        runner = DiTRunner(
            step, breakable_attention=make_attention_ops_breakable(model), device="cpu"
        )
        try:
            runner.capture(latents, torch.ones(1))
            (entry,) = runner.stats.entries
            assert entry.breaks == ops - UNPATCHED_OPS.get(family, 0) > 0
            got = [runner(*c) for c in calls]
            assert runner.stats.hits == len(calls) and runner.stats.misses == 0
        finally:
            runner.close()
        assert not is_in_breakable_cuda_graph()
        assert torch.equal(step(*calls[0]), expected[0])  # unpatched, eager as before
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize("family", ["hunyuan_video", "sana", "ltx2"])
def test_model_runner_and_plain_runner_replay_equal_eager(family: str) -> None:
    """DiTRunner over the model itself (keywords, return_dict=False per call) and core's plain
    runner under the handle."""
    model, step, kwargs, latents = _step(family)
    calls = _calls(latents)
    with torch.no_grad():
        expected = [step(*c) for c in calls]
        runner = DiTRunner(
            model, breakable_attention=make_attention_ops_breakable(model), device="cpu"
        )
        try:
            runner.capture(**kwargs(latents, torch.ones(1)))
            got = [runner(**kwargs(*c), return_dict=False)[0] for c in calls]
            assert runner.stats.hits == len(calls)
        finally:
            runner.close()
        with make_attention_ops_breakable(model):
            plain = BreakableGraphRunner(step, device="cpu")
            plain.capture(latents, torch.ones(1))
            got_plain = [plain(*c) for c in calls]
            plain.reset()
    for e, g, p in zip(expected, got, got_plain, strict=True):
        assert torch.equal(e, g) and torch.equal(e, p)


@pytest.mark.parametrize("family", ["qwenimage", "sana", "hunyuan_video"])
def test_compiled_family_is_one_dynamo_graph(family: str) -> None:
    torch._dynamo.reset()
    model, step, _, latents = _step(family)
    t = torch.tensor([0.5])
    with make_attention_ops_breakable(model), torch.no_grad():
        explained = torch._dynamo.explain(step)(latents, t)
        with enable_breakable_cuda_graph():
            flagged = torch._dynamo.explain(step)(latents, t)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert flagged.graph_count == 1 and flagged.graph_break_count == 0


def test_mochi_processor_reading_the_mask_on_the_host_is_one_break() -> None:
    """MochiAttnProcessor2_0 picks each sample's prompt tokens with nonzero(): its whole
    __call__ is the break (was: capture refused at the nonzero)."""
    from diffusers.models.attention_processor import MochiAttnProcessor2_0

    model, step, kwargs, latents = _step("mochi")
    text = kwargs(latents, torch.ones(1))["encoder_hidden_states"]
    short = torch.ones(1, text.shape[1])
    short[:, 10:] = 0  # another prompt length, same signature: the break reruns the nonzero

    def masked(x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            **{**kwargs(x, t), "encoder_attention_mask": mask}, return_dict=False
        )[0]
        return out

    with torch.no_grad():
        original = vars(MochiAttnProcessor2_0)["__call__"]
        handle = make_attention_ops_breakable(model)
        assert vars(MochiAttnProcessor2_0)["__call__"] is not original
        runner = DiTRunner(masked, breakable_attention=handle, device="cpu")
        try:
            runner.capture(latents, torch.ones(1), torch.ones(1, text.shape[1]))
            assert runner.stats.entries[0].breaks == attention_ops(step, latents)
            got = runner(latents, torch.tensor([0.3]), short)
        finally:
            runner.close()
        assert vars(MochiAttnProcessor2_0)["__call__"] is original
        assert torch.equal(got, masked(latents, torch.tensor([0.3]), short))


@pytest.mark.parametrize("family", sorted(HOST_READERS))
def test_host_reading_family_is_refused_at_capture_and_served_eagerly(
    family: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, step, _, latents = _step(family)
    with torch.no_grad():
        expected = step(latents, torch.ones(1))
        runner = DiTRunner(
            step, breakable_attention=make_attention_ops_breakable(model), device="cpu"
        )
        try:
            with caplog.at_level(logging.WARNING, logger="bcg_core"):
                out = runner.capture(latents, torch.ones(1))
            assert runner.stats.entries == ()
            assert HOST_READERS[family] in caplog.text and "@eager_on_graph" in caplog.text
            assert torch.equal(out, expected) and torch.equal(runner(latents, torch.ones(1)), out)
        finally:
            runner.close()
        assert not is_in_breakable_cuda_graph()


def test_kandinsky5_return_dict_false_keeps_the_bare_tensor() -> None:
    """Kandinsky 5's return_dict=False returns the tensor itself, not a tuple: the runner gives
    back what eager gives (was `(tensor,)`, whose [0] is eager's whole output, not its [0])."""
    model, _, kwargs, latents = _step("kandinsky5")
    with torch.no_grad():
        expected = model(**kwargs(latents, torch.ones(1)), return_dict=False)
        assert isinstance(expected, torch.Tensor)
        runner = DiTRunner(
            model, breakable_attention=make_attention_ops_breakable(model), device="cpu"
        )
        try:
            captured = runner.capture(**kwargs(latents, torch.ones(1)), return_dict=False)
            got = runner(**kwargs(latents, torch.ones(1)), return_dict=False)
            assert runner.stats.hits == 1 and runner.stats.misses == 0
            assert runner(**kwargs(latents, torch.ones(1))).sample.shape == expected.shape
        finally:
            runner.close()
    assert isinstance(captured, torch.Tensor) and torch.equal(captured, expected)
    assert isinstance(got, torch.Tensor) and torch.equal(got, expected)
