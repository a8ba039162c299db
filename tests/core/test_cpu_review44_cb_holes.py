"""Continuous-batching holes (review 44), on the CPU graph backend: transformers' own engine
(``generate_batch``) with bcg's paged attention as the break. Tiny random-weight models,
float32; the model, prompts, configs and the one stub (the engine's free-memory query) are
those of ``test_cpu_continuous_batching.py``.

- An engine asked to compile its step (``ContinuousBatchingConfig.varlen_compile_config`` /
  ``decode_compile_config``) ran it uncompiled
  through bcg's graphs without a word: the setting was dropped silently.
- Where flash attention is installed, transformers' engine swaps an ``sdpa``/``eager`` model to
  ``paged|flash_attention_*`` when it starts (``switch_to_cb_friendly_attn``): an enabled
  model, loaded with ``attn_implementation="sdpa"`` as bcg asks, then failed every request
  (bcg refuses the flash paths) with an error telling the user to load it with sdpa.
- ``manager.stop()`` (not kept for the next session) gives the model its own attention back;
  ``manager.start()`` again then ran on plain ``sdpa``: bcg failed every request with an error
  telling the user to load the model with sdpa (transformers' own engine, without bcg,
  silently generates other tokens there).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

import bcg_core
from bcg_core._integrations import continuous_batching as cb  # noqa: PLC2701

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_continuous_batching import (  # noqa: E402
    _cpu_memory,  # noqa: F401, PLC2701 (the autouse fixture: the free-memory query)
    configs,
    make_model,
    prompts,
)
from transformers.generation.continuous_batching import continuous_api  # noqa: E402


def generate(model: Any, **cb_settings: Any) -> dict[str, list[int]]:
    """``generate_batch``'s greedy tokens by request id, the engine's config updated with
    ``cb_settings``."""
    gen, cb = configs()
    for name, value in cb_settings.items():
        setattr(cb, name, value)
    out = model.generate_batch(prompts(), generation_config=gen, continuous_batching_config=cb)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def test_a_compile_config_the_engine_does_not_use_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """bcg runs transformers' step uncompiled (its graphs are the speed-up): a compile config
    given to the engine is named in a warning, and the tokens are still the eager engine's."""
    model = make_model()
    compiled = {"varlen_compile_config": transformers.CompileConfig(backend="eager")}
    eager = generate(model)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        with bcg_core.enable_continuous_batching(model) as handle:
            graphed = generate(model, **compiled)
            stats = handle.stats()
        warned = [r.getMessage() for r in caplog.records if r.name == "bcg_core"]
    assert graphed == eager
    assert stats.graphs >= 1 and stats.eager_calls == 0
    assert any("varlen_compile_config" in message for message in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        with bcg_core.enable_continuous_batching(model):
            assert generate(model) == eager
        assert not [r for r in caplog.records if "compile" in r.getMessage()]


def test_an_enabled_model_keeps_its_attention_where_flash_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With flash attention available (only the availability query is stubbed: the CPU has no
    flash kernel), an enabled sdpa model stays on ``paged|sdpa``, bcg's break: its tokens equal
    the eager engine's, its batches are graphed, and the model gets ``sdpa`` back at the end."""
    model = make_model()
    eager = generate(model)
    seen: list[str] = []
    compute = continuous_api.ContinuousBatchProcessor._generation_step

    def step(processor: Any, model: Any) -> Any:
        seen.append(model.config._attn_implementation)
        return compute(processor, model)

    monkeypatch.setattr(continuous_api.ContinuousBatchProcessor, "_generation_step", step)
    monkeypatch.setattr(continuous_api, "is_flash_attn_3_available", lambda **_: True)
    with bcg_core.enable_continuous_batching(model) as handle:
        graphed = generate(model)
        stats = handle.stats()
    assert graphed == eager
    assert set(seen) == {"paged|sdpa"}
    assert stats.graphs >= 1 and stats.replays > 0 and stats.eager_calls == 0
    assert model.config._attn_implementation == "sdpa"
    assert not cb._enabled  # nothing left enabled


def test_a_manager_started_again_after_stop_serves_its_paged_attention() -> None:
    """A manager stopped (not kept) and started again: its new engine puts the model back on
    its paged attention, as the first start did, and serves the tokens of the first run."""
    model = make_model()
    gen, cb_config = configs()
    with bcg_core.enable_continuous_batching(model) as handle:
        manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cb_config
        )
        runs = []
        for _ in range(2):
            manager.start()
            for i, p in enumerate(prompts()):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=gen.max_new_tokens)
            results = {}
            while len(results) < len(prompts()):
                out = manager.get_result(timeout=60)
                assert out is not None, "the engine stopped before every request finished"
                results[out.request_id] = (list(out.generated_tokens), out.status.name)
            manager.stop(block=True)
            assert model.config._attn_implementation == "sdpa"  # given back at stop()
            runs.append(results)
        stats = handle.stats()
    assert runs[1] == runs[0]
    assert {status for _, status in runs[1].values()} == {"FINISHED"}
    assert stats.eager_calls == 0 and stats.replays > 0
