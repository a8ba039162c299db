"""Adversarial checks of sliding-window StaticCache layers (and DynamicCache refusals) under
BreakableGraphRunner on the CPU graph backend: every replay ``torch.equal`` to eager on its own
cache, over many steps, through the ways a serving loop drives a runner."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import BreakableGraphRunner

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_transformers import (  # noqa: E402
    SMALL,
    WINDOW,
    _windowed,  # noqa: PLC2701
    refused_on_a_prefilled_dynamic_cache,
    saved_cache,
    sliding_positions,
)
from transformers.cache_utils import StaticSlidingWindowLayer  # noqa: E402

from bcg_core._integrations import sliding_window  # noqa: E402, PLC2701


def _prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _prefilled(model: Any, prompt: torch.Tensor, max_cache_len: int = 64) -> Any:
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return cache


def _step(model: Any, cache: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def decode(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits

    return decode


def _decode(
    runner: BreakableGraphRunner, model: Any, ids: torch.Tensor, reference: Any, steps: int
) -> torch.Tensor:
    """``steps`` greedy steps: the runner against eager on ``reference``, bitwise."""
    for step in range(steps):
        got = runner(ids)
        expected = model(input_ids=ids, past_key_values=reference, use_cache=True).logits
        assert torch.equal(got, expected), f"step {step}"
        ids = expected[:, -1:].argmax(-1)
    return ids


def _captured(
    model: Any,
    prompt: torch.Tensor,
    max_cache_len: int = 64,
    mode: Callable[[], Any] = torch.no_grad,
    **runner_kwargs: Any,
) -> tuple[BreakableGraphRunner, Any, Any]:
    """A runner with the decode step captured at the prompt's end (cache restored after)."""
    cache, reference = (
        _prefilled(model, prompt, max_cache_len),
        _prefilled(model, prompt, max_cache_len),
    )
    runner = BreakableGraphRunner(_step(model, cache), device="cpu", **runner_kwargs)
    with mode():
        restore = saved_cache(cache)
        runner.capture(prompt[:, -1:])
        restore()
    assert runner.blocked_signatures == {}
    return runner, cache, reference


