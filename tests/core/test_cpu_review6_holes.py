"""Holes found in the transformers integrations (review 6), each pinned by a test: tiny models
with random weights on the CPU graph backend, compared with plain transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import bcg_core

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: E402


def _review6_attention(module: Any, *args: Any, **kwargs: Any) -> Any:
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, *args, **kwargs)


def test_a_bcg_name_not_yet_registered_registers_its_base() -> None:
    # breakable_attention("bcg_<base>") returned the name unregistered: the model then failed
    # to load ("attn_implementation ... is not supported"), and an unknown base passed unseen.
    AttentionInterface.register("review6_custom", _review6_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("review6_custom", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    name = bcg_core.breakable_attention("bcg_review6_custom")
    assert name == "bcg_review6_custom"
    assert name in AttentionInterface._global_mapping
    assert name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert bcg_core.breakable_attention("review6_custom") == name  # the same registration
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
        model.set_attn_implementation("sdpa")
        assert torch.equal(got, model(ids).logits)
    with pytest.raises(ValueError, match="unknown attention implementation 'review6_nope'"):
        bcg_core.breakable_attention("bcg_review6_nope")
    with pytest.raises(ValueError, match="flash attention functions choose their kernel"):
        bcg_core.breakable_attention("paged|bcg_flash_attention_2")
