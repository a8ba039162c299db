"""Many transformers causal-LM families (tiny configs, 2 layers, random weights, float32) decoding
with a StaticCache through BreakableGraphRunner on the CPU graph backend: replays equal eager
bitwise, compiled steps trace to one graph, and what cannot be captured is refused by name.

Each family is built with full attention everywhere (sliding-window layers are tested in
test_cpu_transformers.py). The cache is restored after the capture by *every* tensor of each
cache layer: hybrid layers (ZAYA) keep convolution and recurrent states besides keys and values.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import BreakableGraphRunner

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_transformers import cache_tensors  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402

SMALL: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 64,
}  # fmt: skip
FULL = ["full_attention"] * 2
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
MLA = {
    **SMALL, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
}  # fmt: skip
# model_type -> config keyword arguments
FAMILIES: dict[str, dict[str, Any]] = {
    # GPT-2 with a pad token, as fine-tunes set it: its padding warning reads input_ids on the
    # host unless transformers sees a capture (is_tracing), which the CPU backend now reports
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64,
             "pad_token_id": 0},
    "gpt_bigcode": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64},
    "gpt_neox": {k: v for k, v in SMALL.items() if k != "num_key_value_heads"},
    "mixtral": {**SMALL, **MOE, "sliding_window": None},
    "qwen3_moe": {**SMALL, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "olmo2": SMALL,
    "olmoe": {**SMALL, "num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {**SMALL, **MOE},
    "cohere": SMALL,
    "starcoder2": {**SMALL, "sliding_window": None},
    "stablelm": SMALL,
    "phi": SMALL,
    "deepseek_v3": {**MLA, "moe_intermediate_size": 32, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                    "first_k_dense_replace": 1, "n_shared_experts": 1},
    "glm4": {**SMALL, "pad_token_id": 0},
    "smollm3": {**SMALL, "pad_token_id": 0, "layer_types": FULL, "use_sliding_window": False},
    "llama4_text": {**SMALL, "head_dim": 16, "intermediate_size_mlp": 128,
                    "num_local_experts": 2, "num_experts_per_tok": 1, "attention_chunk_size": 16,
                    "no_rope_layers": [1, 1], "layer_types": FULL},
    # Exaone 4 sets sliding_window on every attention module, full layers too (is_sliding says
    # which slide): its full-attention layers used to be refused as sliding
    "exaone4": {**SMALL, "layer_types": FULL},
    "ernie4_5_moe": {**SMALL, "moe_intermediate_size": 32, "moe_num_experts": 4, "moe_k": 2,
                     "moe_num_shared_experts": 1, "moe_layer_start_index": 1},
    "helium": {**SMALL, "head_dim": 16},
    "diffllama": SMALL,  # two sdpa calls per layer
    # Gemma 4's config refuses a plain read of per-layer fields (head_dim): bcg_eager's mask
    # break, flattening the config it is given, used to raise AmbiguousGlobalPerLayerAttributeError
    "gemma4_text": {**SMALL, "pad_token_id": 0, "layer_types": FULL},
    "zaya": SMALL,  # hybrid cache layers: convolution and recurrent states
}  # fmt: skip
SDPA_CALLS_PER_LAYER = {"diffllama": 2}
EAGER = ("deepseek_v3", "exaone4", "gemma4_text", "gpt2", "llama4_text", "zaya")
# Compiled: every family with BCG_ALL_FAMILIES=1; by default the findings and the most distinct
# code paths (MLA, MoE, chunked masks, hybrid cache).
COMPILED = (
    sorted(FAMILIES)
    if os.environ.get("BCG_ALL_FAMILIES")
    else ("deepseek_v3", "exaone4", "gemma4_text", "gpt2", "llama4_text", "mixtral", "zaya")
)


def model_of(
    family: str,
    attn: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Any:
    torch.manual_seed(0)
    config = CONFIG_MAPPING[family](**{**FAMILIES[family], **overrides})
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=dtype
    ).to(device).eval()  # fmt: skip


def _prefilled(model: Any, prompt: torch.Tensor) -> Any:
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return cache


def decode(model: Any, steps: int = 6) -> tuple[BreakableGraphRunner, int]:
    """Greedy decode: the runner's replays against eager on its own cache, bitwise, per step;
    returns the runner and the breaks of its one graph (on the model's device)."""
    device = str(model.device)
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    cache, reference = _prefilled(model, prompt), _prefilled(model, prompt)

    def step(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits

    runner = BreakableGraphRunner(step, device=device, warmup_iters=1)
    ids = prompt[:, -1:].flip(0)
    with torch.no_grad():
        saved = [t.clone() for t in cache_tensors(cache)]
        runner.capture(ids)
        for t, s in zip(cache_tensors(cache), saved, strict=True):
            t.copy_(s)
        assert not runner.blocked_signatures, runner.blocked_signatures
        (entry,) = runner.stats.entries
        for _ in range(steps):
            got = runner(ids)
            expected = model(input_ids=ids, past_key_values=reference, use_cache=True).logits
            assert torch.equal(got, expected)
            ids = expected[:, -1:].argmax(-1)
    assert runner.stats.hits == steps
    assert not bcg_core.is_breakable_capture_active()
    return runner, entry.breaks


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sdpa_decode_replays_equal_eager(family: str) -> None:
    model = model_of(family, bcg_core.breakable_attention("sdpa"))
    _, breaks = decode(model)
    assert breaks == model.config.num_hidden_layers * SDPA_CALLS_PER_LAYER.get(family, 1)


@pytest.mark.parametrize("family", EAGER)
def test_eager_decode_replays_equal_eager(family: str) -> None:
    model = model_of(family, bcg_core.breakable_attention("eager"))
    _, breaks = decode(model)
    assert breaks > model.config.num_hidden_layers  # the layers, and the mask function(s)


@pytest.mark.parametrize("family", COMPILED)
def test_compiled_decode_is_one_graph_with_no_sliding_reason(family: str) -> None:
    """One dynamo graph, equal to eager, and no sdpa op carries a sliding-window reason (the
    capture would refuse it: Exaone 4's full layers did)."""
    from bcg_core._capture import opaque  # noqa: PLC2701

    model = model_of(family, bcg_core.breakable_attention("sdpa"))
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)

    def step(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits

    ids = torch.tensor([[7]])
    before = set(opaque._layouts)
    with torch.no_grad():
        step(torch.arange(5)[None])
        saved = copy.deepcopy(cache)
        expected = model(input_ids=ids, past_key_values=copy.deepcopy(cache), use_cache=True)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(ids)
        for t, s in zip(cache_tensors(cache), cache_tensors(saved), strict=True):
            t.copy_(s)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert torch.equal(got, expected.logits)
    reasons = [
        leaf
        for key, layout in opaque._layouts.items()
        if key not in before
        for leaf in layout.leaves
        if isinstance(leaf, str) and "sliding" in leaf
    ]
    assert reasons == []


REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    # (Exaone 4's sliding layers are captured: test_cpu_transformers.py's WINDOWED)
    # OPT sizes its mask and slices its positions by get_seq_length(), a tensor read on the host
    "opt": (
        lambda: CONFIG_MAPPING["opt"](
            hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=64,
        ),
        "HostSyncError: operation not permitted when stream is capturing",
    ),
    # JetMoE's experts split tokens by a .tolist() of their counts
    "jetmoe": (
        lambda: CONFIG_MAPPING["jetmoe"](
            hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
            max_position_embeddings=64, intermediate_size=128,
        ),
        "HostSyncError: operation not permitted when stream is capturing: Tensor.tolist",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_uncapturable_families_are_refused_and_served_eagerly(case: str) -> None:
    make, why = REFUSED[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        make(), attn_implementation=bcg_core.breakable_attention("sdpa"), dtype=torch.float32
    ).eval()
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    cache, reference = _prefilled(model, prompt), _prefilled(model, prompt)
    runner = BreakableGraphRunner(
        lambda ids: model(input_ids=ids, past_key_values=cache, use_cache=True).logits,
        device="cpu",
        warmup_iters=0,
    )
    ids = prompt[:, -1:]
    with torch.no_grad():
        saved = [t.clone() for t in cache_tensors(cache)]
        positions = [getattr(layer, "cumulative_length_int", None) for layer in cache.layers]
        runner.capture(ids)  # refused part-way, then run eagerly: the cache moved on...
        (blocked,) = runner.blocked_signatures.values()
        assert why in blocked
        assert runner.stats.entries == ()
        assert not bcg_core.is_breakable_capture_active()
        for t, s in zip(cache_tensors(cache), saved, strict=True):
            t.copy_(s)  # ...so put it back
        for layer, position in zip(cache.layers, positions, strict=True):
            if position is not None:
                layer.cumulative_length_int = position
        for _ in range(2):
            got = runner(ids)
            expected = model(input_ids=ids, past_key_values=reference, use_cache=True).logits
            assert torch.equal(got, expected)
            ids = expected[:, -1:].argmax(-1)


def test_cpu_capture_reports_a_capturing_stream_as_cuda_does() -> None:
    """Inside a CPU segment torch.cuda.is_current_stream_capturing() is True, as inside a CUDA
    capture, so transformers' is_tracing() is too; in a break and after the capture it is not,
    and torch's own function is back."""
    from transformers.utils.import_utils import is_cuda_stream_capturing

    from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph

    original = torch.cuda.is_current_stream_capturing
    seen: list[tuple[str, bool]] = []

    @eager_on_graph(name="ask")
    def ask(x: torch.Tensor) -> torch.Tensor:
        seen.append(("break", is_cuda_stream_capturing()))
        return x + 1

    graph = BreakableCUDAGraph(backend="cpu")
    x = torch.ones(3)
    with bcg_core.enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        seen.append(("segment", is_cuda_stream_capturing()))
        y = ask(x * 2)
        seen.append(("segment", is_cuda_stream_capturing()))
    assert seen == [("segment", True), ("break", False), ("segment", True)]
    assert torch.cuda.is_current_stream_capturing is original
    assert not is_cuda_stream_capturing()
    graph.replay()
    assert torch.equal(y, torch.full((3,), 3.0))