def test_capture_many_batch_sizes_each_on_its_cache() -> None:
    """Two signatures (batch 1 and 3, prompts 6 and 9 long) on one runner, replayed in turn
    for 30 steps each, across the window."""
    model = _windowed("gemma2")
    prompts = {1: _prompt(1, 6), 3: _prompt(3, 9, seed=2)}
    caches = {b: _prefilled(model, p) for b, p in prompts.items()}
    references = {b: _prefilled(model, p) for b, p in prompts.items()}

    def decode(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(
            input_ids=ids, past_key_values=caches[ids.shape[0]], use_cache=True
        ).logits
        return logits

    runner = BreakableGraphRunner(decode, device="cpu")
    ids = {b: p[:, -1:] for b, p in prompts.items()}
    with torch.no_grad():
        restores = [saved_cache(c) for c in caches.values()]
        runner.capture_many([((ids[1],), {}), ((ids[3],), {})])
        for restore in restores:
            restore()
        assert len(runner.stats.entries) == 2 and runner.blocked_signatures == {}
        for step in range(30):
            for b in (1, 3):
                got = runner(ids[b])
                expected = model(input_ids=ids[b], past_key_values=references[b]).logits
                assert torch.equal(got, expected), f"batch {b}, step {step}"
                ids[b] = expected[:, -1:].argmax(-1)
    assert runner.stats.hits == 60
    assert sliding_positions(caches[3]) == sliding_positions(references[3]) == [39, 39]


@pytest.mark.parametrize(
    ("capture_mode", "replay_mode"),
    [
        (torch.inference_mode, torch.inference_mode),
        (torch.inference_mode, torch.no_grad),
        (torch.no_grad, torch.inference_mode),
    ],
)
def test_inference_mode_capture_and_replay(
    capture_mode: Callable[[], Any], replay_mode: Callable[[], Any]
) -> None:
    model = _windowed("mistral")
    runner, _, reference = _captured(model, _prompt(2, 6), mode=capture_mode)
    with replay_mode():
        _decode(runner, model, _prompt(2, 6)[:, -1:], reference, 30)


@pytest.mark.parametrize(("family", "length"), [("gemma3", 30), ("gemma2", 15), ("gemma2", 16)])
def test_capture_at_or_after_the_window_filling(family: str, length: int) -> None:
    """Captured one step before the window fills, as it fills, and long after: replays roll."""
    model = _windowed(family)
    prompt = _prompt(2, length)
    runner, cache, reference = _captured(model, prompt)
    _decode(runner, model, prompt[:, -1:], reference, 20)
    assert set(sliding_positions(cache)) == {length + 20}


@pytest.mark.parametrize(("family", "first", "second"), [("mistral", 6, 40), ("gemma2", 30, 3)])
def test_reset_and_prefill_of_another_length_then_replay(
    family: str, first: int, second: int
) -> None:
    """cache.reset() and a new prefill (longer than the window, or shorter after it rolled):
    the same graph goes on, reading the new position."""
    model = _windowed(family)
    prompt = _prompt(2, first)
    runner, cache, reference = _captured(model, prompt)
    with torch.no_grad():
        _decode(runner, model, prompt[:, -1:], reference, 15)
        again = _prompt(2, second, seed=5)
        for c in (cache, reference):
            c.reset()
            model(input_ids=again, past_key_values=c)
        _decode(runner, model, again[:, -1:], reference, 15)
    assert set(sliding_positions(cache)) == {second + 15}
    assert runner.stats.hits == 30


@pytest.mark.parametrize("warmups", [0, 1, 3])
def test_warmups_advance_the_cache_as_eager_steps(warmups: int) -> None:
    """Not restored after capture: the cache took warmups + 1 steps, as eager on the reference
    does; replays go on from there."""
    model = _windowed("gemma2")
    prompt = _prompt(2, 14)
    cache, reference = _prefilled(model, prompt), _prefilled(model, prompt)
    runner = BreakableGraphRunner(_step(model, cache), device="cpu", warmup_iters=warmups)
    ids = prompt[:, -1:]
    with torch.no_grad():
        runner.capture(ids)
        for _ in range(warmups + 1):
            model(input_ids=ids, past_key_values=reference)
        assert sliding_positions(cache) == sliding_positions(reference) == [15 + warmups] * 2
        _decode(runner, model, ids, reference, 20)
    assert runner.stats.entries[0].capture_runs == warmups + 1


def test_max_cache_len_below_the_window() -> None:
    """A StaticCache of 8 slots under a window of 16: the sliding layers hold 8 and roll."""
    model = _windowed("mistral")
    prompt = _prompt(2, 4)
    runner, cache, reference = _captured(model, prompt, max_cache_len=8)
    assert cache.layers[0].max_cache_len == 8
    _decode(runner, model, prompt[:, -1:], reference, 30)
    assert set(sliding_positions(cache)) == {34}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            lambda: transformers.Gemma2Config(
                **SMALL, head_dim=16, pad_token_id=0, sliding_window=WINDOW,
                layer_types=["full_attention", "sliding_attention", "full_attention"],
            ),
            id="gemma2-full-first",
        ),
        pytest.param(
            lambda: transformers.Qwen2Config(
                **SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
            ),
            id="qwen2-full-first",
        ),
    ],
)  # fmt: skip
def test_mixed_layers_with_a_full_layer_first(config: Callable[[], Any]) -> None:
    """Layer 0 full: the model's positions come from the full layer's tensor, the sliding
    mask's offsets from the first sliding layer's break."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config(), attn_implementation=bcg_core.breakable_attention("sdpa"), dtype=torch.float32
    ).eval()
    prompt = _prompt(2, 6)
    runner, cache, reference = _captured(model, prompt)
    assert not cache.layers[0].is_sliding and cache.layers[1].is_sliding
    _decode(runner, model, prompt[:, -1:], reference, 30)


def test_two_runners_in_two_threads_and_interleaved() -> None:
    jobs = []
    for family, seed in (("mistral", 1), ("gemma2", 2)):
        model = _windowed(family)
        prompt = _prompt(2, 6, seed)
        runner, _, reference = _captured(model, prompt)
        jobs.append((runner, model, prompt[:, -1:], reference))
    errors: list[BaseException] = []

    def run(job: tuple[Any, ...]) -> None:
        try:
            with torch.no_grad():
                _decode(*job, 40)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # the same two runners, interleaved step by step in one thread
    ids = [job[2] for job in jobs]
    with torch.no_grad():
        for _ in range(15):
            for k, (runner, model, _, reference) in enumerate(jobs):
                ids[k] = _decode(runner, model, ids[k], reference, 1)


def test_disabled_and_flagged_eager_steps_between_replays() -> None:
    """disable_breakable_graphs() mid-decode (eager steps move the Python int), an eager step
    under the flag outside the runner, a several-token step served eagerly (a miss): replays
    then go on from the live position."""
    model = _windowed("gemma2")
    prompt = _prompt(2, 6)
    runner, cache, reference = _captured(model, prompt, max_cache_len=128)
    with torch.no_grad():
        ids = _decode(runner, model, prompt[:, -1:], reference, 5)
        with bcg_core.disable_breakable_graphs():
            ids = _decode(runner, model, ids, reference, 15)
        ids = _decode(runner, model, ids, reference, 10)
        with bcg_core.enable_breakable_cuda_graph():
            for _ in range(3):
                got = model(input_ids=ids, past_key_values=cache).logits
                expected = model(input_ids=ids, past_key_values=reference).logits
                assert torch.equal(got, expected)
                ids = expected[:, -1:].argmax(-1)
        ids = _decode(runner, model, ids, reference, 10)
        chunk = _prompt(2, 4, seed=9)
        got = runner(chunk)
        expected = model(input_ids=chunk, past_key_values=reference).logits
        assert torch.equal(got, expected)
        _decode(runner, model, expected[:, -1:].argmax(-1), reference, 10)
    assert runner.blocked_signatures == {}
    assert sliding_positions(cache) == sliding_positions(reference) == [63, 63]


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "qwen2_moe"])
def test_several_token_steps_under_the_flag_equal_transformers(family: str) -> None:
    """Outside a capture, under the flag, steps of several tokens (before, across and past the
    window) give what transformers gives without bcg."""
    model = _windowed(family)
    prompt = _prompt(2, 10)
    plain, flagged = _prefilled(model, prompt), _prefilled(model, prompt)
    with torch.no_grad():
        for n in (10, 3, 1, 20):
            ids = _prompt(2, n, seed=n)
            expected = model(input_ids=ids, past_key_values=plain).logits
            with bcg_core.enable_breakable_cuda_graph():
                got = model(input_ids=ids, past_key_values=flagged).logits
            assert torch.equal(got, expected), n
    assert sliding_positions(plain) == sliding_positions(flagged)


def test_divergence_check_after_a_several_token_step_under_the_flag() -> None:
    """A step of several tokens under the flag read the sliding position (an eager offsets
    entry at position 5) and its update did not drop it; after a reset and a prefill back to
    position 5, the eager run reused it, skipped the position break a replay makes, and the
    check reported a divergence that was not there."""
    model = _windowed("mistral")
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    prompt = _prompt(1, 5, seed=2)

    def at_five(token: int, chunk_first: bool) -> Callable[[], tuple[torch.Tensor]]:
        def load() -> tuple[torch.Tensor]:
            cache.reset()
            model(input_ids=prompt, past_key_values=cache)
            if chunk_first:
                with bcg_core.enable_breakable_cuda_graph():
                    model(input_ids=prompt[:, :3], past_key_values=cache)
                cache.reset()
                model(input_ids=prompt, past_key_values=cache)
            return (torch.tensor([[token]]),)

        return load

    with torch.no_grad():
        report = bcg_core.check_divergence(
            _step(model, cache), [at_five(3, False), at_five(4, True), at_five(5, False)]
        )
    assert report.ok, str(report)
    assert not sliding_window._offsets_read


def test_the_class_patch_is_transparent_outside_the_flag() -> None:
    """StaticSlidingWindowLayer's methods under bcg's patch: transformers' names, docs and
    signatures, and outside the flag the same results and cache state as the originals."""
    bcg_core.breakable_attention("sdpa")
    originals = sliding_window._originals
    for name in ("update", "get_seq_length", "get_mask_sizes"):
        patched = getattr(StaticSlidingWindowLayer, name)
        assert patched is not originals[name]
        assert patched.__name__ == name and patched.__doc__ == originals[name].__doc__
        assert inspect.signature(patched) == inspect.signature(originals[name])
    layers = [StaticSlidingWindowLayer(max_cache_len=8, sliding_window=4) for _ in range(2)]
    states = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    for n in (3, 1, 1, 2, 1):
        k, v = states[:, :, :n], states[:, :, :n] * 2
        a = layers[0].update(k, v)
        b = originals["update"](layers[1], k, v)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert layers[0].get_seq_length() == originals["get_seq_length"](layers[1])
        assert type(layers[0].get_seq_length()) is int
        for q in (1, 2):
            assert layers[0].get_mask_sizes(q) == originals["get_mask_sizes"](layers[1], q)
    assert torch.equal(layers[0].keys, layers[1].keys)
    assert torch.equal(layers[0].cumulative_length, layers[1].cumulative_length)


def test_llama_on_a_dynamic_cache_is_refused_and_served_eagerly() -> None:
    """A full-attention model decoding on a prefilled DynamicCache: the capture was accepted
    and every replay from the second attended to the capture's context (logits off by 0.08,
    no error). Now refused by name; the runner serves it eagerly, equal to eager."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SMALL), attn_implementation=bcg_core.breakable_attention("sdpa"),
        dtype=torch.float32,
    ).eval()  # fmt: skip
    refused_on_a_prefilled_dynamic_cache(model, steps=5)


