"""bcg-diffusion without a GPU: replay tokens, the attention adapter, padding, runner fallback."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

from bcg_core import enable_breakable_cuda_graph, signature_of
from bcg_diffusion import (
    DiTRunner,
    bucket_for,
    get_current_replay_token,
    install_breakable_attention,
    is_breakable_attention_installed,
    make_breakable_attention_forward,
    pad_prompt,
    replay_token_scope,
    uninstall_breakable_attention,
)

# -- replay tokens -----------------------------------------------------------------------------


def test_token_is_none_outside_and_stable_inside_a_scope() -> None:
    assert get_current_replay_token() is None
    with replay_token_scope() as token:
        assert get_current_replay_token() == token
        assert get_current_replay_token() == token
    assert get_current_replay_token() is None


def test_tokens_are_fresh_increasing_and_nest_safe() -> None:
    with replay_token_scope() as a:
        pass
    with replay_token_scope() as b:
        with replay_token_scope() as inner:
            assert get_current_replay_token() == inner
        assert get_current_replay_token() == b
    assert a < b < inner


def test_a_token_scope_decorates_with_a_fresh_token_per_call() -> None:
    @replay_token_scope()
    def replay() -> int | None:
        return get_current_replay_token()

    first, second = replay(), replay()
    assert first is not None and second is not None and first < second
    assert get_current_replay_token() is None


def test_tokens_are_per_thread() -> None:
    seen: list[int | None] = []
    with replay_token_scope():
        t = threading.Thread(target=lambda: seen.append(get_current_replay_token()))
        t.start()
        t.join()
    assert seen == [None]


# -- attention adapter -------------------------------------------------------------------------


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x), dim=-1)


class _AttnLSE(_Attn):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = self.proj(x)
        return torch.softmax(y, dim=-1), torch.logsumexp(y, dim=-1)


class _Inherits(_Attn):
    pass


def test_adapter_passes_through_and_unboxes_tuples() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    for cls in (_Attn, _AttnLSE):
        module = cls()
        expected = cls.forward(module, x)
        adapted = make_breakable_attention_forward(cls.forward)
        assert adapted.__name__ == "forward"
        for flag in (False, True):
            with enable_breakable_cuda_graph(flag):
                got = adapted(module, x)
            if isinstance(expected, tuple):
                assert isinstance(got, tuple) and len(got) == 2
                for g, e in zip(got, expected, strict=True):
                    assert torch.equal(g, e)
            else:
                assert torch.equal(got, expected)
    assert make_breakable_attention_forward(adapted) is adapted


def test_install_is_idempotent_and_undoable() -> None:
    original = _Attn.forward
    patch = install_breakable_attention(_Attn, _Inherits)
    patched = _Attn.forward
    assert patched is not original
    install_breakable_attention(_Attn)
    assert _Attn.forward is patched
    assert is_breakable_attention_installed(_Attn)
    x = torch.randn(3, 8)
    module = _Inherits()
    with enable_breakable_cuda_graph():
        assert torch.equal(module(x), original(module, x))
    patch.remove()
    patch.remove()
    assert _Attn.forward is original
    assert "forward" not in _Inherits.__dict__
    with install_breakable_attention(_Attn):
        assert _Attn.forward is not original
    assert _Attn.forward is original
    uninstall_breakable_attention(_Attn)
    with pytest.raises(TypeError, match="classes with a forward"):
        install_breakable_attention(42)  # type: ignore[arg-type]


# -- signatures --------------------------------------------------------------------------------


def test_signature_keys() -> None:
    a = torch.zeros(1, 4, 8, 8)
    same = signature_of((a, 0.5), {"cfg": True})
    assert same == signature_of((torch.ones(1, 4, 8, 8), 0.5), {"cfg": True})
    assert same != signature_of((torch.zeros(1, 4, 16, 16), 0.5), {"cfg": True})
    assert same != signature_of((a.half(), 0.5), {"cfg": True})
    assert same != signature_of((a, 0.75), {"cfg": True})
    assert same != signature_of(([a], 0.5), {"cfg": True})
    marker = object()
    assert signature_of((marker,), {}) == signature_of((marker,), {})
    assert signature_of((marker,), {}) != signature_of((object(),), {})
    assert signature_of((), {"a": 1, "b": 2}) == signature_of((), {"b": 2, "a": 1})


# -- prompt padding ----------------------------------------------------------------------------


def test_bucket_choice_and_errors() -> None:
    assert bucket_for(5, [16, 8, 32]) == 8
    assert bucket_for(8, [8, 16]) == 8
    with pytest.raises(ValueError, match="exceeds the largest bucket 16"):
        bucket_for(17, [8, 16])
    with pytest.raises(ValueError, match="positive int lengths"):
        bucket_for(1, [])


def test_pad_prompt_masks_padding_and_preserves_masked_attention() -> None:
    torch.manual_seed(1)
    text = torch.randn(2, 5, 16)
    padded, mask = pad_prompt(text, None, [4, 8])
    assert padded.shape == (2, 8, 16) and mask.shape == (2, 8)
    assert mask[:, :5].all() and not mask[:, 5:].any()
    assert torch.equal(padded[:, :5], text) and not padded[:, 5:].any()
    q = torch.randn(2, 1, 7, 16)
    full = torch.nn.functional.scaled_dot_product_attention(q, text[:, None], text[:, None])
    masked = torch.nn.functional.scaled_dot_product_attention(
        q, padded[:, None], padded[:, None], attn_mask=mask[:, None, None, :]
    )
    torch.testing.assert_close(masked, full)
    same, same_mask = pad_prompt(padded, mask, [8])
    assert same is padded and torch.equal(same_mask, mask)
    with pytest.raises(ValueError, match=r"\[batch, length, dim\]"):
        pad_prompt(torch.zeros(3, 3), None, [4])


# -- runner without CUDA -----------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_runner_without_cuda_runs_eagerly_with_one_notice(caplog: pytest.LogCaptureFixture) -> None:
    model = _Attn()
    runner = DiTRunner(model, attention_classes=(_Attn,))
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        first = runner.capture(x)
        second = runner(x)
    assert torch.equal(first, model(x)) and torch.equal(second, first)
    notices = [r for r in caplog.records if "no CUDA device" in r.getMessage()]
    assert len(notices) == 1
    assert runner.stats.captures == 0 and runner.proj is model.proj  # attribute proxying
    runner.close()
    assert not is_breakable_attention_installed(_Attn)


def test_dit_workload_is_discovered_through_the_entry_point() -> None:
    import importlib.metadata

    from bcg_core.bench._workloads import discover  # noqa: PLC2701

    try:
        importlib.metadata.distribution("bcg-diffusion")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("bcg-diffusion is on the path but not installed, so it has no entry points")
    assert "dit" in discover()


class _Dummy:
    """A class whose method stands in for the attention ops a handle patches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("bad", ["max_entries", "attention_class"])
def test_dit_runner_releases_its_handle_when_its_constructor_fails(bad: str) -> None:
    # Before issue 21 the runner kept the handle it owns when it raised (patch count 1, then 2).
    from bcg_diffusion import PatchHandle, patch_attribute

    patch_count = PatchHandle.count

    handle = patch_attribute(_Dummy, "forward", _identity_wrap)
    assert patch_count(_Dummy, "forward") == 1
    kwargs: dict[str, object] = {"device": "cpu"}
    if bad == "max_entries":
        kwargs["max_entries"] = 0
    else:
        kwargs["attention_classes"] = (object(),)
    with pytest.raises((ValueError, TypeError)):
        DiTRunner(lambda x: x, breakable_attention=handle, **kwargs)  # type: ignore[arg-type]
    assert patch_count(_Dummy, "forward") == 0
    assert not handle.active


def _identity_wrap(fn: object) -> object:
    return fn
