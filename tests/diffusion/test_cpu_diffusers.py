"""Real diffusers transformers (tiny, random weights, float32) on the CPU graph backend: every
attention op is a break, projections stay captured, replays equal eager bit for bit; the
reference-counted patches behind it."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701

from bcg_core import enable_breakable_cuda_graph
from bcg_diffusion import (
    DiTRunner,
    PatchHandle,
    install_breakable_attention,
    is_breakable_attention_installed,
    make_attention_ops_breakable,
    patch_attribute,
    uninstall_breakable_attention,
)

diffusers = pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _CountSDPA(TorchDispatchMode):
    """Counts the attention kernels an eager forward runs (independently of bcg's patches)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "scaled_dot_product" in func.__name__:
            self.count += 1
        return func(*args, **(kwargs or {}))


def flux_model(
    device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, Step, torch.Tensor]:
    """Flux, 2 dual + 2 single blocks: the dispatch-function family."""
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).to(device, dtype).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    text = torch.randn(1, 8, 32, generator=gen).to(device, dtype)
    pooled = torch.randn(1, 32, generator=gen).to(device, dtype)
    img_ids, txt_ids = torch.zeros(16, 3, device=device), torch.zeros(8, 3, device=device)

    def step(latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled,
            timestep=t, img_ids=img_ids, txt_ids=txt_ids, return_dict=False,
        )[0]  # fmt: skip
        return out

    return model, step, torch.randn(1, 16, 4, generator=gen).to(device, dtype)


def sd3_model(
    device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, Step, torch.Tensor]:
    """SD3, 2 joint blocks: processors calling F.scaled_dot_product_attention."""
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
    ).to(device, dtype).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    text = torch.randn(1, 8, 32, generator=gen).to(device, dtype)
    pooled = torch.randn(1, 32, generator=gen).to(device, dtype)

    def step(latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled,
            timestep=t * 1000, return_dict=False,
        )[0]  # fmt: skip
        return out

    return model, step, torch.randn(1, 4, 8, 8, generator=gen).to(device, dtype)


MODELS: dict[str, Callable[..., tuple[nn.Module, Step, torch.Tensor]]] = {
    "flux": flux_model,
    "sd3": sd3_model,
}


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def wan_model(
    device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, Step, torch.Tensor]:
    """Wan 2.1, 2 blocks (video latents): dispatch function, self and cross attention."""
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
    ).to(device, dtype).eval()  # fmt: skip
    text = _randn(1, 8, 32).to(device, dtype)

    def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            hidden_states=x, timestep=t * 1000, encoder_hidden_states=text, return_dict=False
        )[0]
        return out

    return model, step, _randn(1, 4, 2, 8, 8).to(device, dtype)


def pixart_model() -> tuple[nn.Module, Step, torch.Tensor]:
    """PixArt-alpha, 2 blocks: processors calling F.scaled_dot_product_attention."""
    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=32,
        norm_type="ada_norm_single", use_additional_conditions=False,
    ).eval()  # fmt: skip
    text = _randn(1, 8, 32)
    no_conditions = {"resolution": None, "aspect_ratio": None}

    def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            x, encoder_hidden_states=text, timestep=t * 1000,
            added_cond_kwargs=no_conditions, return_dict=False,
        )[0]  # fmt: skip
        return out

    return model, step, _randn(1, 4, 8, 8)


def ltx_model() -> tuple[nn.Module, Step, torch.Tensor]:
    """LTX-Video, 2 blocks, with a text attention mask."""
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=16, cross_attention_dim=32, num_layers=2, caption_channels=32,
    ).eval()  # fmt: skip
    text, mask = _randn(1, 8, 32), torch.ones(1, 8)

    def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            hidden_states=x, encoder_hidden_states=text, timestep=t * 1000,
            encoder_attention_mask=mask, num_frames=2, height=4, width=4, return_dict=False,
        )[0]  # fmt: skip
        return out

    return model, step, _randn(1, 32, 4)


