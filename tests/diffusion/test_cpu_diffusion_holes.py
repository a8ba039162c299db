"""Holes found in bcg-diffusion's adapters, each pinned by a tiny diffusers model (random
weights, float32, CPU graph backend) whose replays must equal eager without bcg:

- processor classes that are ``nn.Module``s (IP-Adapter, Custom Diffusion) break in their
  ``__call__``, not in ``nn.Module``'s unimplemented ``forward``;
- the ``F`` stand-in of ``make_attention_ops_breakable`` follows the live
  ``torch.nn.functional``, so a kernel installed there later (SageAttention's recipe) runs,
  eagerly and in every replay;
- ``DiTRunner(torch.compile(model))`` keeps the ``return_dict`` rule (one graph for a capture
  without the flag and calls with ``return_dict=False``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from bcg_diffusion import (
    DiTRunner,
    install_breakable_attention,
    is_breakable_attention_installed,
    make_attention_ops_breakable,
)

diffusers = pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)

from diffusers.models import attention_processor  # noqa: E402
from diffusers.models.transformers import transformer_flux  # noqa: E402
from test_cpu_diffusers import flux_model, sd3_model  # noqa: E402

_ORIGINAL = "__bcg_original_forward__"  # what an adapted method carries (bcg-diffusion's mark)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


def _adapted(cls: type, name: str) -> bool:
    return getattr(vars(cls).get(name), _ORIGINAL, None) is not None


# -- 1. processor classes that are nn.Modules ---------------------------------------------------

MODULE_PROCESSORS = [
    attention_processor.IPAdapterAttnProcessor,
    attention_processor.IPAdapterAttnProcessor2_0,
    attention_processor.SD3IPAdapterJointAttnProcessor2_0,
    attention_processor.CustomDiffusionAttnProcessor,
    attention_processor.CustomDiffusionAttnProcessor2_0,
    transformer_flux.FluxIPAdapterAttnProcessor,
]


@pytest.mark.parametrize("cls", MODULE_PROCESSORS, ids=lambda c: c.__name__)
def test_a_module_processor_is_patched_in_its_call(cls: type) -> None:
    assert issubclass(cls, nn.Module) and "forward" not in vars(cls)
    with install_breakable_attention(cls):
        assert _adapted(cls, "__call__")
        assert "forward" not in vars(cls)  # nn.Module's placeholder is left alone
        assert is_breakable_attention_installed(cls)
    assert "__call__" in vars(cls) and not _adapted(cls, "__call__")
    assert not is_breakable_attention_installed(cls)


class _RealForward(nn.Module):
    """A module with a real forward and a __call__ of its own: forward is still the method."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softmax(x, dim=-1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x)  # type: ignore[no-any-return]


class _InheritsForward(nn.Linear):
    """Forward inherited from a torch module (defined below nn.Module): still forward."""


@pytest.mark.parametrize("cls", [_RealForward, _InheritsForward], ids=lambda c: c.__name__)
def test_a_module_with_a_real_forward_is_patched_in_forward(cls: type) -> None:
    with install_breakable_attention(cls):
        assert _adapted(cls, "forward")
        assert not _adapted(cls, "__call__")
    assert not _adapted(cls, "forward")


