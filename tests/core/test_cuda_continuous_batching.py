"""transformers' continuous batching through bcg on CUDA: the CPU module's mixed prefill+decode
batches (tiny Llama, float32, greedy), bcg's tokens equal the eager engine's with a graph per
recurring query bucket, and every KV read inside the break is the batch's true length (never
padded); the varlen break: torch's kernel's causal alignment, and the engine served through it
(bf16)."""

from __future__ import annotations

import pytest
import torch

import bcg_core
from bcg_core._integrations import continuous_batching as cb  # noqa: PLC2701

pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_continuous_batching import (
    Batches,
    check_against_eager,
    check_kv_reads,
    generate,
    make_model,
    reference_varlen,
)
from test_cpu_continuous_batching_holes import (  # noqa: F401 (a fixture, used by name)
    NEW_TOKENS,
    sample,
    unwritten_cache_is_nan,
)

pytestmark = pytest.mark.cuda


@pytest.mark.usefixtures("unwritten_cache_is_nan")
def test_sampling_warmup_captures_on_a_cache_nothing_wrote() -> None:
    # The engine's warm-up batch reads cache rows nothing wrote (torch.empty): on CUDA,
    # torch.multinomial over the NaN logits they give is a device-side assert. bcg zeroes them.
    model = make_model(device="cuda")
    with bcg_core.enable_continuous_batching(model) as handle:
        sampled = sample(model)
        stats = handle.stats()
    assert [len(tokens) for tokens in sampled] == [NEW_TOKENS] * len(sampled)
    assert all(0 <= t < model.config.vocab_size for tokens in sampled for t in tokens)
    assert stats.eager_calls == 0 and stats.graphs >= 1 and stats.replays > 0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_mixed_batches_equal_eager_token_for_token(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_against_eager(make_model(attention, device="cuda"), monkeypatch)


def test_kv_read_is_never_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    check_kv_reads(make_model(device="cuda"), monkeypatch)


def test_varlen_attn_is_causal_from_the_end_of_each_request() -> None:
    """What the varlen break relies on in torch's kernel: causal attention with each request's
    queries aligned to the end of its keys (a decode token sees its whole cache), GQA by
    ``enable_gqa`` where this torch takes it."""
    varlen_attn = cb._varlen_attn()
    if varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    causal, gqa = cb._varlen_keywords()
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2 if gqa else 4, 64
    cu_q = torch.tensor([0, 1, 4, 9], dtype=torch.int32, device="cuda")  # decode, chunk, prefill
    cu_k = torch.tensor([0, 7, 17, 22], dtype=torch.int32, device="cuda")
    q = torch.randn(9, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(22, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(22, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    extra = {"enable_gqa": True} if kv_heads != heads else {}
    out = varlen_attn(q, k, v, cu_q, cu_k, 5, 10, scale=0.125, **causal, **extra)
    groups = heads // kv_heads
    k_full, v_full = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    want = reference_varlen(
        q.float(), k_full, v_full, cu_q, cu_k, 5, 10, scale=0.125, window_size=(-1, 0)
    )
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_varlen_break_serves_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, torch's varlen_attn as the break's kernel: a graph per recurring query bucket, no
    batch run eagerly but those buckets' first ones, and each request's first token (from its
    prefill) as the eager engine's; later tokens may part ways (another kernel than eager's bf16
    sdpa, random weights)."""
    if cb._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    model = make_model(device="cuda").to(torch.bfloat16)
    eager = generate(model)
    batches = Batches(monkeypatch)
    with bcg_core.enable_continuous_batching(model, attention="varlen") as handle:
        graphed = generate(model)
        stats = handle.stats()
    assert (stats.graphs, stats.first_batches, stats.replays) == batches.expected(1)
    assert stats.eager_calls == 0
    assert graphed.keys() == eager.keys()
    assert sum(graphed[r][0] == eager[r][0] for r in eager) >= len(eager) - 1


def test_varlen_replays_equal_the_engine_eager_with_its_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16: every token of every request equals the engine run eagerly (BCG_DISABLE=1) with
    the same varlen kernel on the same padded batches (the serve bench's reference)."""
    if cb._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    model = make_model(device="cuda").to(torch.bfloat16)
    with bcg_core.enable_continuous_batching(model, attention="varlen") as handle:
        graphed = generate(model)
        assert handle.stats().eager_calls == 0
        monkeypatch.setenv("BCG_DISABLE", "1")
        eager = generate(model)
        assert handle.stats().eager_calls > 0
    assert graphed == eager