# More families, CPU only (the CUDA suite runs MODELS).
MORE_MODELS: dict[str, Callable[[], tuple[nn.Module, Step, torch.Tensor]]] = {
    "ltx": ltx_model,
    "pixart": pixart_model,
    "wan": wan_model,
}


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


def attention_ops(step: Step, latents: torch.Tensor) -> int:
    with torch.no_grad(), _CountSDPA() as counter:
        step(latents, torch.ones(1, device=latents.device))
    return counter.count


def euler(step: Step, latents: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """A flow-matching Euler loop; every model output along the way."""
    outs = []
    for i in range(steps):
        t = torch.full((1,), 1.0 - i / steps, device=latents.device)
        v = step(latents, t)
        outs.append(v)
        latents = latents - v / steps
    return outs


@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_attention_op_is_a_break_and_replays_equal_eager(family: str) -> None:
    model, step, latents = MODELS[family]()
    ops = attention_ops(step, latents)
    assert ops == 4 if family == "flux" else ops == 2
    runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            runner.capture(latents, torch.ones(1))
            (entry,) = runner.stats.entries
            assert entry.breaks == ops
            assert entry.segments == ops + 1  # projections before and after each op are captured
            expected = euler(step, latents, 4)
            got = euler(runner, latents, 4)
        assert runner.stats.hits == 4 and runner.stats.misses == 0
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)
    finally:
        runner.close()
    _assert_unpatched()


@pytest.mark.parametrize("family", sorted(MORE_MODELS))
def test_more_families_break_at_every_attention_op(family: str) -> None:
    model, step, latents = MORE_MODELS[family]()
    ops = attention_ops(step, latents)
    assert ops == 4  # self and cross attention in each of 2 blocks
    runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            runner.capture(latents, torch.ones(1))
            assert runner.stats.entries[0].breaks == ops
            expected, got = euler(step, latents, 3), euler(runner, latents, 3)
        assert runner.stats.hits == 3
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)
    finally:
        runner.close()


def _assert_unpatched() -> None:
    """Every name make_attention_ops_breakable patches in these models is back."""
    from diffusers.models import attention_dispatch

    flux = sys.modules["diffusers.models.transformers.transformer_flux"]
    assert flux.dispatch_attention_fn is attention_dispatch.dispatch_attention_fn
    for name in ("diffusers.models.attention_processor", "diffusers.models.embeddings"):
        assert sys.modules[name].F is torch.nn.functional


def test_patches_are_reference_counted_across_runners() -> None:
    model, step, latents = flux_model()
    module = sys.modules[type(model).__module__]
    original = module.dispatch_attention_fn
    first = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    second = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        first.close()  # the other runner keeps its breaks
        assert module.dispatch_attention_fn is not original
        with torch.no_grad():
            second.capture(latents, torch.ones(1))
            assert second.stats.entries[0].breaks == 4
            assert torch.equal(second(latents, torch.ones(1)), step(latents, torch.ones(1)))
    finally:
        second.close()
        first.close()
    assert module.dispatch_attention_fn is original
    _assert_unpatched()


def test_two_handles_remove_one_breaks_remain() -> None:
    model, step, latents = sd3_model()
    a = make_attention_ops_breakable(model)
    b = make_attention_ops_breakable(model)
    a.remove()
    a.remove()
    assert not a.active and b.active
    runner = DiTRunner(step, device="cpu")
    try:
        with torch.no_grad():
            runner.capture(latents, torch.ones(1))
        assert runner.stats.entries[0].breaks == 2
    finally:
        runner.close()
        b.remove()
    _assert_unpatched()


