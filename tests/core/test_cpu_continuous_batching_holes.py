"""Holes of the continuous-batching integration, on the CPU graph backend (a tiny Llama with
random weights, greedy unless said, float32):

- ``disable_breakable_graphs()`` around ``generate_batch`` must reach the engine's own thread
  (a context variable does not cross threads by itself): every batch eager, none captured.
- An engine that outlives its handle must stop reporting to it: once the model is enabled
  again, its batches count on (and follow the settings of) the new handle; while the model is
  not enabled they run transformers' code; a removed handle's stats no longer change.
- The engine's warm-up (its largest bucket, captured at once) must capture when sampling: its
  made-up request reads cache rows nothing wrote, NaN logits failed ``torch.multinomial``.

The model, prompts, configs and the one stub (the engine's free-memory query) are those of
``test_cpu_continuous_batching.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import bcg_core

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_continuous_batching import (  # noqa: E402
    NEW_TOKENS,
    PROMPT_LENGTHS,
    _cpu_memory,  # noqa: F401, PLC2701 (the autouse fixture: the free-memory query)
    configs,
    make_model,
    prompts,
)
from test_cpu_continuous_batching import generate as generate_by_id  # noqa: E402
from transformers.generation.continuous_batching import model_runner  # noqa: E402
from transformers.generation.continuous_batching.cache import PagedAttentionCache  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    ContinuousBatchingIOs,
)


def generate(model: Any) -> list[list[int]]:
    """``generate_batch``'s greedy tokens, in prompt order."""
    out = generate_by_id(model)
    return [out[rid] for rid in sorted(out, key=_index)]


def _index(request_id: str) -> int:
    return int(request_id.rsplit("_", 1)[-1])


def serve(manager: Any, tag: str) -> list[list[int]]:
    """Every prompt through a running engine; the greedy tokens in prompt order."""
    for i, p in enumerate(prompts()):
        manager.add_request(p, request_id=f"{tag}_{i}", max_new_tokens=NEW_TOKENS)
    results: dict[str, list[int]] = {}
    while len(results) < len(PROMPT_LENGTHS):
        out = manager.get_result(timeout=60)
        assert out is not None, "the engine stopped before every request finished"
        results[out.request_id] = list(out.generated_tokens)
    return [results[f"{tag}_{i}"] for i in range(len(PROMPT_LENGTHS))]


@pytest.fixture
def engine() -> Iterator[tuple[Any, Any]]:
    """``make_model()`` and a long-lived engine for it (``init_continuous_batching``), not yet
    started; stopped at the end."""
    model = make_model()
    gen, cb = configs()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    yield model, manager
    manager.stop(block=True)


class Buckets:
    """The query bucket of every batch the engines prepare (an observer, called through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[int] = []
        original = ContinuousBatchingIOs.prepare_batch_tensors

        def prepare(io: Any, *args: Any, **kwargs: Any) -> None:
            original(io, *args, **kwargs)
            self.seen.append(int(io.num_q_tokens))

        monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", prepare)


# -- disable_breakable_graphs() reaches the engine's thread -------------------------------------


def test_disable_breakable_graphs_runs_generate_batch_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside ``disable_breakable_graphs()`` every batch of ``generate_batch`` (warm-up and
    serving, on the engine's thread) runs eagerly; the next call outside it graphs again."""
    model = make_model()
    eager = generate(model)
    buckets = Buckets(monkeypatch)
    with bcg_core.enable_continuous_batching(model) as handle:
        with bcg_core.disable_breakable_graphs():
            disabled = generate(model)
        inside = handle.stats()
        batches = len(buckets.seen)
        graphed = generate(model)
        after = handle.stats()
    assert disabled == eager and graphed == eager
    assert batches > len(PROMPT_LENGTHS)
    assert (inside.graphs, inside.replays, inside.first_batches) == (0, 0, 0)
    assert inside.eager_calls == batches  # every batch, the warm-up's included
    # Outside the block the engine graphs as usual, and nothing more runs eagerly.
    assert after.graphs >= 2 and after.replays > 0
    assert after.eager_calls == inside.eager_calls


