"""DiTRunner called from several threads on the CPU graph backend (the toy DiT): replays
bitwise equal to eager, and close() racing another thread's call."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from thread_helpers import run_threads

from bcg_core import BreakableGraphRunner
from bcg_diffusion import DiTRunner, is_breakable_attention_installed, uninstall_breakable_attention
from bcg_diffusion._toy_dit import DiTConfig, DiTSelfAttention, ToyDiT  # noqa: PLC2701

CFG = DiTConfig(hidden=32, depth=2, heads=2, text_dim=16, dtype=torch.float32)
_TIMEOUT = 20.0


@pytest.fixture(autouse=True)
def _unpatch() -> Iterator[None]:
    yield
    uninstall_breakable_attention(DiTSelfAttention)


def _inputs(seed: int, res: int = 4) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, CFG.in_channels, res, res, generator=gen)
    t = torch.rand(2, generator=gen) * 1000
    text = torch.randn(2, 3, CFG.text_dim, generator=gen)
    return latents, t, text


def _run_threads(targets: list[Callable[[], None]]) -> None:
    def no_grad(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                target()

        return run

    run_threads([no_grad(t) for t in targets], _TIMEOUT)


def test_two_dit_runners_on_one_class_replay_from_threads_while_one_closes() -> None:
    """Two runners patch the same attention class; four threads replay both, then one thread
    closes the first while the others go on with the second: its breaks stay installed."""
    model = ToyDiT(CFG, seed=0).eval()
    first = DiTRunner(model, attention_classes=(DiTSelfAttention,), device="cpu")
    second = DiTRunner(model, attention_classes=(DiTSelfAttention,), device="cpu")
    with torch.no_grad():
        for runner in (first, second):
            runner.capture(*_inputs(0))
            runner.capture(*_inputs(0, res=2))
    start, closed = threading.Barrier(4), threading.Event()

    def worker(k: int) -> None:
        start.wait(_TIMEOUT)
        for i in range(6):
            args = _inputs(10 * k + i, res=(2, 4)[i % 2])
            runner = second if closed.is_set() or (i + k) % 2 else first
            assert torch.equal(runner(*args), model(*args))
        if k == 0:
            first.close()
            closed.set()

    _run_threads([lambda k=k: worker(k) for k in range(4)])
    assert is_breakable_attention_installed(DiTSelfAttention)
    with torch.no_grad():
        args = _inputs(99)
        assert torch.equal(second(*args), model(*args))
    assert first.stats.entries == () and second.stats.failed_captures == 0
    second.close()
    assert not is_breakable_attention_installed(DiTSelfAttention)


def test_a_capture_on_another_thread_during_close_is_not_kept() -> None:
    """close() resets the runner, then marks it disabled. Another thread's call in a warm-up
    window that got the runner between the two captured a graph that the closed runner then
    kept (entries and memory after close(), which promises to drop all graphs). The closing
    thread is stopped right there (a trace function on the base reset's return)."""
    model = ToyDiT(CFG, seed=0).eval()
    runner = DiTRunner(model, attention_classes=(DiTSelfAttention,), device="cpu")
    base_reset = BreakableGraphRunner.reset
    at_gap, called = threading.Event(), threading.Event()
    args = _inputs(1)
    got: list[torch.Tensor] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is base_reset.__code__:
            if event == "return" and not at_gap.is_set():
                at_gap.set()
                assert called.wait(_TIMEOUT)
            return trace
        return None

    def closer() -> None:

        sys.settrace(trace)
        try:
            runner.close()
        finally:
            sys.settrace(None)

    def caller() -> None:
        assert at_gap.wait(_TIMEOUT)
        try:
            got.append(runner(*args))
        finally:
            called.set()

    with runner.warmup():
        _run_threads([closer, caller])
    with torch.no_grad():
        assert torch.equal(got[0], model(*args))
    assert runner.stats.entries == (), "the closed runner kept a graph captured during close()"
    assert runner.disabled_reason is not None
