"""Holes found in the transformers integration (second pass), on the CPU graph backend with tiny
random-weight models: each replay equal to eager on its own cache, or a clear refusal."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import BreakableGraphRunner

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_transformers import _windowed, saved_cache  # noqa: E402, PLC2701


def _left_padded(batch: int = 2, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt and its attention mask, the first row padded on the left by 3 tokens."""
    prompt = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0
    return prompt, mask


@pytest.mark.parametrize(("family", "base"), [("mistral", "sdpa"), ("gemma2", "sdpa")])
def test_a_sliding_window_step_given_an_attention_mask_is_captured(family: str, base: str) -> None:
    """A batch with left padding decodes with its 2D attention mask (as long as the cache).
    transformers pads that mask by comparing the sliding layer's key offset on the host
    (``prepare_padding_mask``), and bcg makes that offset a tensor: bcg_sdpa's captured mask
    raised HostSyncError at capture, so the runner served every step eagerly. The mask of such
    a layer is a break now (as other bases' masks are): captured, and every replay across the
    window's filling and rolling equals eager."""
    model = _windowed(family, base)
    length = 48
    prompt, mask = _left_padded()
    caches = [transformers.StaticCache(config=model.config, max_cache_len=length) for _ in "ab"]
    with torch.no_grad():
        for cache in caches:
            logits = model(input_ids=prompt, attention_mask=mask, past_key_values=cache).logits
    cache, reference = caches
    full = torch.zeros(2, length, dtype=torch.long)
    full[:, :6] = mask

    def decode(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            input_ids=ids, attention_mask=attention_mask, past_key_values=cache
        ).logits
        return out

    runner = BreakableGraphRunner(decode, device="cpu", warmup_iters=1)
    ids = logits[:, -1:].argmax(-1)
    with torch.no_grad():
        restore = saved_cache(cache)
        full[:, 6] = 1
        runner.capture(ids, full)
        restore()
        assert not runner.blocked_signatures, list(runner.blocked_signatures.values())
        for step in range(24):  # the window (16) fills and rolls
            full[:, 6 + step] = 1
            got = runner(ids, full)
            expected = model(input_ids=ids, attention_mask=full, past_key_values=reference).logits
            assert torch.equal(got, expected), f"step {step}"
            ids = expected[:, -1:].argmax(-1)
    assert runner.stats.hits == 24
    assert not bcg_core.is_breakable_capture_active()


@pytest.mark.parametrize(("base", "padded"), [("eager", False), ("sdpa", True)])
def test_the_divergence_check_judges_a_sliding_window_mask_break(base: str, padded: bool) -> None:
    """A sliding layer's mask function is a break (bcg_eager's always, bcg_sdpa's given a 2D
    attention mask), and transformers hands it a mask predicate made anew at every forward
    (``and_masks(...)``, a closure over the window). The divergence check compared that
    argument by identity: 'EAGER IS NOT REPRODUCIBLE' between two eager runs of one input set,
    so it never judged the replay. Two functions of the same code over equal values are the
    same argument now, and the check passes before, at and past the window's filling."""
    model = _windowed("mistral", base)
    length = 64
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    prompt, mask = _left_padded(2, 5)
    if not padded:
        mask.fill_(1)

    def at(tokens: int, token: int) -> Any:
        def load() -> tuple[torch.Tensor, torch.Tensor]:
            cache.reset()
            repeat = tokens // 5
            model(
                input_ids=prompt.repeat(1, repeat),
                attention_mask=mask.repeat(1, repeat),
                past_key_values=cache,
            )
            full = torch.zeros(2, length, dtype=torch.long)
            full[:, :tokens] = mask.repeat(1, repeat)
            full[:, tokens] = 1
            return torch.tensor([[token], [token + 1]]), full

        return load

    def decode(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            input_ids=ids, attention_mask=attention_mask, past_key_values=cache
        ).logits
        return out

    with torch.no_grad():
        report = bcg_core.check_divergence(decode, [at(5, 3), at(15, 5), at(40, 9)])
    assert report.ok, str(report)
