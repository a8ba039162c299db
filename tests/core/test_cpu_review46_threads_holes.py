"""Threads and failures in code review 45's session added (review 46), on the CPU graph
backend: DiTRunner's model-change counter read by two threads at once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from thread_helpers import run_threads


def test_a_call_after_a_processor_change_never_replays_the_old_processors() -> None:
    """Two threads call one DiTRunner after set_attn_processor: the first marked the change
    seen before reading the model's new state, so the second, arriving while it read, took the
    capture's state as current and replayed the old processors (silently the old output)."""
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from bcg_diffusion import DiTRunner, make_attention_ops_breakable

    class Scaled(FluxAttnProcessor):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(*args, **kwargs)
            return tuple(2 * o for o in out) if isinstance(out, tuple) else 2 * out

    reading = threading.Event()
    answered = threading.Event()
    slow_thread: list[threading.Thread] = []

    class SlowToRead(torch.nn.Module):
        """An attention-like module (it has set_processor) whose processor the first thread
        reads slowly: it waits there until the second thread's call has returned."""

        def set_processor(self, processor: Any) -> None:
            pass

        @property
        def processor(self) -> None:
            if slow_thread and threading.current_thread() is slow_thread[0]:
                reading.set()
                answered.wait(10)
            return None

    model, inputs = _tiny_flux()
    model.add_module("slow", SlowToRead())
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    got: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            runner.capture(**inputs)
            plain = runner(**inputs).sample.clone()
            model.set_attn_processor(Scaled())
            expected = model(**inputs).sample
            assert not torch.equal(expected, plain)  # the processor changes the output

            def first() -> None:
                slow_thread.append(threading.current_thread())
                got["first"] = runner(**inputs).sample.clone()

            def second() -> None:
                try:
                    assert reading.wait(10), "the first call never read the model's state"
                    got["second"] = runner(**inputs).sample.clone()
                finally:
                    answered.set()

            run_threads([first, second], timeout=60)
    finally:
        runner.close()
    assert torch.equal(got["first"], expected)
    assert torch.equal(got["second"], expected), "the capture's processors replayed"


def test_a_stance_set_during_a_capture_stays_after_it() -> None:
    """The capture's force_eager stance is process-wide: a stance another thread (or the
    captured code) set with torch.compiler.set_stance while it was open was overwritten with
    the one before the capture when it closed (silently the user's stance gone)."""
    import torch._dynamo

    from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture

    x = torch.randn(4)
    graph = BreakableCUDAGraph(backend="cpu")
    try:
        with BreakableCUDAGraphCapture(graph):
            y = x * 2
            run_threads([lambda: torch.compiler.set_stance("eager_on_recompile")], timeout=30)
        assert torch._dynamo.eval_frame._stance.stance == "eager_on_recompile"
    finally:
        torch.compiler.set_stance("default")
    graph.replay()
    assert torch.equal(y, x * 2)


def test_a_call_whose_state_read_raised_does_not_leave_the_change_marked_seen() -> None:
    """A call that raised while reading the model's state after set_attn_processor (here an
    interrupt-like error from a module's processor) had marked the change seen already: the
    next call took the capture's state as current and replayed the old processors."""
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from bcg_diffusion import DiTRunner, make_attention_ops_breakable

    class Scaled(FluxAttnProcessor):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(*args, **kwargs)
            return tuple(2 * o for o in out) if isinstance(out, tuple) else 2 * out

    fail = [False]

    class Failing(torch.nn.Module):
        def set_processor(self, processor: Any) -> None:
            pass

        @property
        def processor(self) -> None:
            if fail[0]:
                fail[0] = False
                raise KeyboardInterrupt
            return None

    model, inputs = _tiny_flux()
    model.add_module("failing", Failing())
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            runner.capture(**inputs)
            model.set_attn_processor(Scaled())
            expected = model(**inputs).sample
            fail[0] = True
            with pytest.raises(KeyboardInterrupt):
                runner(**inputs)
            got = runner(**inputs).sample
    finally:
        runner.close()
    assert torch.equal(got, expected), "the capture's processors replayed"


def test_a_graph_captured_after_a_reset_in_a_window_is_not_replayed_under_other_ones() -> None:
    """reset() (here from the same thread; as well another thread's) while a warm-up window was
    open: the window's next call captured again, but the runner kept no state for it (reset
    forgot the capture's), so a call under another processor replayed that graph."""
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from bcg_diffusion import DiTRunner, make_attention_ops_breakable

    class Scaled(FluxAttnProcessor):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(*args, **kwargs)
            return tuple(2 * o for o in out) if isinstance(out, tuple) else 2 * out

    model, inputs = _tiny_flux()
    runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model), device="cpu")
    try:
        with torch.no_grad():
            with runner.warmup():
                runner(**inputs)
                runner.reset()
                runner(**inputs)
            assert len(runner.stats.entries) == 1  # captured again in the window
            model.set_attn_processor(Scaled())
            expected = model(**inputs).sample
            got = runner(**inputs).sample
    finally:
        runner.close()
    assert torch.equal(got, expected), "the plain processors' graph replayed"


def _tiny_flux() -> tuple[Any, dict[str, torch.Tensor]]:
    """A one-block Flux (random weights, eval) and its inputs."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "timestep": torch.rand(1, generator=gen),
        "img_ids": torch.randn(16, 3, generator=gen),
        "txt_ids": torch.zeros(8, 3),
    }
    return model, inputs
