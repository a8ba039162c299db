"""transformers decode (bf16, StaticCache) through BreakableGraphRunner on a real GPU with
bcg_core.breakable_attention: each replayed step equals eager bit for bit."""

from __future__ import annotations

import pytest
import torch

import bcg_core

pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)

from test_cpu_transformers import FAMILIES, decode_through_runner

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_cache_decode_replays_equal_eager_on_cuda(family: str) -> None:
    import transformers

    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            FAMILIES[family](),
            attn_implementation=bcg_core.breakable_attention("sdpa"),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    decode_through_runner(model, steps=3, device="cuda")
