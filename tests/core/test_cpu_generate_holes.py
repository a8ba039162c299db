"""Holes found driving transformers' ``generate()`` through bcg, as a serving engine does, on the
CPU graph backend with tiny random-weight models: the decode steps of ``model.generate`` with a
StaticCache go through a :class:`BreakableGraphRunner` over ``model.forward`` (the cache is an
argument, so one runner serves every request's cache, each batch size its own graph), and every
result equals plain transformers'."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from bcg_core import BreakableGraphRunner

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_transformers import _windowed, saved_cache  # noqa: E402, PLC2701


def graphed_forward(model: Any) -> BreakableGraphRunner:
    """Route ``model``'s one-token forwards through a runner over its own ``forward``; the
    first decode step of each cache captures (its cache saved and put back around the
    capture's runs), later ones replay. Prefills run eagerly."""
    forward = model.forward
    runner = BreakableGraphRunner(forward, device="cpu", warmup_iters=1)
    captured: set[int] = set()

    @functools.wraps(forward)  # generate() reads forward's signature (logits_to_keep)
    def decode(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[1] != 1:
            return forward(*args, **kwargs)
        cache = kwargs["past_key_values"]
        if id(cache) not in captured:
            captured.add(id(cache))
            restore = saved_cache(cache)
            runner.capture(*args, **kwargs)
            restore()
        return runner(*args, **kwargs)

    model.forward = decode
    return runner


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_generate_with_a_sliding_window_cache_as_an_argument_replays(family: str) -> None:
    """A StaticCache with sliding layers passed to the runner (``generate`` hands
    ``model.forward`` its cache): the runner keyed each call on the sliding layers'
    ``cumulative_length_int``, a Python int that changes every step, so every decode step after
    the capture was a miss, served eagerly (logged, but no graph ever replayed). The breaks read
    that int at every replay (``sliding_window.py``), so it is no part of the signature now:
    every decode step replays, across the window's filling, and the tokens and scores equal
    plain ``generate``'s, greedy and sampled."""
    prompt = torch.randint(4, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :3] = 0
    settings = {"do_sample": True, "top_k": 20, "output_scores": True}
    results = []
    for graphs in (False, True):
        model = _windowed(family)
        runner = graphed_forward(model) if graphs else None
        cache = transformers.StaticCache(config=model.config, max_cache_len=64)
        outs = []
        with torch.no_grad():
            for request in range(2):
                cache.reset()
                torch.manual_seed(request)
                outs.append(
                    model.generate(
                        prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=20,
                        min_new_tokens=20, return_dict_in_generate=True, pad_token_id=0,
                        **settings,
                    )
                )  # fmt: skip
        results.append((outs, runner))
    (eager, _), (graphed, runner) = results
    assert runner is not None
    for want, got in zip(eager, graphed, strict=True):
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores, strict=True):
            assert torch.equal(a, b)
    assert not runner.blocked_signatures, list(runner.blocked_signatures.values())
    assert runner.stats.misses == 0
    assert runner.stats.hits == 2 * 19  # every decode step of both requests
