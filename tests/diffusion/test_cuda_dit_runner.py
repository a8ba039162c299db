"""DiTRunner on a real GPU: replay equals eager, CFG, CPU timesteps, tokens, eviction, fallbacks."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from bcg_diffusion import (
    DiTRunner,
    get_current_replay_token,
    pad_prompt,
    uninstall_breakable_attention,
)
from bcg_diffusion._toy_dit import (  # noqa: PLC2701
    DiTConfig,
    DiTSelfAttention,
    DiTSelfAttentionLSE,
    ToyDiT,
)

pytestmark = pytest.mark.cuda

CFG = DiTConfig(hidden=128, depth=3, heads=4, text_dim=64)


@pytest.fixture()
def model() -> ToyDiT:
    return ToyDiT(CFG).cuda().eval()


_RUNNERS: list[DiTRunner] = []


def _runner(model: Any, **options: Any) -> DiTRunner:
    """A DiTRunner closed after the test (closing releases its attention patch)."""
    runner = DiTRunner(model, **options)
    _RUNNERS.append(runner)
    return runner


@pytest.fixture(autouse=True)
def _unpatch() -> Any:
    yield
    while _RUNNERS:
        _RUNNERS.pop().close()
    uninstall_breakable_attention(DiTSelfAttention, DiTSelfAttentionLSE)


def _inputs(res: int, prompt: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
    latents = torch.randn(batch, 4, res, res, device="cuda", dtype=torch.bfloat16)
    t = torch.rand(batch, device="cuda") * 1000
    text = torch.randn(batch, prompt, CFG.text_dim, device="cuda", dtype=torch.bfloat16)
    return latents, t, text


@pytest.mark.parametrize("lse", [False, True], ids=["plain", "lse-tuple"])
def test_runner_equals_eager_for_three_signatures(lse: bool) -> None:
    torch.manual_seed(0)
    model = ToyDiT(DiTConfig(hidden=128, depth=3, heads=4, text_dim=64, lse_attention=lse))
    model = model.cuda().eval()
    runner = _runner(model, attention_classes=(DiTSelfAttention, DiTSelfAttentionLSE))
    shapes = [(16, 8), (32, 8), (16, 16)]
    with torch.no_grad():
        for res, prompt in shapes:
            runner.capture(*_inputs(res, prompt))
        assert runner.stats.captures == 3
        for entry in runner.stats.entries:
            assert entry.breaks == CFG.depth and entry.segments == CFG.depth + 1
        for _ in range(3):
            for res, prompt in shapes:
                args = _inputs(res, prompt)
                got = runner(*args)
                torch.testing.assert_close(got, model(*args), rtol=0, atol=0)
    assert runner.stats.hits == 9 and runner.stats.misses == 0


def test_cfg_two_calls_share_one_entry_and_both_stay_valid(model: ToyDiT) -> None:
    runner = _runner(model, attention_classes=(DiTSelfAttention,))
    latents, t, cond = _inputs(16, 8)
    uncond = torch.zeros_like(cond)
    with torch.no_grad():
        runner.capture(latents, t, cond)
        for _ in range(3):
            latents.normal_()
            out_c = runner(latents, t, cond)
            out_u = runner(latents, t, uncond)
            torch.testing.assert_close(out_c, model(latents, t, cond), rtol=0, atol=0)
            torch.testing.assert_close(out_u, model(latents, t, uncond), rtol=0, atol=0)
            assert not torch.equal(out_c, out_u)
    assert len(runner.stats.entries) == 1


def test_cpu_timestep_gets_a_device_buffer(model: ToyDiT) -> None:
    runner = _runner(model, attention_classes=(DiTSelfAttention,))
    latents, _, text = _inputs(16, 8)
    with torch.no_grad():
        runner.capture(latents, torch.tensor([999.0]), text)
        for step in (900.0, 500.0, 10.0):
            t = torch.tensor([step])
            torch.testing.assert_close(
                runner(latents, t, text), model(latents, t, text), rtol=0, atol=0
            )
    assert runner.stats.hits == 3


class _CachingAttention(DiTSelfAttention):
    """Builds 'metadata' once per replay token, like varlen attention building cu_seqlens."""

    builds = 0
    tokens: list[int | None] = []  # noqa: RUF012
    _cached_for: int | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        token = get_current_replay_token()
        type(self).tokens.append(token)
        if token is None or token != type(self)._cached_for:
            type(self).builds += 1
            type(self)._cached_for = token
        return super().forward(q, k, v)


def test_replay_tokens_fresh_per_replay_and_shared_by_all_breaks(model: ToyDiT) -> None:
    for block in model.blocks:
        block.attn.__class__ = _CachingAttention
    runner = _runner(model, attention_classes=(_CachingAttention,))
    args = _inputs(16, 8)
    with torch.no_grad():
        runner.capture(*args)
        _CachingAttention.tokens.clear()
        _CachingAttention.builds = 0
        for _ in range(3):
            runner(*args)
    tokens = _CachingAttention.tokens
    assert len(tokens) == 3 * CFG.depth and None not in tokens
    per_replay = [tokens[i : i + CFG.depth] for i in range(0, len(tokens), CFG.depth)]
    assert all(len(set(group)) == 1 for group in per_replay)
    assert len({group[0] for group in per_replay}) == 3
    assert _CachingAttention.builds == 3  # rebuilt exactly once per replay
    uninstall_breakable_attention(_CachingAttention)


def test_eviction_returns_memory(model: ToyDiT) -> None:
    runner = _runner(model, attention_classes=(DiTSelfAttention,), max_entries=1)
    with torch.no_grad():  # first capture: cuBLAS workspaces for the runner's stream, kept
        runner.capture(*_inputs(16, 4))
    runner.reset()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        runner.capture(*_inputs(32, 8))
        one = torch.cuda.memory_allocated() - base
        runner.capture(*_inputs(32, 16))  # evicts the first entry
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - base
    assert runner.stats.evictions == 1 and len(runner.stats.entries) == 1
    assert after < 1.5 * one, (one, after)
    runner.reset()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base < 0.2 * one


class _SyncingDiT(ToyDiT):
    def forward(self, *args: Any, sync: bool = False, **kwargs: Any) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        if sync and out.float().mean().item() > 1e9:  # a host sync inside a graph segment
            out = out * 0
        return out


def test_failed_capture_blocks_signature_and_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    model = _SyncingDiT(CFG).cuda().eval()
    runner = _runner(model, attention_classes=(DiTSelfAttention,))
    args = _inputs(16, 8)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="bcg_core"):
        bad = runner.capture(*args, sync=True)
        torch.testing.assert_close(bad, model(*args, sync=True), rtol=0, atol=0)
        assert runner.stats.failed_captures == 1 and len(runner.blocked_signatures) == 1
        again = runner.capture(*args, sync=True)  # blocked: eager, no new capture attempt
        torch.testing.assert_close(again, model(*args, sync=True), rtol=0, atol=0)
        assert runner.stats.failed_captures == 1
        good = runner.capture(*args)  # the same model without the sync still captures
        torch.testing.assert_close(good, model(*args), rtol=0, atol=0)
    assert "capture failed for the call with" in caplog.text
    assert runner.stats.captures == 1
    assert not torch.cuda.is_current_stream_capturing()


def test_serving_miss_never_captures_and_is_diagnosed_once(
    model: ToyDiT, caplog: pytest.LogCaptureFixture
) -> None:
    runner = _runner(model, attention_classes=(DiTSelfAttention,))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="bcg_core"):
        runner.capture(*_inputs(16, 8))
        for _ in range(2):
            args = _inputs(16, 12)
            torch.testing.assert_close(runner(*args), model(*args), rtol=0, atol=0)
    assert runner.stats.captures == 1 and runner.stats.misses == 2
    misses = [r.getMessage() for r in caplog.records if "has no graph" in r.getMessage()]
    assert len(misses) == 1
    assert "args[2]: tensor[1, 12, 64]" in misses[0] and "tensor[1, 8, 64]" in misses[0]


def test_prompt_padding_hits_captured_bucket(model: ToyDiT) -> None:
    runner = _runner(model, attention_classes=(DiTSelfAttention,))
    buckets = [8, 16]
    latents, t, _ = _inputs(16, 8)
    with torch.no_grad():
        text, mask = pad_prompt(
            torch.randn(1, 16, CFG.text_dim, device="cuda").bfloat16(), None, buckets
        )
        runner.capture(latents, t, text, mask)
        for length in (5, 11, 16):
            raw = torch.randn(1, length, CFG.text_dim, device="cuda").bfloat16()
            padded, pmask = pad_prompt(raw, None, buckets)
            if padded.shape[1] != 16:
                continue
            got = runner(latents, t, padded, pmask)
            torch.testing.assert_close(got, model(latents, t, raw), rtol=2e-2, atol=2e-2)
    assert runner.stats.hits == 2 and runner.stats.misses == 0
