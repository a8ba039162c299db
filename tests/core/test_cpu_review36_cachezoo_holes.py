"""Holes found driving transformers' cache layer classes (transformers 5.17) through bcg on the CPU
graph backend: tiny random-weight models whose configs use each layer class, decode steps and
``generate(num_beams=2)`` through a :class:`BreakableGraphRunner`, compared with plain
transformers bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import bcg_core

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_generate_holes import assert_beam_search_graphed_equals_plain  # noqa: E402
from test_cpu_transformers_families import SMALL  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402

# Linear-attention cache layers: LFM2's convolution layers (LinearAttentionLayer) beside a
# StaticLayer, ZAYA's hybrid LinearAttentionAndStaticFullAttentionLayer and (with a window)
# LinearAttentionAndStaticSlidingWindowAttentionLayer.
LINEAR = {
    "lfm2": ("lfm2", {**SMALL, "layer_types": ["conv", "full_attention"]}),
    "zaya": ("zaya", SMALL),
    "zaya_sliding": (
        "zaya",
        {**SMALL, "layer_types": ["hybrid_sliding", "hybrid"], "sliding_window": 4},
    ),
}


def _linear_model(family: str) -> Any:
    torch.manual_seed(0)
    kind, options = LINEAR[family]
    config = CONFIG_MAPPING[kind](**options)
    name = bcg_core.breakable_attention("sdpa")
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("family", sorted(LINEAR))
def test_beam_search_over_linear_attention_cache_layers_equals_plain_generate(
    family: str,
) -> None:
    """``LinearAttentionCacheLayerMixin.reorder_cache`` (every linear-attention layer's, and
    the hybrid ``LinearAttentionAndStatic*`` layers' through it) rebinds the convolution and
    recurrent states to ``index_select``'s new tensors; bcg kept only ``StaticLayer``'s reorder
    in place, so a graph over the cache replayed on stale states: LFM2's and ZAYA's beam
    scores differed from plain ``generate``, silently. Now every static layer's reorder writes
    back into the tensors it had. And ZAYA's sliding hybrid layer (a subclass of
    ``StaticSlidingWindowLayer``) kept its Python int position in the signature of a cache passed
    as an argument (only the exact class was left unwalked): every decode step was a miss, run
    eagerly."""
    assert_beam_search_graphed_equals_plain(lambda: _linear_model(family), 8, 2)