# -- a long-lived engine follows the model's current handle -------------------------------------


def test_reenabled_model_reports_to_the_new_handle(
    engine: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ``h1.remove()`` and a new ``enable_continuous_batching(capture_after=0)``, the
    running engine's batches count on the new handle and follow its ``capture_after`` (every
    bucket captured on its first batch); the removed handle's stats stay as they were."""
    eager = generate(make_model())
    model, manager = engine
    h1 = bcg_core.enable_continuous_batching(model)
    manager.start()
    assert serve(manager, "a") == eager
    h1.remove()
    frozen = h1.stats()
    assert frozen.graphs >= 1 and frozen.replays > 0
    buckets = Buckets(monkeypatch)
    with bcg_core.enable_continuous_batching(model, capture_after=0) as h2:
        assert serve(manager, "b") == eager
        stats = h2.stats()
    assert h1.stats() == frozen
    assert stats.first_batches == 0 and stats.eager_calls == 0
    assert stats.graphs == len(set(buckets.seen)) and stats.graphs >= 2
    assert stats.replays == len(buckets.seen) - stats.graphs


def test_engine_of_a_removed_model_runs_transformers_code(engine: tuple[Any, Any]) -> None:
    """While the model is not enabled (the patches held by another model's handle) its running
    engine runs transformers' code with transformers' own padding setting, and counts
    nowhere; enabled again, it graphs for the new handle."""
    eager = generate(make_model())
    model, manager = engine
    with bcg_core.enable_continuous_batching(make_model()) as other:
        h1 = bcg_core.enable_continuous_batching(model)
        manager.start()
        assert serve(manager, "a") == eager
        runner = manager.batch_processor.model_runner
        assert runner.pad_inputs  # bcg's query-padded batches
        h1.remove()
        frozen = h1.stats()
        assert not runner.pad_inputs  # transformers' own setting (no CUDA graphs, no compile)
        assert serve(manager, "b") == eager
        assert h1.stats() == frozen
        with bcg_core.enable_continuous_batching(model) as h3:
            assert serve(manager, "c") == eager
            again = h3.stats()
        assert other.stats().graphs == 0
    assert again.graphs >= 1 and again.replays > 0


def test_removed_handle_stats_stop_changing() -> None:
    """Two handles share the model's counters; once one is removed its stats are frozen, while
    the other keeps counting."""
    model = make_model()
    first = bcg_core.enable_continuous_batching(model)
    with bcg_core.enable_continuous_batching(model) as second:
        generate(model)
        first.remove()
        frozen = first.stats()
        generate(model)
        assert first.stats() == frozen
        assert second.stats().replays > frozen.replays


# -- two engines of one model on two threads ----------------------------------------------------


def test_two_engines_of_one_model_count_every_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines of the model at once, one started inside ``disable_breakable_graphs()``:
    every batch counts once (graph, replay, eager call or first batch). A replay was told
    from an eager run by the model's shared eager count moving meanwhile, so the other
    engine's eager batches turned this one's replays into nothing."""
    # Paged already: an engine that switches a model to paged attention switches it back when
    # it ends, under the other engine still running (transformers' own race, bcg or not: the
    # other's next forward then ran plain sdpa over the paged batch and failed).
    model = make_model("paged|sdpa")
    eager = generate(model)
    buckets = Buckets(monkeypatch)
    results: dict[str, list[list[int]]] = {}

    def run(disabled: bool) -> None:
        with bcg_core.disable_breakable_graphs() if disabled else contextlib.nullcontext():
            results[f"{disabled}"] = generate(model)

    with bcg_core.enable_continuous_batching(model, capture_after=0) as handle:
        for _ in range(2):
            threads = [threading.Thread(target=run, args=(d,)) for d in (False, True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert results == {"False": eager, "True": eager}
        s = handle.stats()
    assert s.graphs + s.replays + s.eager_calls + s.first_batches == len(buckets.seen)
    assert s.replays > 0 and s.eager_calls > 0


# -- the warm-up reads cache rows nothing wrote --------------------------------------------------


@pytest.fixture
def unwritten_cache_is_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged cache is ``torch.empty``: make its allocatable rows NaN, so what a read of
    never-written rows gives does not depend on the allocator's leftovers. The two padding
    blocks are kept as transformers sets them (the read trash zeroed)."""
    original = PagedAttentionCache.__init__

    def init(cache: Any, *args: Any, **kwargs: Any) -> None:
        original(cache, *args, **kwargs)
        rows = cache.num_blocks * cache.block_size
        for layer in (*cache.key_cache, *cache.value_cache):
            layer[:rows].fill_(float("nan"))

    monkeypatch.setattr(PagedAttentionCache, "__init__", init)


