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
from test_cpu_generate_holes import closure_graphed, graphed_forward  # noqa: E402
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
    prompt = torch.randint(4, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    results = []
    for graphs in ("", "closure", "argument"):
        model = _linear_model(family)
        cache = transformers.StaticCache(config=model.config, max_cache_len=48)
        runner = None
        if graphs == "closure":
            runner = closure_graphed(model, cache)
        elif graphs == "argument":
            runner = graphed_forward(model)
        with torch.no_grad():
            out = model.generate(
                prompt, past_key_values=cache, max_new_tokens=8, min_new_tokens=8, num_beams=2,
                do_sample=False, output_scores=True, return_dict_in_generate=True,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        results.append((out, runner))
    (want, _), *graphed = results
    for got, runner in graphed:
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores, strict=True):
            assert torch.equal(a, b)
        assert runner is not None
        assert not runner.blocked_signatures, list(runner.blocked_signatures.values())
        assert (runner.stats.hits, runner.stats.misses) == (7, 0)