def ip_adapter_step() -> tuple[
    Any, nn.Module, Callable[[torch.Tensor], torch.Tensor], torch.Tensor
]:
    """An IP-Adapter processor (scale 1.0), the attention using it, a step around that, an
    input."""
    proc = attention_processor.IPAdapterAttnProcessor2_0(
        hidden_size=32, cross_attention_dim=32, num_tokens=(4,), scale=1.0
    )
    attn = attention_processor.Attention(
        query_dim=32, heads=2, dim_head=16, cross_attention_dim=32, processor=proc
    ).eval()
    text, ip = torch.randn(1, 8, 32), [torch.randn(1, 1, 4, 32)]

    def step(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = attn(x, encoder_hidden_states=(text, ip)) * 2 + 1
        return out

    return proc, attn, step, torch.randn(1, 16, 32)


def test_an_ip_adapter_processor_is_a_break_and_a_new_scale_replays() -> None:
    """The processor's __call__ is the break, so a processor attribute changed after capture
    (what ``pipe.set_ip_adapter_scale`` writes) is read at every replay."""
    proc, _, step, x = ip_adapter_step()
    runner = DiTRunner(
        step, attention_classes=(attention_processor.IPAdapterAttnProcessor2_0,), device="cpu"
    )
    replays: list[tuple[float, torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            runner.capture(x)
            assert runner.stats.entries[0].breaks == 1
            for scale in (1.0, 0.0, 0.5):
                proc.scale = [scale]
                fresh = torch.randn_like(x)
                replays.append((scale, fresh, runner(fresh)))
        assert runner.stats.hits == 3 and runner.stats.misses == 0
    finally:
        runner.close()
    assert not _adapted(attention_processor.IPAdapterAttnProcessor2_0, "__call__")
    with torch.no_grad():
        for scale, fresh, got in replays:  # eager, no bcg patch left
            proc.scale = [scale]
            assert torch.equal(got, step(fresh))
        proc.scale = [1.0]
        assert not torch.equal(replays[1][2], step(replays[1][1]))  # the scale matters


# -- 2. a later torch.nn.functional.scaled_dot_product_attention -------------------------------


def _sage_like(calls: list[int]) -> Callable[..., torch.Tensor]:
    """Stands in for a user's kernel (sageattn): a different result than torch's sdpa."""
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any) -> Any:
        calls.append(1)
        return torch_sdpa(q.half().float(), k.half().float(), v, *a, **kw) * 0.5

    return sdpa


def test_a_later_sdpa_replacement_runs_eagerly_and_in_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, step, latents = sd3_model()
    t = torch.ones(1)
    runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    calls: list[int] = []
    try:
        with torch.no_grad():
            runner.capture(latents, t)  # captured with torch's own kernel
            assert runner.stats.entries[0].breaks == 2
            monkeypatch.setattr(
                torch.nn.functional, "scaled_dot_product_attention", _sage_like(calls)
            )
            eager_patched = step(latents, t)  # a plain call with bcg's patch in place
            assert len(calls) == 2
            calls.clear()
            replayed = runner(latents, t)
            assert len(calls) == 2 and runner.stats.hits == 1
    finally:
        runner.close()
    with torch.no_grad():
        expected = step(latents, t)  # the model with the user's kernel and no bcg
    monkeypatch.undo()
    with torch.no_grad():
        assert not torch.equal(step(latents, t), expected)  # the kernel makes a difference
    assert torch.equal(eager_patched, expected)
    assert torch.equal(replayed, expected)


def test_the_f_stand_in_follows_the_live_functional(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _step, _latents = sd3_model()
    with make_attention_ops_breakable(model):
        stand_in = sys.modules["diffusers.models.attention_processor"].F
        assert stand_in is not torch.nn.functional
        assert stand_in.linear is torch.nn.functional.linear
        assert stand_in.__file__ == torch.nn.functional.__file__
        assert "gelu" in dir(stand_in)

        def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
            return x

        monkeypatch.setattr(torch.nn.functional, "gelu", gelu)
        assert stand_in.gelu is gelu  # a name set later is seen
        monkeypatch.setattr(torch.nn.functional, "new_op", gelu, raising=False)
        assert stand_in.new_op is gelu
        monkeypatch.undo()
        assert stand_in.gelu is torch.nn.functional.gelu
        with pytest.raises(AttributeError):
            _ = stand_in.new_op
    assert sys.modules["diffusers.models.attention_processor"].F is torch.nn.functional


# -- 3. DiTRunner over torch.compile(model) ----------------------------------------------------


def _flux_conditions() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
    }


def _compiled(model: nn.Module) -> Callable[..., Any]:
    return torch.compile(model, backend="eager")  # type: ignore[no-any-return]


def _wrapped(model: nn.Module) -> Callable[..., Any]:
    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    return call


@pytest.mark.parametrize("wrap", [_compiled, _wrapped], ids=["torch.compile", "wraps"])
def test_return_dict_is_looked_up_through_wrappers(
    wrap: Callable[[nn.Module], Callable[..., Any]],
) -> None:
    torch._dynamo.reset()
    model, _step, latents = flux_model()
    cond = _flux_conditions()
    runner = DiTRunner(
        wrap(model), breakable_attention=make_attention_ops_breakable(model), device="cpu"
    )
    try:
        with torch.no_grad():
            runner.capture(hidden_states=latents, timestep=torch.tensor([1.0]), **cond)
            for i in range(3):
                t = torch.tensor([1.0 - i / 3])
                fresh = torch.randn_like(latents)
                (got,) = runner(hidden_states=fresh, timestep=t, **cond, return_dict=False)
                (expected,) = model(hidden_states=fresh, timestep=t, **cond, return_dict=False)
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert runner.stats.hits == 3 and runner.stats.misses == 0
    finally:
        runner.close()


def test_capture_many_does_not_report_a_replayed_return_dict_call_as_failed() -> None:
    # The report looked the call up with return_dict still in it, a signature DiTRunner never
    # keys by: a replay (and the second copy of a call) was listed as failed.
    model, _, latents = sd3_model()
    gen = torch.Generator().manual_seed(3)
    call = {
        "hidden_states": latents,
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "return_dict": False,
    }
    with torch.no_grad():
        runner = DiTRunner(
            model, breakable_attention=make_attention_ops_breakable(model), device="cpu"
        )
        try:
            report = runner.capture_many([((), call), ((), call)])
            assert len(report.captured) == 1 and report.failed == ()
            assert runner.capture_many([((), call)]).failed == ()
            assert runner.stats.hits == 2
            want = model(**call)[0]
            assert torch.equal(runner(**call)[0], want)
        finally:
            runner.close()


class _Attn(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1)


def test_a_removed_handle_leaves_a_later_install_alone() -> None:
    first = install_breakable_attention(_Attn)
    first.remove()
    second = install_breakable_attention(_Attn)
    try:
        assert not first.active and second.active
        first.remove()  # removing twice is harmless: the later install stays
        assert second.active and is_breakable_attention_installed(_Attn)
    finally:
        second.remove()
    assert not is_breakable_attention_installed(_Attn)


def test_an_install_that_fails_on_one_class_installs_none() -> None:
    class Ok(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    # A class whose __call__ cannot be set (a builtin type) passes the up-front check.
    with pytest.raises(TypeError) as err:
        install_breakable_attention(Ok, functools.partial)
    assert "installed nothing" in "".join(getattr(err.value, "__notes__", []))
    assert not is_breakable_attention_installed(Ok)
    assert not _adapted(Ok, "forward")
    with install_breakable_attention(Ok):
        assert is_breakable_attention_installed(Ok)


def test_a_subclass_inheriting_an_adapted_method_is_reported_installed() -> None:
    class Base(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class Sub(Base):
        pass

    class Own(Base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    with install_breakable_attention(Base):
        assert is_breakable_attention_installed(Sub)
        assert not is_breakable_attention_installed(Own)
    assert not is_breakable_attention_installed(Sub)


def test_attention_classes_given_one_class_says_to_pass_a_tuple() -> None:
    model, _, _ = sd3_model()
    handle = make_attention_ops_breakable(model)
    with pytest.raises(TypeError, match=r"tuple of classes, e\.g\. attention_classes=\(_Attn,\)"):
        DiTRunner(
            model,
            attention_classes=_Attn,  # type: ignore[arg-type]
            breakable_attention=handle,
            device="cpu",
        )
    assert not handle.active  # the runner owned it, and released it