def test_processor_class_call_is_a_break() -> None:
    """install_breakable_attention takes a processor class (its __call__ is the break); the
    projections inside it then run eagerly too, which is why make_attention_ops_breakable
    exists."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    _model, step, latents = flux_model()
    with torch.no_grad():
        expected = step(latents, torch.ones(1))
    runner = DiTRunner(step, attention_classes=(FluxAttnProcessor,), device="cpu")
    try:
        assert is_breakable_attention_installed(FluxAttnProcessor)
        with torch.no_grad():
            runner.capture(latents, torch.ones(1))
            assert runner.stats.entries[0].breaks == 4
            assert torch.equal(runner(latents, torch.ones(1)), expected)
    finally:
        runner.close()
    assert not is_breakable_attention_installed(FluxAttnProcessor)
    with install_breakable_attention(FluxAttnProcessor):
        assert "__call__" in vars(FluxAttnProcessor)
    assert is_breakable_attention_installed(FluxAttnProcessor) is False
    uninstall_breakable_attention(FluxAttnProcessor)


def test_model_without_attention_ops_is_refused() -> None:
    with pytest.raises(ValueError, match="found no attention op in Linear"):
        make_attention_ops_breakable(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="takes the handle"):
        DiTRunner(nn.Linear(2, 2), breakable_attention=object())  # type: ignore[arg-type]


# -- the patch primitive -----------------------------------------------------------------------


def _double(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *a, **k: 2 * fn(*a, **k)


def _plus_one(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *a, **k: fn(*a, **k) + 1


class _Proc:
    def __call__(self, x: int) -> int:
        return x

    @staticmethod
    def scale(x: int) -> int:
        return 3 * x


class _SubProc(_Proc):
    pass


def test_patch_targets_a_module_function_a_class_method_and_an_instance() -> None:
    this = sys.modules[__name__]
    with patch_attribute(__name__, "_helper", _double):
        assert this._helper(5) == 10
    assert this._helper(5) == 5

    with patch_attribute(_SubProc, "__call__", _double) as handle:
        assert isinstance(handle, PatchHandle) and handle.active
        assert _SubProc()(4) == 8 and _Proc()(4) == 4
    assert "__call__" not in vars(_SubProc)  # inherited: the patch is deleted, not restored

    with patch_attribute(_Proc, "scale", _plus_one):
        assert _Proc.scale(2) == 7 and _Proc().scale(2) == 7  # still a staticmethod
    assert isinstance(vars(_Proc)["scale"], staticmethod)

    one, other = _Proc(), _Proc()
    with patch_attribute(one, "scale", _double):
        assert one.scale(1) == 6 and other.scale(1) == 3
    assert "scale" not in vars(one)
    with pytest.raises(AttributeError):
        patch_attribute(_Proc, "missing", _double)


def _helper(x: int) -> int:
    return x


def test_different_wraps_stack_and_release_in_any_order() -> None:
    this = sys.modules[__name__]
    a = patch_attribute(this, "_helper", _double)
    b = patch_attribute(this, "_helper", _plus_one)
    shared = patch_attribute(this, "_helper", _double)
    assert this._helper(5) == 11  # plus_one(double(f))
    a.remove()
    assert this._helper(5) == 11  # `shared` still holds the double
    shared.remove()
    assert this._helper(5) == 6
    b.remove()
    assert this._helper is _helper


def test_a_patch_replaced_by_other_code_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    original = vars(_Proc)["__call__"]
    handle = patch_attribute(_Proc, "__call__", _double)

    def theirs(self: _Proc, x: int) -> int:
        return -x

    _Proc.__call__ = theirs  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="bcg_core"):
            handle.remove()
        assert "replaced by other code" in caplog.text
        assert _Proc.__call__ is theirs
    finally:
        _Proc.__call__ = original  # type: ignore[method-assign]


def test_patched_ops_pass_through_without_the_flag() -> None:
    model, step, latents = flux_model()
    with torch.no_grad():
        expected = step(latents, torch.ones(1))
        with make_attention_ops_breakable(model):
            assert torch.equal(step(latents, torch.ones(1)), expected)
            with enable_breakable_cuda_graph():  # no capture: the breaks are plain calls
                assert torch.equal(step(latents, torch.ones(1)), expected)
