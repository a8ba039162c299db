"""transformers' continuous batching (``generate_batch``) through bcg on the CPU graph backend:
a tiny Llama with random weights, several requests of different prompt lengths, greedy. Batches
mix prefill chunks and decode tokens; bcg's tokens must equal the eager engine's token for token.

The engine sizes its cache from free device memory, which a CPU has none of: the cache gets
explicit ``num_blocks`` and ``max_batch_tokens``, and only the memory query is stubbed (the
attention is transformers' own, always).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import bcg_core
from bcg_core._integrations import continuous_batching as cb  # noqa: PLC2701

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from transformers.generation.continuous_batching import model_runner  # noqa: E402
from transformers.generation.continuous_batching.cache import (  # noqa: E402
    PagedAttentionCache,
    PagedAttentionMemoryHandler,
)
from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    ContinuousBatchingIOs,
)
from transformers.modeling_utils import AttentionInterface  # noqa: E402

PROMPT_LENGTHS = (5, 17, 9, 30, 3, 12)
NEW_TOKENS = 10


@pytest.fixture(autouse=True)
def _cpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the free-memory query: on a CPU it reports 0 bytes, and the cache refuses to exist.
    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)


def make_model(attention: str = "sdpa", device: str = "cpu") -> Any:
    """A tiny Llama (random weights, float32) with ``attention`` on ``device``."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    model.set_attn_implementation(attention)
    return model


def prompts() -> list[list[int]]:
    """The prompts, of ``PROMPT_LENGTHS`` tokens each."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def configs(interval: int = 8, max_batch_tokens: int = 32) -> tuple[Any, Any]:
    """The greedy generation config and the engine's config (query padding ``interval``)."""
    gen = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    cb = transformers.ContinuousBatchingConfig(
        num_blocks=32, block_size=16, max_batch_tokens=max_batch_tokens,
        q_padding_interval_size=interval, use_async_batching=False, use_cuda_graph=False,
    )  # fmt: skip
    return gen, cb


def generate(model: Any, interval: int = 8, max_batch_tokens: int = 32) -> dict[str, list[int]]:
    gen, cb = configs(interval, max_batch_tokens)
    out = model.generate_batch(prompts(), generation_config=gen, continuous_batching_config=cb)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