def test_a_dynamic_cache_made_inside_the_step_is_still_captured() -> None:
    """A step that makes its own DynamicCache (``model(input_ids)`` with use_cache on, then
    one more token on it): every cache tensor is the graph's own, so it is captured and
    replays equal eager."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SMALL), attn_implementation=bcg_core.breakable_attention("sdpa"),
        dtype=torch.float32,
    ).eval()  # fmt: skip

    def step(ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids)
        more = out.logits[:, -1:].argmax(-1)
        logits: torch.Tensor = model(input_ids=more, past_key_values=out.past_key_values).logits
        return logits

    runner = BreakableGraphRunner(step, device="cpu")
    with torch.no_grad():
        runner.capture(_prompt(1, 5))
        assert runner.blocked_signatures == {} and len(runner.stats.entries) == 1
        for seed in range(3):
            ids = _prompt(1, 5, seed=seed + 10)
            assert torch.equal(runner(ids), step(ids))
    assert runner.stats.hits == 3


def test_an_empty_dynamic_cache_made_before_the_capture_is_refused() -> None:
    """A DynamicCache made once, empty, and passed to every call, captured with no warm-up:
    eager's second call finds the tokens the first added, every replay would find it empty.
    Refused by name (was: captured, replays as if the cache were new)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SMALL), attn_implementation=bcg_core.breakable_attention("sdpa"),
        dtype=torch.float32,
    ).eval()  # fmt: skip
    cache, reference = transformers.DynamicCache(), transformers.DynamicCache()

    def step(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache).logits
        return logits

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    with torch.no_grad():
        ids = _prompt(1, 1)
        got = runner.capture(ids)
        (why,) = runner.blocked_signatures.values()
        assert "DynamicCache made before the capture" in why
        assert torch.equal(got, model(input_ids=ids, past_key_values=reference).logits)
        for seed in range(3):
            ids = _prompt(1, 1, seed=seed + 20)
            expected = model(input_ids=ids, past_key_values=reference).logits
            assert torch.equal(runner(ids), expected)
