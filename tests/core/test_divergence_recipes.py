"""The divergence check on the README's transformers recipe: ok for every full-attention family,
with either base of ``breakable_attention`` (the sdpa adapter's kernel-op breaks are observed on
the eager path too); on CPU and on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import check_divergence

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)

SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 64,
}  # fmt: skip
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
}
PROMPT = 5


def _recipe(family: str, base: str, device: str, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """The README recipe's model, prefilled cache and decode step."""
    torch.manual_seed(0)
    name = bcg_core.breakable_attention(base)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name)
    model = model.to(device, dtype).eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    prompt = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    model(input_ids=prompt.to(device), past_key_values=cache)

    def step(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache).logits
        return logits

    return model, cache, step


def _at_prompt_end(cache: Any, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """An input set that first puts the cache position back (the step advances it)."""

    def load() -> torch.Tensor:
        for layer in cache.layers:
            layer.cumulative_length.fill_(PROMPT)
        return ids

    return load


def _ids(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128, (2, 1), generator=gen).to(device) for _ in range(3)]


def check_recipe(family: str, base: str, device: str, dtype: torch.dtype) -> None:
    with torch.no_grad():
        model, cache, step = _recipe(family, base, device, dtype)
        sets = [_at_prompt_end(cache, ids) for ids in _ids(device)]
        report = check_divergence(step, sets)
        assert report.ok, str(report)
        masks = 0 if base == "sdpa" else 1  # other bases' mask function is a break
        assert report.breaks == model.config.num_hidden_layers + masks
        assert report.segments == report.breaks + 1


@pytest.mark.parametrize(
    ("family", "base"), [*((f, "sdpa") for f in sorted(FAMILIES)), ("llama", "eager")]
)
def test_readme_recipe_checks_ok_on_cpu(family: str, base: str) -> None:
    check_recipe(family, base, "cpu", torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_readme_recipe_checks_ok_on_cuda(family: str, base: str) -> None:
    check_recipe(family, base, "cuda", torch.bfloat16)


def test_a_baked_value_in_the_recipe_is_still_caught() -> None:
    """The same recipe with a host value read in the step: the check still blames segment 1."""
    with torch.no_grad():
        _, cache, step = _recipe("llama", "sdpa", "cpu", torch.float32)

        def baked(ids: torch.Tensor, scale: float) -> torch.Tensor:
            return step(ids) * scale  # the scale is baked into the last segment

        loads = [_at_prompt_end(cache, ids) for ids in _ids("cpu")]
        sets = [lambda i=i: (loads[i](), float(i + 1)) for i in range(3)]
        report = check_divergence(baked, sets)
    assert report.status == "diverged", str(report)
    assert (report.segment, report.break_after) == (3, None)