def sample(model: Any) -> list[list[int]]:
    """``generate_batch`` sampling (temperature, top-k), seeded; tokens in prompt order."""
    _, cb = configs()
    gen = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.7, top_k=20,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    out = model.generate_batch(prompts(), generation_config=gen, continuous_batching_config=cb)
    return [list(out[rid].generated_tokens) for rid in sorted(out, key=_index)]


@pytest.mark.usefixtures("unwritten_cache_is_nan")
def test_sampling_warmup_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' warm-up batch (which bcg's engine runs, capturing the largest bucket) is a
    made-up request said to have nearly the whole cache already written: its attention read
    the cache's leftover bytes, NaN logits, and ``torch.multinomial`` failed the capture, so
    that bucket ran eagerly for the engine's life. bcg zeroes the rows the warm-up reads: the
    bucket is captured, later batches replay, nothing runs eagerly."""
    model = make_model()
    warmups = []
    original = model_runner.ModelRunner.run_one_warmup

    def run_one_warmup(runner: Any, *args: Any, **kwargs: Any) -> float:
        duration = original(runner, *args, **kwargs)
        warmups.append(duration)  # 0.0: transformers caught a failure (and logged it)
        return duration  # type: ignore[no-any-return]

    monkeypatch.setattr(model_runner.ModelRunner, "run_one_warmup", run_one_warmup)
    eager = sample(model)  # no warm-up (transformers warms up padded engines only)
    assert not warmups
    # Real batches read only rows they wrote: the eager engine samples on the NaN cache.
    assert [len(tokens) for tokens in eager] == [NEW_TOKENS] * len(PROMPT_LENGTHS)
    buckets = Buckets(monkeypatch)
    with bcg_core.enable_continuous_batching(model) as handle:
        sampled = sample(model)
        stats = handle.stats()
    assert len(warmups) == 1 and warmups[0] > 0
    assert [len(tokens) for tokens in sampled] == [NEW_TOKENS] * len(PROMPT_LENGTHS)
    assert all(0 <= t < model.config.vocab_size for tokens in sampled for t in tokens)
    assert stats.eager_calls == 0
    assert buckets.seen[0] == max(buckets.seen)  # the warm-up's bucket, captured at once
    assert stats.graphs >= 2 and stats.replays > 0
    assert stats.graphs + stats.replays + stats.first_batches == len(buckets.seen)


@pytest.mark.usefixtures("unwritten_cache_is_nan")
def test_greedy_tokens_equal_eager_on_an_unwritten_cache() -> None:
    """Zeroing the warm-up's rows changes nothing a real batch reads: greedy tokens equal the
    eager engine's, every batch graphed or replayed."""
    model = make_model()
    eager = generate(model)
    with bcg_core.enable_continuous_batching(model) as handle:
        assert generate(model) == eager
        stats = handle.stats()
    assert stats.eager_calls == 0 and stats.graphs >= 2 and stats.replays > 0
