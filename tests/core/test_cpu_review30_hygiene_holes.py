"""Every error the public API raises during a capture leaves no capture state behind (session
30): context variables reset, stream hooks uninstalled, the current stream restored, and the
pool usable by a new capture, on the CPU graph backend, in a bare capture and in a runner."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
)
from bcg_core._backends import backend_for  # noqa: PLC2701
from bcg_core._backends.cpu import _CURRENT as _CURRENT_CPU_STREAM  # noqa: PLC2701
from bcg_core._capture.context import active_capture  # noqa: PLC2701
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


_CPU = backend_for("cpu")
_LEFT_OPEN: list[object] = []


@pytest.fixture(autouse=True)
def _close_left_open_blocks() -> object:
    # A runner's failed capture runs the step eagerly, where the stream-switching break leaves
    # its side stream current as it would without bcg: close it after the test. A block
    # entered in a bare capture's break (the capture made its stream current again) puts back
    # the stream of that break when closed this late: the CPU stream is then set back to what
    # it was before the test, which the tests after it would otherwise capture on.
    token = _CURRENT_CPU_STREAM.set(_CURRENT_CPU_STREAM.get())
    yield
    _close_blocks()
    _CURRENT_CPU_STREAM.reset(token)


def _close_blocks() -> None:
    while _LEFT_OPEN:
        _LEFT_OPEN.pop().__exit__(None, None, None)  # type: ignore[attr-defined]


@eager_on_graph(name="hyg.ok")
def _ok(h: torch.Tensor) -> torch.Tensor:
    return h + 1


@eager_on_graph(name="hyg.transpose")
def _transpose(h: torch.Tensor) -> torch.Tensor:
    h.t_()
    return h + 1


@eager_on_graph(name="hyg.quantized")
def _quantized(h: torch.Tensor) -> torch.Tensor:
    return torch.quantize_per_tensor(h, 0.1, 0, torch.quint8)


_SIDE = _CPU.new_stream()


@eager_on_graph(name="hyg.switch")
def _switch(h: torch.Tensor) -> torch.Tensor:
    block = _CPU.stream_context(_SIDE)
    block.__enter__()  # never exited: the side stream stays current
    _LEFT_OPEN.append(block)
    return h + 1


@eager_on_graph(name="hyg.strict", strict=True)
def _strict(h: torch.Tensor) -> torch.Tensor:
    return h + 1


@eager_on_graph(name="hyg.raises")
def _raises(h: torch.Tensor) -> torch.Tensor:
    raise ValueError("a break failed")


def _catch_segment_error(x: torch.Tensor) -> torch.Tensor:
    with contextlib.suppress(RuntimeError):
        (x * 2).sum().item()
    try:
        return _ok(x * 3)
    except RuntimeError:
        return x * 10


def _replay_inside(graph: BreakableCUDAGraph) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        graph.replay()
        return x

    return step


_CASES: dict[str, tuple[type[BaseException], Callable[[torch.Tensor], object]]] = {
    "user error": (ValueError, lambda x: (_ for _ in ()).throw(ValueError("user"))),
    "break raises": (ValueError, lambda x: _raises(x * 2) * 2),
    "break changes an argument's layout": (
        bcg_core.CaptureError,
        lambda x: _transpose(x.view(2, 2) * 2) * 2,
    ),
    "break returns a quantized tensor": (bcg_core.BreakOutputError, lambda x: _quantized(x * 2)),
    "break leaves another stream current": (bcg_core.CaptureError, lambda x: _switch(x * 2) * 2),
    "strict break returns a tensor": (bcg_core.BreakOutputError, lambda x: _strict(x * 2) * 2),
    "segment error caught": (bcg_core.CaptureError, _catch_segment_error),
    "warmup inside": (
        bcg_core.CaptureError,
        lambda x: BreakableCUDAGraph(backend="cpu").warmup().__enter__(),
    ),
}


def _assert_idle(in_graph_before: bool = False) -> None:
    assert not is_breakable_capture_active()
    assert is_in_breakable_cuda_graph() == in_graph_before
    assert active_capture() is None
    assert not hooks_installed()
    assert _CPU.current_stream() is _CPU.current_stream(None)
    assert _CPU.current_stream() is not _SIDE


def _capture(graph: BreakableCUDAGraph, fn: Callable[[], object]) -> object:
    with BreakableCUDAGraphCapture(graph):
        return fn()


def _check_pool_usable(graph: BreakableCUDAGraph) -> None:
    x = torch.arange(4.0)
    graph.reset()
    out = _capture(graph, lambda: _ok(x * 3) * 2)
    shared = BreakableCUDAGraph(backend="cpu")
    with BreakableCUDAGraphCapture(shared, pool=graph.pool()):
        out2 = _ok(x * 5) - 1
    x.copy_(torch.arange(4.0) * 7)
    graph.replay()
    shared.replay()
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, (x * 3 + 1) * 2)
    assert torch.equal(out2, (x * 5 + 1) - 1)


@pytest.mark.parametrize("case", list(_CASES))
def test_an_error_in_a_bare_capture_leaves_nothing_behind(case: str) -> None:
    error, step = _CASES[case]
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    with pytest.raises(error):
        _capture(graph, lambda: step(x))
    _assert_idle()
    assert not graph.is_captured
    _check_pool_usable(graph)
    _assert_idle()


def test_a_replay_inside_a_capture_leaves_nothing_behind() -> None:
    x = torch.arange(4.0)
    other = BreakableCUDAGraph(backend="cpu")
    _capture(other, lambda: _ok(x) * 2)
    graph = BreakableCUDAGraph(backend="cpu")
    with pytest.raises(bcg_core.ReplayError):
        _capture(graph, lambda: _replay_inside(other)(x))
    _assert_idle()
    _check_pool_usable(graph)


@pytest.mark.parametrize("case", list(_CASES))
def test_an_error_in_a_runner_capture_leaves_nothing_behind(case: str) -> None:
    _, step = _CASES[case]
    runner = BreakableGraphRunner(lambda x: step(x), device="cpu")
    x = torch.arange(4.0)
    with contextlib.suppress(Exception):
        runner.capture(x)
    _close_blocks()  # its eager run left the side stream current, as eager does
    _assert_idle()
    # the runner still captures and replays a working step afterwards
    good = BreakableGraphRunner(lambda x: _ok(x * 3) * 2, device="cpu")
    for i in range(3):
        y = torch.arange(4.0) * i
        got = good.capture(y) if i == 0 else good(y)
        assert torch.equal(got, (y * 3 + 1) * 2)
    assert good.stats.captures == 1
    _assert_idle()


@pytest.mark.parametrize("case", list(_CASES))
def test_an_error_under_the_flag_restores_the_flag(case: str) -> None:
    error, step = _CASES[case]
    x = torch.arange(4.0)
    with bcg_core.enable_breakable_cuda_graph():
        before = is_in_breakable_cuda_graph()
        graph = BreakableCUDAGraph(backend="cpu")
        with pytest.raises(error):
            _capture(graph, lambda: step(x))
        _assert_idle(before)


# -- DiTRunner --------------------------------------------------------------------------------


def _dit() -> tuple[Any, type, tuple[torch.Tensor, ...]]:
    from bcg_diffusion._toy_dit import DiTConfig, DiTSelfAttention, ToyDiT  # noqa: PLC2701

    cfg = DiTConfig(hidden=32, depth=2, heads=4, text_dim=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    args = (
        torch.randn(1, cfg.in_channels, 4, 4, generator=gen),
        torch.rand(1, generator=gen) * 1000,
        torch.randn(1, 3, cfg.text_dim, generator=gen),
    )
    return ToyDiT(cfg, seed=0).eval(), DiTSelfAttention, args


def _patch_count(cls: type) -> int:
    return bcg_core.PatchHandle.count(cls, "forward")


_meddle: dict[str, Callable[[], object] | None] = {"call": None}


@eager_on_graph(name="hyg.meddle")
def _meddle_break(h: torch.Tensor) -> torch.Tensor:
    call = _meddle["call"]
    if call is not None:
        call()
    return h


@pytest.mark.parametrize("when", ["error in the model", "close() from a break"])
def test_an_error_in_a_dit_runner_capture_leaves_nothing_behind(when: str) -> None:
    from bcg_diffusion import DiTRunner

    model, attention, args = _dit()
    before = _patch_count(attention)
    runner = DiTRunner(model, attention_classes=(attention,), device="cpu")
    assert _patch_count(attention) == before + 1

    def meddle() -> None:
        _meddle["call"] = None  # once: the failed capture's eager run calls the break again
        if when == "close() from a break":
            runner.close()
        else:
            raise ValueError("the model failed")

    hook = model.blocks[0].register_forward_hook(lambda m, i, o: _meddle_break(o))
    _meddle["call"] = meddle
    try:
        with torch.no_grad(), contextlib.suppress(Exception):
            runner.capture(*args)
    finally:
        _meddle["call"] = None
    _assert_idle()
    assert _patch_count(attention) == before + 1  # close() from a break released nothing
    with torch.no_grad():
        runner.reset()
        got = runner.capture(*args)
        torch.testing.assert_close(got, model(*args), rtol=0, atol=0)
        again = runner(*args)
        torch.testing.assert_close(again, model(*args), rtol=0, atol=0)
    assert runner.stats.captures >= 1
    hook.remove()
    runner.close()
    assert _patch_count(attention) == before
    _assert_idle()


def test_a_dit_runner_that_fails_to_build_releases_its_patches() -> None:
    from bcg_diffusion import DiTRunner, make_attention_ops_breakable

    model, attention, _ = _dit()
    before = _patch_count(attention)
    with pytest.raises(TypeError):
        DiTRunner(model, attention_classes=(attention,), device="cpu", no_such_option=1)
    assert _patch_count(attention) == before
    handle = make_attention_ops_breakable(model)
    with pytest.raises((TypeError, ValueError)):
        DiTRunner(
            model,
            attention_classes=attention,  # type: ignore[arg-type]  # the class, not a tuple
            breakable_attention=handle,
            device="cpu",
        )
    assert not handle.active
    assert _patch_count(attention) == before


# -- errors raised entering a capture, and at replay -----------------------------------------


def _enter_errors(graph: BreakableCUDAGraph) -> dict[str, Callable[[], object]]:
    return {
        "nested capture": lambda: BreakableCUDAGraphCapture(
            BreakableCUDAGraph(backend="cpu")
        ).__enter__(),
        "same graph again": lambda: BreakableCUDAGraphCapture(graph).__enter__(),
        "reset while capturing": graph.reset,
        "bad pool": lambda: BreakableCUDAGraphCapture(graph, pool=object()),
        "bad mode": lambda: BreakableCUDAGraphCapture(graph, capture_error_mode="nope"),
        "disabled": lambda: _capture_disabled(),
    }


def _capture_disabled() -> None:
    with bcg_core.disable_breakable_graphs():
        BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu")).__enter__()


@pytest.mark.parametrize("case", list(_enter_errors(BreakableCUDAGraph(backend="cpu"))))
def test_an_error_caught_inside_a_capture_leaves_the_capture_working(case: str) -> None:
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    refused = _enter_errors(graph)[case]

    def step() -> torch.Tensor:
        h = x * 3
        with pytest.raises((bcg_core.BreakableGraphError, TypeError, ValueError, RuntimeError)):
            refused()
        assert is_breakable_capture_active() and hooks_installed()
        return _ok(h) * 2

    out = _capture(graph, step)
    _assert_idle()
    x.copy_(torch.arange(4.0) * 7)
    graph.replay()
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, (x * 3 + 1) * 2)


_at_replay: dict[str, object] = {"mode": None}


@eager_on_graph(name="hyg.changes_at_replay")
def _changes_at_replay(h: torch.Tensor) -> torch.Tensor:
    mode = _at_replay["mode"]
    if mode == "raise":
        raise ValueError("a break failed at replay")
    if mode == "shape":
        return torch.cat([h, h]) + 1
    if mode == "none":
        return None  # type: ignore[return-value]
    return h + 1


@pytest.mark.parametrize("mode", ["raise", "shape", "none"])
def test_an_error_at_replay_leaves_nothing_behind(mode: str) -> None:
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    out = _capture(graph, lambda: _changes_at_replay(x * 3) * 2)
    _at_replay["mode"] = mode
    try:
        with pytest.raises((ValueError, bcg_core.BreakOutputError)):
            graph.replay()
    finally:
        _at_replay["mode"] = None
    _assert_idle()
    x.copy_(torch.arange(4.0) * 5)
    graph.replay()
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, (x * 3 + 1) * 2)
    with bcg_core.enable_breakable_cuda_graph():
        _at_replay["mode"] = mode
        try:
            with pytest.raises((ValueError, bcg_core.BreakOutputError)):
                graph.replay()
        finally:
            _at_replay["mode"] = None
        _assert_idle(True)
    _check_pool_usable(graph)


# -- the diagnostics, whose captures fail by design ------------------------------------------


@pytest.mark.parametrize("case", list(_CASES))
def test_check_capture_and_check_divergence_leave_nothing_behind(case: str) -> None:
    _, step = _CASES[case]
    x = torch.arange(4.0)
    with contextlib.suppress(Exception):
        bcg_core.check_capture(step, x)
    _close_blocks()
    _assert_idle()
    with contextlib.suppress(Exception):
        bcg_core.check_divergence(step, [(x,), (x + 1,)], backend="cpu")
    _close_blocks()
    _assert_idle()
    _check_pool_usable(BreakableCUDAGraph(backend="cpu"))


# -- blocks left more often than entered (a guard that must hold under python -O) ------------


@pytest.mark.parametrize(
    "make",
    [
        bcg_core.enable_breakable_cuda_graph,
        bcg_core.disable_breakable_graphs,
        lambda: BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu")),
    ],
    ids=["enable_breakable_cuda_graph", "disable_breakable_graphs", "capture"],
)
def test_a_block_exited_more_often_than_entered_says_so(make: Callable[[], object]) -> None:
    # A flag block exited without an enter raised a raw IndexError ("pop from empty list"); a
    # capture a bare AssertionError from an assert, which python -O strips (then a raw
    # TypeError from `with None`).
    block = make()
    flag = is_in_breakable_cuda_graph()
    with pytest.raises(RuntimeError, match="more times than it was entered"):
        block.__exit__(None, None, None)  # type: ignore[attr-defined]
    with block:  # type: ignore[attr-defined]
        pass
    with pytest.raises(RuntimeError, match="more times than it was entered"):
        block.__exit__(None, None, None)  # type: ignore[attr-defined]
    _assert_idle(flag)


def test_the_exit_guards_hold_under_python_O() -> None:
    import subprocess
    import sys

    code = (
        "import bcg_core as b\n"
        "for m in (lambda: b.BreakableCUDAGraphCapture(b.BreakableCUDAGraph(backend='cpu')),"
        " b.disable_breakable_graphs):\n"
        "    try:\n"
        "        m().__exit__(None, None, None)\n"
        "    except RuntimeError as e:\n"
        "        if 'more times than it was entered' not in str(e):\n"
        "            raise SystemExit(repr(e)) from None\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- errors from capture options and from the warm-up block -----------------------------------


def _stub_raises(h: torch.Tensor) -> torch.Tensor:
    raise ValueError("the stub failed")


@eager_on_graph(name="hyg.stubbed", capture_stub=_stub_raises)
def _stubbed(h: torch.Tensor) -> torch.Tensor:
    return h + 1


_CACHE: list[torch.Tensor] = []


@eager_on_graph(name="hyg.leaks")
def _leaks(h: torch.Tensor) -> torch.Tensor:
    _CACHE.append(h * 7)  # a tensor made here and kept: reported under debug
    return h + 1


@eager_on_graph(name="hyg.interrupted")
def _interrupted(h: torch.Tensor) -> torch.Tensor:
    raise KeyboardInterrupt


def _barrier_raises() -> None:
    raise ValueError("the barrier failed")


_OPTION_CASES: dict[str, tuple[dict[str, Any], Callable[[torch.Tensor], object]]] = {
    "barrier raises": ({"barrier_fn": _barrier_raises}, lambda x: _ok(x * 2)),
    "capture stub raises": ({}, lambda x: _stubbed(x * 2)),
    "strict debug leak": ({"debug": "strict"}, lambda x: _leaks(x * 2)),
    "interrupt in a break": ({}, lambda x: _interrupted(x * 2)),
}


@pytest.mark.parametrize("case", list(_OPTION_CASES))
def test_an_error_from_a_capture_option_leaves_nothing_behind(case: str) -> None:
    options, step = _OPTION_CASES[case]
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises((ValueError, KeyboardInterrupt, bcg_core.CaptureError)),
        BreakableCUDAGraphCapture(graph, **options),
    ):
        step(x)
    _CACHE.clear()
    _assert_idle()
    _check_pool_usable(graph)


def test_an_error_in_the_warmup_block_leaves_nothing_behind() -> None:
    graph = BreakableCUDAGraph(backend="cpu")
    before = _CPU.current_stream()
    with pytest.raises(ValueError, match="warm-up"), graph.warmup():
        raise ValueError("warm-up failed")
    assert _CPU.current_stream() is before
    _assert_idle()
    _check_pool_usable(graph)


# -- runner methods refused from a break of the runner's own replay --------------------------

_runner_call: dict[str, Callable[[], object] | None] = {"call": None}


@eager_on_graph(name="hyg.runner_meddle")
def _runner_meddle(h: torch.Tensor) -> torch.Tensor:
    call = _runner_call["call"]
    if call is not None:
        call()
    return h + 1


@pytest.mark.parametrize("method", ["reset", "check_divergence", "call", "capture"])
def test_a_runner_method_refused_from_its_replay_leaves_nothing_behind(method: str) -> None:
    runner = BreakableGraphRunner(lambda x: _runner_meddle(x * 3) * 2, device="cpu")
    x = torch.arange(4.0)
    runner.capture(x)
    calls: dict[str, Callable[[], object]] = {
        "reset": runner.reset,
        "check_divergence": lambda: runner.check_divergence(x, x + 1),
        "call": lambda: runner(x),
        "capture": lambda: runner.capture(x),
    }
    _runner_call["call"] = calls[method]
    try:
        with contextlib.suppress(Exception):
            runner(x)
    finally:
        _runner_call["call"] = None
    _assert_idle()
    hits = runner.stats.hits
    for i in range(3):
        y = torch.arange(4.0) * (i + 2)
        assert torch.equal(runner(y), (y * 3 + 1) * 2)
    assert runner.stats.hits == hits + 3
    _assert_idle()


def _changes_its_container(cfg: dict[str, int], x: torch.Tensor) -> torch.Tensor:
    cfg["n"] = cfg.get("n", 0) + 1
    return x * 2


def test_a_step_changing_its_container_runs_eagerly_leaving_nothing_behind() -> None:
    runner = BreakableGraphRunner(_changes_its_container, device="cpu")
    cfg: dict[str, int] = {}
    for i in range(3):
        x = torch.full((2,), float(i))
        got = runner.capture(cfg, x) if i == 0 else runner(cfg, x)
        assert torch.equal(got, x * 2)
        _assert_idle()
    assert cfg["n"] == 3  # every call's change reached the caller, as eagerly


# -- a replay token scope left in another context -----------------------------------------


def test_a_replay_token_scope_left_in_another_context_raises_nothing() -> None:
    # A scope held open across a yield and closed from another context (a generator's or an
    # async generator's finaliser) raised contextvars' raw ValueError ("created in a different
    # Context"); bcg_core's flag blocks and captures leave quietly there (the leaving context
    # never saw the token).
    import contextvars

    from bcg_diffusion import get_current_replay_token, replay_token_scope

    def scoped() -> Any:
        with replay_token_scope() as token:
            yield token

    gen = scoped()
    entered = contextvars.copy_context()
    token = entered.run(next, gen)
    assert entered.run(get_current_replay_token) == token
    contextvars.copy_context().run(gen.close)
    assert get_current_replay_token() is None
