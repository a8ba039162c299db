"""Holes found by the eighth review (replay tokens, DiTRunner over diffusers transformers in
denoising loops), each pinned by a test that failed before its fix."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_diffusion import (
    DiTRunner,
    get_current_replay_token,
    make_attention_ops_breakable,
    replay_token_scope,
)


def test_a_token_scope_entered_twice_nested_says_so_and_leaves_no_token() -> None:
    """Was contextvars' raw "Token has already been used once" at the outer exit, and the
    inner token stayed set after the block (eager code then saw a replay's token)."""
    scope = replay_token_scope()
    with scope as token:
        with pytest.raises(RuntimeError, match="entered already"), scope:
            pass
        assert get_current_replay_token() == token
    assert get_current_replay_token() is None
    with scope as again:  # entered once at a time, it can be reused
        assert get_current_replay_token() == again > token
    assert get_current_replay_token() is None


def test_a_token_scope_shared_by_two_threads_leaves_neither_a_token() -> None:
    """Was: the second thread's enter overwrote the first's reset token, the first thread's
    exit raised and its token stayed set for the rest of the thread."""
    scope = replay_token_scope()
    entered, second_done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def first() -> None:
        try:
            with scope:
                entered.set()
                second_done.wait(10)
        except Exception as exc:
            seen["first_error"] = exc
        seen["first_after"] = get_current_replay_token()

    def second() -> None:
        entered.wait(10)
        try:
            with scope:
                pass
        except RuntimeError as exc:
            seen["second_error"] = exc
        finally:
            second_done.set()
        seen["second_after"] = get_current_replay_token()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert "first_error" not in seen
    assert "entered already" in str(seen["second_error"])
    assert seen["first_after"] is None and seen["second_after"] is None


# -- diffusers' stateful cache hooks ---------------------------------------------------------


def _flux_with_cache(
    config: str,
) -> tuple[Any, Callable[[Any, torch.Tensor], torch.Tensor], torch.Tensor, dict[str, Any]]:
    """A tiny Flux with a diffusers cache enabled, a 4-step loop over it, latents, keywords."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip
    now = {"t": 1000}
    if config == "pab":
        model.enable_cache(
            diffusers.PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=2,
                spatial_attention_timestep_skip_range=(100, 800),
                current_timestep_callback=lambda: now["t"],
            )
        )
    else:
        model.enable_cache(diffusers.TaylorSeerCacheConfig(cache_interval=2))
    gen = torch.Generator().manual_seed(0)
    kw = {
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
    }
    x0 = torch.randn(1, 16, 4, generator=gen)

    def loop(net: Any, x: torch.Tensor) -> torch.Tensor:
        outs = []
        with model.cache_context("cond"):
            for i in range(4):
                now["t"] = 1000 - 200 * i
                out = net(hidden_states=x, timestep=torch.tensor([now["t"] / 1000]), **kw)
                outs.append(out.sample)
                x = x - out.sample / 4
        model._reset_stateful_cache()
        return torch.stack(outs)

    return model, loop, x0, kw


@pytest.mark.parametrize("config", ["pab", "taylor"])
def test_a_model_with_a_diffusers_cache_is_refused_at_capture(config: str) -> None:
    """diffusers' cache hooks (enable_cache: PAB, TaylorSeer, ...) decide on the host at every
    step whether to recompute or reuse; a graph replayed the capture's decision at every step
    (was: replays silently differed from eager from the second step on)."""
    model, loop, x0, kw = _flux_with_cache(config)
    with torch.no_grad():
        expected = loop(model, x0)
        runner = DiTRunner(
            model, breakable_attention=make_attention_ops_breakable(model), device="cpu"
        )
        try:
            with model.cache_context("cond"), pytest.raises(ValueError, match="disable_cache"):
                runner.capture(hidden_states=x0, timestep=torch.ones(1), **kw)
            model._reset_stateful_cache()
            assert runner.stats.entries == ()
            assert torch.equal(loop(runner, x0), expected)  # no window left open: eager
            assert runner.stats.captures == 0
            model.disable_cache()  # without the cache it captures and replays eager's values
            plain = loop(model, x0)
            with runner.warmup():
                assert torch.equal(loop(runner, x0), plain)
            assert torch.equal(loop(runner, x0), plain) and runner.stats.hits >= 4
        finally:
            runner.close()
