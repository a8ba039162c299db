"""Holes found driving transformers' ``generate()`` through bcg, as a serving engine does, on the
CPU graph backend with tiny random-weight models: the decode steps of ``model.generate`` with a
StaticCache go through a :class:`BreakableGraphRunner` over ``model.forward`` (the cache is an
argument, so one runner serves every request's cache, each batch size its own graph), and every
result equals plain transformers'."""

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
from test_cpu_transformers import _model, _windowed, saved_cache  # noqa: E402, PLC2701


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


def closure_graphed(model: Any, cache: Any) -> BreakableGraphRunner:
    """The README's recipe inside ``generate``: a runner over a step that closes over
    ``cache``, captured at the first decode step (the cache saved and put back around it);
    ``model``'s one-token forwards on that cache replay it."""
    forward = model.forward

    def step(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = forward(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
            logits_to_keep=1,
        )  # fmt: skip
        logits: torch.Tensor = out.logits
        return logits

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=1)

    @functools.wraps(forward)
    def decode(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[1] != 1 or kwargs["past_key_values"] is not cache:
            return forward(*args, **kwargs)
        call = (kwargs["input_ids"], kwargs["attention_mask"])
        if not runner.stats.entries:
            restore = saved_cache(cache)
            runner.capture(*call)
            restore()
        logits = runner(*call)
        return transformers.modeling_outputs.CausalLMOutputWithPast(
            logits=logits, past_key_values=cache
        )

    model.forward = decode
    return runner


def assert_beam_search_graphed_equals_plain(
    make_model: Callable[[], Any], new_tokens: int, beams: int
) -> None:
    """``generate(num_beams=beams)`` over a StaticCache three ways (plain, the README's recipe
    closing over the cache, a runner over ``model.forward`` with the cache an argument):
    sequences and scores bitwise equal, every decode step after the first a replay."""
    prompt = torch.randint(4, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    results = []
    for graphs in ("", "closure", "argument"):
        model = make_model()
        cache = transformers.StaticCache(config=model.config, max_cache_len=48)
        runner = None
        if graphs == "closure":
            runner = closure_graphed(model, cache)
        elif graphs == "argument":
            runner = graphed_forward(model)
        with torch.no_grad():
            out = model.generate(
                prompt, past_key_values=cache, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, num_beams=beams, do_sample=False, output_scores=True,
                return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        results.append((out, runner))
    (want, _), *graphed = results
    for got, runner in graphed:
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores, strict=True):
            assert torch.equal(a, b)
        assert runner is not None
        assert not runner.blocked_signatures, list(runner.blocked_signatures.values())
        assert (runner.stats.hits, runner.stats.misses) == (new_tokens - 1, 0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_beam_search_through_a_graph_over_a_static_cache_equals_plain_generate(
    family: str,
) -> None:
    """``generate(num_beams=3)`` reorders the StaticCache after every step, and transformers'
    ``StaticLayer.reorder_cache`` rebinds ``layer.keys``/``values`` to new tensors: the graph,
    captured over the old ones, attended to a stale cache at every later replay, silently
    (beams and scores differed from plain generate). The reorder now writes its result back into
    the cache's own tensors, so replays equal plain generate; a cache passed to a runner as an
    argument (a miss at every step, the rebound tensor's new address) replays too."""
    name = bcg_core.breakable_attention("sdpa")
    assert_beam_search_graphed_equals_plain(
        lambda: _windowed(family) if family == "gemma3" else _model(family, name), 12, 3
    )
