"""transformers decode (bf16, StaticCache) through BreakableGraphRunner on a real GPU with
bcg_core.breakable_attention: each replayed step equals eager bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import bcg_core

pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)

from test_cpu_transformers import (
    FAMILIES,
    WINDOWED,
    WINDOWED_MASKS,
    captured_breaks,
    decode_through_runner,
    sliding_positions,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_cache_decode_replays_equal_eager_on_cuda(family: str, base: str) -> None:
    import transformers

    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            FAMILIES[family](),
            attn_implementation=bcg_core.breakable_attention(base),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    decode_through_runner(model, steps=3, device="cuda", mask_breaks=int(base != "sdpa"))


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_decode_captured_in_inference_mode_on_cuda(base: str) -> None:
    import transformers

    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            FAMILIES["llama"](),
            attn_implementation=bcg_core.breakable_attention(base),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    decode_through_runner(
        model, steps=3, device="cuda", mask_breaks=int(base != "sdpa"), mode=torch.inference_mode
    )


@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_decode_across_the_window_on_cuda(family: str, base: str) -> None:
    """The sliding layers' update and position breaks on CUDA (their eager roll, the fills of
    the position, the mask built in the graph from it): 40 replays, 30 past a full window."""
    import transformers

    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            WINDOWED[family](),
            attn_implementation=bcg_core.breakable_attention(base),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    masks = 0 if base == "sdpa" else WINDOWED_MASKS[family]
    reference = decode_through_runner(
        model, steps=40, device="cuda", mask_breaks=masks, max_cache_len=64
    )
    assert set(sliding_positions(reference)) == {6 + 40}


FUSED = {
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, "_scaled_dot_product_efficient_attention"),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, "_scaled_dot_product_cudnn_attention"),
}


@pytest.mark.parametrize("backend", sorted(FUSED))
def test_sdpa_break_is_the_chosen_fused_kernel_on_cuda(backend: str) -> None:
    """The break is the kernel op of the backend sdpa picks; sdpa's conversion of the boolean
    mask is in the graph; capture and replays equal eager sdpa on that backend, bitwise."""
    import transformers

    choice, op = FUSED[backend]
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    config.num_key_value_heads = config.num_attention_heads  # the efficient kernel has no GQA
    model = (
        transformers.AutoModelForCausalLM.from_config(
            config,
            attn_implementation=bcg_core.breakable_attention("sdpa"),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    with sdpa_kernel(choice):
        breaks, _, _ = captured_breaks(model, "cuda")
        assert [b.args[0] for b in breaks] == [getattr(torch.ops.aten, op).default] * len(breaks)
        assert len(breaks) == model.config.num_hidden_layers
        assert all(b.args[4].dtype == torch.bfloat16 for b in breaks)
        decode_through_runner(model, steps=3, device="cuda")


def test_a_prefilled_dynamic_cache_is_refused_on_cuda_and_served_eagerly() -> None:
    """A DynamicCache grows by torch.cat into new tensors: a captured decode step would
    attend to the capture's context at every replay. The capture is refused by name (before
    anything is left capturing) and the runner serves the step eagerly, equal to eager."""
    import copy

    import transformers

    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            FAMILIES["llama"](),
            attn_implementation=bcg_core.breakable_attention("sdpa"),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    prompt = torch.randint(0, 128, (1, 5), device="cuda")
    with torch.no_grad():
        prefilled = transformers.DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=prefilled)
        cache, reference = copy.deepcopy(prefilled), copy.deepcopy(prefilled)
        runner = bcg_core.BreakableGraphRunner(
            lambda ids: model(input_ids=ids, past_key_values=cache).logits, warmup_iters=0
        )
        ids = prompt[:, -1:]
        runner.capture(ids)
        (why,) = runner.blocked_signatures.values()
        assert "CaptureError" in why and "made before the capture" in why
        assert not bcg_core.is_breakable_capture_active()
        reference_after_capture = model(input_ids=ids, past_key_values=reference).logits
        for _ in range(4):
            ids = reference_after_capture[:, -1:].argmax(-1)
            got = runner(ids)
            reference_after_capture = model(input_ids=ids, past_key_values=reference).logits
            assert torch.equal(got, reference_after_capture)