class Batches:
    """Records each batch the engine prepares, and which were its warm-up's (an observer: calls
    through unchanged)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[int, int, int]] = []  # (query bucket, true queries, keys read)
        self.warmup: set[int] = set()  # indices into seen
        self._warming = False
        original = ContinuousBatchingIOs.prepare_batch_tensors
        warmup = model_runner.ModelRunner.run_one_warmup

        def prepare(io: Any, *args: Any, **kwargs: Any) -> None:
            original(io, *args, **kwargs)
            if self._warming:
                self.warmup.add(len(self.seen))
            self.seen.append(
                (io.num_q_tokens, io.total_seqlen_q, int(sum(io.total_seqlen_k.values())))
            )

        def run_one_warmup(runner: Any, *args: Any, **kwargs: Any) -> float:
            self._warming = True
            try:
                return warmup(runner, *args, **kwargs)  # type: ignore[no-any-return]
            finally:
                self._warming = False

        monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", prepare)
        monkeypatch.setattr(model_runner.ModelRunner, "run_one_warmup", run_one_warmup)

    def expected(self, capture_after: int) -> tuple[int, int, int]:
        """(graphs, first batches, replays) the recurrence rule gives for these batches: a
        bucket is captured by a warm-up batch or by its batch number ``capture_after + 1``."""
        captured: set[int] = set()
        served: dict[int, int] = {}
        first = replays = 0
        for i, (bucket, _, _) in enumerate(self.seen):
            if bucket in captured:
                replays += 1
            elif i in self.warmup or served.get(bucket, 0) >= capture_after:
                captured.add(bucket)
            else:
                served[bucket] = served.get(bucket, 0) + 1
                first += 1
        return len(captured), first, replays


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_mixed_batches_equal_eager_token_for_token(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_against_eager(make_model(attention), monkeypatch)


def check_against_eager(
    model: Any, monkeypatch: pytest.MonkeyPatch, capture_after: int = 1
) -> None:
    """bcg's tokens equal the eager engine's, with at most one graph per query bucket (none per
    KV length): the warm-up's bucket and each bucket that recurs past ``capture_after``
    batches, every other batch replayed; only those first batches run eagerly."""
    eager = generate(model)
    batches = Batches(monkeypatch)
    with bcg_core.enable_continuous_batching(model, capture_after=capture_after) as handle:
        graphed = generate(model)
        stats = handle.stats()
    assert graphed == eager
    assert len(eager) == len(PROMPT_LENGTHS)
    assert all(len(tokens) == NEW_TOKENS for tokens in eager.values())
    # Prefill chunks and decode tokens shared batches: some batch had more queries than requests
    # and fewer than the prompt tokens, and the query buckets took several sizes.
    buckets = {bucket for bucket, _, _ in batches.seen}
    assert len(buckets) >= 2
    # One graph per query bucket, whatever the KV lengths: nothing of the KV is in a graph.
    assert len({keys for _, _, keys in batches.seen}) > len(buckets)
    graphs, first, replays = batches.expected(capture_after)
    assert (stats.graphs, stats.first_batches, stats.replays) == (graphs, first, replays)
    assert stats.graphs >= 2 and stats.replays > 0 and batches.warmup
    if capture_after == 0:
        assert stats.graphs == len(buckets) and first == 0
    assert stats.eager_calls == 0
    # The engine's warm-up captured the largest bucket first; then each bucket is a multiple of
    # the interval (or the cap) and holds its batch's true queries.
    for bucket, queries, _ in batches.seen:
        assert queries <= bucket and (bucket % 8 == 0 or bucket == 32)


@pytest.mark.parametrize("capture_after", [0, 2])
def test_capture_after_sets_when_a_bucket_is_captured(
    capture_after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_against_eager(make_model(), monkeypatch, capture_after=capture_after)


def test_capture_after_is_checked() -> None:
    model = make_model()
    compute = vars(model_runner.ModelRunner)["compute_batch"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="capture_after must be an int >= 0"):
            bcg_core.enable_continuous_batching(model, capture_after=bad)  # type: ignore[arg-type]
    assert vars(model_runner.ModelRunner)["compute_batch"] is compute  # nothing patched
    with (
        bcg_core.enable_continuous_batching(model),
        pytest.raises(ValueError, match=r"capture_after=1; remove that handle first"),
    ):
        bcg_core.enable_continuous_batching(model, capture_after=0)


def test_kv_read_is_never_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    check_kv_reads(make_model(), monkeypatch)


def check_kv_reads(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cache read (inside the break: at warm-up, capture and every replay) has exactly the
    batch's keys, the engine's true length, never a padded bucket; one read per layer per
    batch. The reads are observed (the cache's own update, called through)."""
    reads: list[int] = []
    original = PagedAttentionCache.update

    def update(cache: Any, *args: Any, **kwargs: Any) -> Any:
        key, value = original(cache, *args, **kwargs)
        reads.append(key.shape[0])
        return key, value

    batches = Batches(monkeypatch)
    monkeypatch.setattr(PagedAttentionCache, "update", update)
    with bcg_core.enable_continuous_batching(model) as handle:
        generate(model)
        stats = handle.stats()
    layers = model.config.num_hidden_layers
    keys = [k for _, _, k in batches.seen]
    assert stats.graphs == batches.expected(1)[0]
    # A capture runs the step warm-ups + 1 times: twice (one warm-up).
    runs_per_capture = 2
    assert len(reads) == layers * (len(keys) + (runs_per_capture - 1) * stats.graphs)
    assert set(reads) == set(keys)
    assert reads[-layers:] == [keys[-1]] * layers


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Variable-length causal attention computed per sequence (the query aligned to the end of
    its keys, as flash attention's causal mask is), without GQA support, as the first torch
    releases' varlen_attn: what the varlen break must feed, checked on the CPU."""
    assert window_size == (-1, 0), "the break asks for causal attention"
    out = []
    for i in range(cu_q.numel() - 1):
        qs = q[int(cu_q[i]) : int(cu_q[i + 1])].transpose(0, 1)
        ks = k[int(cu_k[i]) : int(cu_k[i + 1])].transpose(0, 1)
        vs = v[int(cu_k[i]) : int(cu_k[i + 1])].transpose(0, 1)
        assert qs.shape[1] <= max_q and ks.shape[1] <= max_k
        causal = torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool, device=qs.device)
        causal = causal.tril(ks.shape[1] - qs.shape[1])
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal, scale=scale
        )
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def test_varlen_break_feeds_each_request_its_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The varlen break's packing (the cache's keys in batch order, cumulative lengths, causal
    alignment, GQA by repeated heads) on the CPU, with a per-sequence reference kernel standing
    in for torch's CUDA-only varlen_attn: greedy tokens equal the eager engine's (float32)."""
    monkeypatch.setattr(cb, "_VARLEN_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(cb, "_VARLEN_DTYPES", (torch.float32,))  # the reference kernel's
    monkeypatch.setattr(cb, "_varlen_attn", lambda: reference_varlen)
    cb._varlen_keywords.cache_clear()
    try:
        model = make_model()
        eager = generate(model)
        with bcg_core.enable_continuous_batching(model, attention="varlen") as handle:
            assert generate(model) == eager
            assert handle.stats().graphs >= 2 and handle.stats().eager_calls == 0
    finally:
        cb._varlen_keywords.cache_clear()


def test_varlen_is_refused_where_it_has_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    compute = vars(model_runner.ModelRunner)["compute_batch"]
    with pytest.raises(ValueError, match='"paged" or "varlen"'):
        bcg_core.enable_continuous_batching(model, attention="flash")  # type: ignore[arg-type]
    if cb._varlen_attn() is not None:  # a torch with varlen_attn: its kernel is CUDA only
        with pytest.raises(ValueError, match=r'CUDA kernel .* use attention="paged"'):
            bcg_core.enable_continuous_batching(model, attention="varlen")
    assert vars(model_runner.ModelRunner)["compute_batch"] is compute  # nothing patched
    monkeypatch.setattr(cb, "_VARLEN_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(cb, "_varlen_attn", lambda: reference_varlen)
    # The flash kernel takes half precision only: a float32 model would fail every capture.
    with pytest.raises(ValueError, match=r"float16 and bfloat16 only .* torch.float32"):
        bcg_core.enable_continuous_batching(model, attention="varlen")
    assert vars(model_runner.ModelRunner)["compute_batch"] is compute  # nothing patched
    monkeypatch.setattr(cb, "_VARLEN_DTYPES", (torch.float32,))
    with (
        bcg_core.enable_continuous_batching(model),
        pytest.raises(ValueError, match=r"already enabled .* remove that handle first"),
    ):
        bcg_core.enable_continuous_batching(model, attention="varlen")


def test_disabled_graphs_serve_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """BCG_DISABLE=1 (read at every call, also on the engine's own thread): every batch runs the
    model eagerly on the padded batch, attention included, and the tokens stay eager's."""
    model = make_model()
    eager = generate(model)
    monkeypatch.setenv("BCG_DISABLE", "1")
    with bcg_core.enable_continuous_batching(model) as handle:
        assert generate(model) == eager
        stats = handle.stats()
    assert stats.graphs == 0 and stats.replays == 0 and stats.eager_calls > 0


def test_disabled_graphs_keep_the_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With graphs off (or a capture failed) a varlen engine's batches run the varlen kernel
    eagerly on the same padded batches: the run a replay must equal, token for token."""
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return reference_varlen(*args, **kwargs)

    monkeypatch.setattr(cb, "_VARLEN_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(cb, "_VARLEN_DTYPES", (torch.float32,))
    monkeypatch.setattr(cb, "_varlen_attn", lambda: counted)
    cb._varlen_keywords.cache_clear()
    try:
        model = make_model()
        with bcg_core.enable_continuous_batching(model, attention="varlen"):
            graphed = generate(model)
            monkeypatch.setenv("BCG_DISABLE", "1")
            calls.clear()
            eager = generate(model)
        assert calls, "the eager batches did not run the varlen kernel"
        assert eager == graphed
    finally:
        cb._varlen_keywords.cache_clear()


def test_remove_restores_transformers() -> None:
    mapping = AttentionInterface._global_mapping
    before = (
        vars(model_runner.ModelRunner)["compute_batch"],
        vars(model_runner.ModelRunner)["maybe_pad_inputs"],
        mapping["paged|sdpa"],
        mapping["paged|eager"],
    )
    model = make_model()
    first = bcg_core.enable_continuous_batching(model)
    second = bcg_core.enable_continuous_batching(model)
    assert vars(model_runner.ModelRunner)["compute_batch"] is not before[0]
    first.remove()
    first.remove()  # idempotent
    assert mapping["paged|sdpa"] is not before[2]  # the second handle still holds the patch
    second.remove()
    after = (
        vars(model_runner.ModelRunner)["compute_batch"],
        vars(model_runner.ModelRunner)["maybe_pad_inputs"],
        mapping["paged|sdpa"],
        mapping["paged|eager"],
    )
    assert after == before
    assert not second.active


def test_other_models_run_transformers_code(monkeypatch: pytest.MonkeyPatch) -> None:
    enabled, other = make_model(), make_model()
    reference = generate(other)
    with bcg_core.enable_continuous_batching(enabled) as handle:
        assert generate(other) == reference
        assert handle.stats().graphs == 0


def test_unsupported_attention_is_refused_before_anything_changes() -> None:
    model = make_model()
    model.config._attn_implementation = "flex_attention"
    compute = vars(model_runner.ModelRunner)["compute_batch"]
    with pytest.raises(ValueError, match='attn_implementation="sdpa"'):
        bcg_core.enable_continuous_batching(model)
    assert vars(model_runner.ModelRunner)["compute_batch"] is compute
