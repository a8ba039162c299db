"""The transformers families of ``test_cpu_transformers_families`` on a real GPU (bf16): a
StaticCache decode captured once, six replays equal eager on its own cache bit for bit, every
attention call a break (MLA with its own head sizes, MoE routing, hybrid caches, GPT-2's pad
token under a real capture)."""

from __future__ import annotations

import pytest
import torch

import bcg_core

pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)

from test_cpu_transformers_families import (
    EAGER,
    FAMILIES,
    SDPA_CALLS_PER_LAYER,
    decode,
    model_of,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sdpa_decode_on_cuda_replays_equal_eager(family: str) -> None:
    model = model_of(family, bcg_core.breakable_attention("sdpa"), "cuda", torch.bfloat16)
    _, breaks = decode(model)
    assert breaks == model.config.num_hidden_layers * SDPA_CALLS_PER_LAYER.get(family, 1)


@pytest.mark.parametrize("family", EAGER)
def test_eager_decode_on_cuda_replays_equal_eager(family: str) -> None:
    model = model_of(family, bcg_core.breakable_attention("eager"), "cuda", torch.bfloat16)
    _, breaks = decode(model)
    assert breaks > model.config.num_hidden_layers
