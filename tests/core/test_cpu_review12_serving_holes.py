"""Serving holes (review 12), on the CPU graph backend: transformers' continuous batching and
the runner as an engine uses it. Tiny models with random weights built from configs, float32;
the model, prompts, configs and the one stub (the engine's free-memory query) are those of
``test_cpu_continuous_batching.py``.

- A model with sliding and full layers (Gemma 2, or any ``layer_types`` mix) has one mask per
  layer type: the break handed every layer the dict of both, and sdpa raised ``attn_mask must
  be Tensor, not dict`` in the engine's thread, failing every request.
- A bucket captured on a live batch runs the step on it more than once (warm-up, capture, an
  eager run if the capture fails); a sliding layer's cache update overwrites window rows it
  has just read, so every run after the first read the previous run's keys.
- A handle removed while the engine's thread prepared a batch with bcg's padding flipped the
  runner's padding rule back under it: the engine read the other rule for the same batch, and
  the cache update raised ``IndexError`` (every request failed).
"""

from __future__ import annotations

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
from transformers.generation.continuous_batching import model_runner  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    ContinuousBatchingIOs,
)


def sliding_model() -> Any:
    """A tiny Gemma 2: a sliding-window layer (window 8) then a full one."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=8,
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention"]
    model = transformers.Gemma2ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def generate(model: Any) -> list[list[int]]:
    """``generate_batch``'s greedy tokens, in prompt order (a failed request has none)."""
    gen, cb = configs()
    out = model.generate_batch(prompts(), generation_config=gen, continuous_batching_config=cb)
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(PROMPT_LENGTHS))]


# -- continuous batching: a model with sliding and full layers ----------------------------------


def test_a_model_with_sliding_and_full_layers_gives_each_layer_its_mask() -> None:
    """Each layer's break gets its own layer type's mask at the batch's true size, as the eager
    engine gives it (``capture_after=0``: every batch is a capture or a replay); tokens equal
    eager's."""
    model = sliding_model()
    eager = generate(model)
    assert [len(tokens) for tokens in eager] == [NEW_TOKENS] * len(PROMPT_LENGTHS)
    with bcg_core.enable_continuous_batching(model, capture_after=0) as handle:
        graphed = generate(model)
        stats = handle.stats()
    assert graphed == eager
    assert stats.graphs >= 2 and stats.replays > 0 and stats.eager_calls == 0


def test_a_sliding_window_batch_captured_live_equals_eager() -> None:
    """A bucket captured on its recurring batch (``capture_after=1``, the default) runs the step
    on that live batch twice (warm-up, capture); a sliding layer's cache update reads window rows
    before writing over them, so the capture read what its warm-up wrote: that batch's logits
    and the cache rows later layers wrote went wrong (a request's tokens parted from eager's).
    bcg puts back the rows the batch writes after each warm-up."""
    model = sliding_model()
    eager = generate(model)
    with bcg_core.enable_continuous_batching(model) as handle:
        graphed = generate(model)
        stats = handle.stats()
    assert graphed == eager
    assert stats.graphs >= 2 and stats.first_batches > 0 and stats.eager_calls == 0


def test_a_live_batch_whose_capture_fails_runs_eagerly_on_its_cache() -> None:
    """A capture that fails on a live batch (a host read in a forward hook) serves the batch
    eagerly, after the warm-up and the capture ran the step on it: that eager run starts from
    the cache as it was, and tokens equal eager's."""
    model = sliding_model()
    eager = generate(model)
    model.model.norm.register_forward_hook(lambda m, args, out: out.sum().item() and None)
    with bcg_core.enable_continuous_batching(model) as handle:
        graphed = generate(model)
        stats = handle.stats()
    assert graphed == eager
    assert stats.graphs == 0 and stats.eager_calls > 0


# -- continuous batching: a handle removed while the engine runs ------------------------------


def test_a_handle_removed_while_a_batch_is_prepared_leaves_that_batch_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handle is removed on the engine's thread right after it prepared a batch that bcg
    padded (a decode batch: fewer tokens than its bucket), before its forward: that batch and
    the rest run transformers' code, every request finishes, tokens equal eager's; the runner
    is back on transformers' padding rule and transformers' methods are restored afterwards."""
    model = make_model()
    eager = generate(model)
    compute = vars(model_runner.ModelRunner)["compute_batch"]
    handle = bcg_core.enable_continuous_batching(model)
    original = ContinuousBatchingIOs.prepare_batch_tensors
    runners: list[Any] = []

    def prepare(io: Any, *args: Any, **kwargs: Any) -> None:
        original(io, *args, **kwargs)
        if handle.active and io.num_q_tokens > io.total_seqlen_q:  # padded by bcg
            handle.remove()

    forward = model_runner.ModelRunner._forward_process_and_sample

    def forward_process_and_sample(runner: Any, *args: Any, **kwargs: Any) -> None:
        runners.append(runner)
        forward(runner, *args, **kwargs)

    monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", prepare)
    monkeypatch.setattr(
        model_runner.ModelRunner, "_forward_process_and_sample", forward_process_and_sample
    )
    try:
        assert generate(model) == eager
    finally:
        handle.remove()
    stats = handle.stats()
    assert stats.graphs >= 1 and stats.replays > 0  # bcg served the batches before
    assert runners and not runners[-1].pad_inputs
    assert vars(model_runner.ModelRunner)["compute_batch"] is compute
