"""Holes found driving transformers' cache layer classes (transformers 5.17) through bcg on the CPU
graph backend: tiny random-weight models whose configs use each layer class, decode steps and
``generate(num_beams=2)`` through a :class:`BreakableGraphRunner`, compared with plain
transformers bitwise."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import BreakableGraphRunner

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_transformers_families import SMALL, cache_tensors  # noqa: E402
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


def _saved(cache: Any) -> Callable[[], None]:
    """Save every tensor of the cache's layers and the sliding layers' int positions; the
    function returned puts them back (the tensors in place)."""
    saved = [t.clone() for t in cache_tensors(cache)]
    positions = [vars(layer).get("cumulative_length_int") for layer in cache.layers]

    def restore() -> None:
        for t, s in zip(cache_tensors(cache), saved, strict=True):
            t.copy_(s)
        for layer, position in zip(cache.layers, positions, strict=True):
            if position is not None:
                layer.cumulative_length_int = position

    return restore


def _closure_graphed(model: Any, cache: Any) -> BreakableGraphRunner:
    """The README's recipe inside ``generate``: a runner over a step closing over ``cache``."""
    forward = model.forward

    def step(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = forward(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
            logits_to_keep=1,
        )  # fmt: skip
        logits: torch.Tensor = out.logits
        return logits

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=1)

    @functools.wraps(forward)  # generate() reads forward's signature (logits_to_keep)
    def decode(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[1] != 1 or kwargs["past_key_values"] is not cache:
            return forward(*args, **kwargs)
        call = (kwargs["input_ids"], kwargs["attention_mask"])
        if not runner.stats.entries:
            restore = _saved(cache)
            runner.capture(*call)
            restore()
        logits = runner(*call)
        return transformers.modeling_outputs.CausalLMOutputWithPast(
            logits=logits, past_key_values=cache
        )

    model.forward = decode
    return runner


def _argument_graphed(model: Any) -> BreakableGraphRunner:
    """A runner over ``model.forward`` itself: the cache is an argument."""
    forward = model.forward
    runner = BreakableGraphRunner(forward, device="cpu", warmup_iters=1)

    @functools.wraps(forward)
    def decode(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[1] != 1:
            return forward(*args, **kwargs)
        if not runner.stats.entries:
            restore = _saved(kwargs["past_key_values"])
            runner.capture(*args, **kwargs)
            restore()
        return runner(*args, **kwargs)

    model.forward = decode
    return runner


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
            runner = _closure_graphed(model, cache)
        elif graphs == "argument":
            runner = _argument_graphed(model)
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
