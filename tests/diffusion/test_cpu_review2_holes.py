"""Holes found in a second review of bcg-diffusion's runner and adapters, on the CPU graph
backend (tiny models, random weights, float32):

- a closed ``DiTRunner`` (its attention patches released) still captured: the new graph held
  the attention it was made to break, so state that attention reads (a processor's scale, a
  class attribute) replayed stale, silently; a closed runner now serves every call eagerly;
- a runner given a handle that another runner owns (or one removed already) took it: once the
  owner closed, the runner captured without its attention breaks, silently; both are refused;
- an IP-Adapter processor's scale set after capture replayed the old one (only its sdpa broke);
- make_attention_ops_breakable(pipe) failed with an AttributeError about modules().
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from bcg_diffusion import DiTRunner, is_breakable_attention_installed, make_attention_ops_breakable


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


class _ScaledAttention(nn.Module):
    """Attention reading host state at every call (as an IP-Adapter processor reads its
    ``scale``): captured into the graph, a later scale would replay stale."""

    scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1) * type(self).scale


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.attn = _ScaledAttention()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.attn(self.inp(x)))
        return out


def test_a_closed_runner_serves_eagerly_instead_of_capturing_without_its_breaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _Model().eval()
    x = torch.randn(2, 4)
    runner = DiTRunner(model, attention_classes=(_ScaledAttention,), device="cpu")
    with torch.no_grad():
        runner.capture(x)
        assert runner.stats.entries[0].breaks == 1
        runner.close()
        assert not is_breakable_attention_installed(_ScaledAttention)
        runner.capture(x)  # was: a graph with the attention captured, no break
        report = runner.capture_many([((x,), {})])
        assert runner.stats.captures == 0 and runner.stats.entries == ()
        assert len(report.failed) == 1 and "closed" in report.failed[0][1]
        runner.reset()  # still closed: reset does not bring the released breaks back
        runner.capture(x)
        assert runner.stats.captures == 0
        monkeypatch.setattr(_ScaledAttention, "scale", 2.0)
        assert torch.equal(runner(x), model(x))  # was: the scale-1 graph replayed
    assert runner.serves_eagerly and "closed" in (runner.disabled_reason or "")


# -- the handle a runner owns ------------------------------------------------------------------


def _sd3() -> tuple[nn.Module, Any, torch.Tensor]:
    pytest.importorskip("diffusers")
    from test_cpu_diffusers import sd3_model

    return sd3_model()


def _sage_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """A user's kernel installed after the capture (SageAttention's recipe): another result."""
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, **kw) * 0.5


def test_a_handle_owned_by_another_runner_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: the second runner took the handle the first owned; closing the first removed it,
    and the second captured its next graph with no attention break (a kernel installed later
    then ran in eager calls and never in its replays, silently)."""
    model, step, latents = _sd3()
    handle = make_attention_ops_breakable(model)
    first = DiTRunner(step, breakable_attention=handle, device="cpu")
    try:
        with pytest.raises(ValueError, match="owned by another DiTRunner"):
            DiTRunner(step, breakable_attention=handle, device="cpu")
        assert handle.active  # the refusal left the first runner's handle alone
        with torch.no_grad():
            first.capture(latents, torch.ones(1))
            assert first.stats.entries[0].breaks == 2
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _sage_like)
            got = first(latents, torch.ones(1))
    finally:
        first.close()
    with torch.no_grad():
        assert torch.equal(got, step(latents, torch.ones(1)))  # the later kernel, replayed too


def test_a_removed_handle_is_refused() -> None:
    """Was: a runner given a handle removed already captured with no attention break."""
    model, step, _ = _sd3()
    with make_attention_ops_breakable(model) as handle:
        pass
    with pytest.raises(ValueError, match="removed"):
        DiTRunner(step, breakable_attention=handle, device="cpu")
    runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    runner.close()


# -- processor state read at every replay -------------------------------------------------------


def test_an_ip_adapter_scale_set_after_capture_replays_with_attention_ops_breakable() -> None:
    """Was: only the processor's sdpa calls were breaks, so its ``scale`` (what
    ``pipe.set_ip_adapter_scale`` writes) was a constant of the captured graph: a new scale
    replayed the old one, silently. A processor that is an ``nn.Module`` with its attention in
    ``__call__`` (IP-Adapter, Custom Diffusion) is now one whole-``__call__`` break, as
    ``install_breakable_attention`` makes it."""
    pytest.importorskip("diffusers")
    from diffusers.models import attention_processor as ap
    from test_cpu_diffusion_holes import ip_adapter_step

    proc, attn, step, x = ip_adapter_step()
    before = dict(vars(ap.IPAdapterAttnProcessor2_0))
    runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(attn), device="cpu")
    got: list[tuple[float, torch.Tensor]] = []
    try:
        with torch.no_grad():
            runner.capture(x)
            assert runner.stats.entries[0].breaks == 1  # the whole __call__, its sdpas inside
            for scale in (0.0, 0.5):
                proc.scale = [scale]
                got.append((scale, runner(x)))
            assert runner.stats.hits == 2
    finally:
        runner.close()
    assert dict(vars(ap.IPAdapterAttnProcessor2_0)) == before
    with torch.no_grad():
        for scale, out in got:
            proc.scale = [scale]
            assert torch.equal(out, step(x))


class _Pipeline:
    """What a diffusers pipeline looks like here: components, no ``modules()``."""

    def __init__(self) -> None:
        self.transformer = _Model()


@pytest.mark.parametrize("given", [_Pipeline(), _Model], ids=["pipeline", "class"])
def test_make_attention_ops_breakable_given_no_module_says_what_to_pass(given: Any) -> None:
    # Was: AttributeError "'_Pipeline' object has no attribute 'modules'" (or, for a class, a
    # TypeError about modules()' missing self).
    with pytest.raises(TypeError, match=r"takes the diffusers transformer.*pipe\.transformer"):
        make_attention_ops_breakable(given)


def test_a_handle_of_a_runner_dropped_without_close_can_be_given_again() -> None:
    model, step, latents = _sd3()
    handle = make_attention_ops_breakable(model)
    DiTRunner(step, breakable_attention=handle, device="cpu")  # dropped, never closed
    gc.collect()
    runner = DiTRunner(step, breakable_attention=handle, device="cpu")  # the patch is alive
    try:
        with torch.no_grad():
            runner.capture(latents, torch.ones(1))
        assert runner.stats.entries[0].breaks == 2
    finally:
        runner.close()
    assert not handle.active


def test_pad_prompt_refuses_float_buckets_and_an_empty_prompt() -> None:
    # A float bucket failed inside F.pad with a TypeError naming neither; an empty prompt padded
    # to an all-False mask, whose attention is NaN.
    from bcg_diffusion import pad_prompt

    text = torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match=r"positive int lengths, got \[16.0\]"):
        pad_prompt(text, None, [16.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one token"):
        pad_prompt(torch.randn(1, 0, 8), None, [8])
    assert pad_prompt(text, None, [8])[0].shape == (1, 8, 8)
