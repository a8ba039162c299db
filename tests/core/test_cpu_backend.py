"""The CPU graph backend: breakable graphs on CPU tensors with CUDA graph semantics.

The scenarios marked with the ``device`` fixture are shared: they run on the CPU backend
everywhere and on CUDA graphs where a GPU is present, with the same assertions.

Capture records each segment's aten operations; replay re-runs them against the captured
storage. Every test checks replay against eager over several replays with new values written
into the static inputs, or checks that a host synchronisation inside a segment is refused the
way CUDA refuses it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from graph_helpers import capture as _capture
from graph_helpers import device_graph as _graph

import bcg_core
from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    CaptureCheck,
    CaptureError,
    ReplayError,
    break_graph,
    check_capture,
    eager_on_graph,
    enable_breakable_cuda_graph,
    get_current_stream,
    is_breakable_capture_active,
)
from bcg_core._backends import backend_for  # noqa: PLC2701
from bcg_core._backends.cpu import CpuBackend, CpuStream  # noqa: PLC2701
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701
from bcg_core._errors import HostSyncError  # noqa: PLC2701
from bcg_core.bench import ToyDecoder, tiny_config

REPLAYS = 4


def _line_of(marker: str) -> int:
    """The number of the line of this file that ends with the comment ``# marker``."""
    with open(__file__, encoding="utf-8") as source:
        for number, line in enumerate(source, start=1):
            if line.rstrip().endswith(f"# {marker}"):
                return number
    raise AssertionError(f"no line marked {marker!r}")


@pytest.fixture()
def x() -> torch.Tensor:
    return torch.randn(4, 8)


def _new_values(*static: torch.Tensor) -> Iterator[int]:
    gen = torch.Generator().manual_seed(123)
    for i in range(REPLAYS):
        for t in static:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype, device="cpu"))
        yield i


# -- selection -------------------------------------------------------------------------------


def test_backend_selection_and_validation() -> None:
    assert isinstance(backend_for("cpu"), CpuBackend)
    assert backend_for("cpu").device_type == "cpu" and backend_for("cuda").device_type == "cuda"
    assert BreakableCUDAGraph(backend="cpu").backend == "cpu"
    assert BreakableCUDAGraph().backend == "cuda"
    with pytest.raises(ValueError, match=r"backend must be 'cuda' or 'cpu'.*'mps'"):
        BreakableCUDAGraph(backend="mps")
    with pytest.raises(CaptureError, match="no breakable graph backend for device type 'xla'"):
        backend_for("xla")
    assert "check_capture" in bcg_core.__all__


def test_cpu_streams_are_distinct_and_never_collide_with_cuda_handles() -> None:
    backend = backend_for("cpu")
    a, b = backend.new_stream(), backend.new_stream()
    assert isinstance(a, CpuStream) and a.cuda_stream != b.cuda_stream
    assert a.cuda_stream < 0 and b.cuda_stream < 0
    a.wait_stream(b)  # no-ops
    b.synchronize()
    with backend.stream_context(a):
        assert backend.current_stream() is a
    assert backend.current_stream() is not a
    with pytest.raises(CaptureError, match="captures on its own streams"):
        backend.capture_info("not a stream")


# -- capture and replay equal eager --------------------------------------------------------------


@pytest.mark.usefixtures("device")
def test_elementwise_and_matmul_chain(x: torch.Tensor) -> None:
    w = torch.randn(8, 16)
    b = torch.randn(16)

    def f() -> torch.Tensor:
        h = torch.tanh(x @ w + b)
        h = F.gelu(h * 2 - 1).softmax(-1)
        return (h.sum(0, keepdim=True) / 3).exp()

    graph, out = _capture(f)
    assert graph.num_segments == 1 and graph.num_breaks == 0
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(out, f())


@pytest.mark.usefixtures("device")
def test_in_place_ops_and_views(x: torch.Tensor) -> None:
    acc = torch.zeros(4, 8)

    def f() -> torch.Tensor:
        acc.zero_()
        acc.add_(x).mul_(3)
        v = acc.view(2, 16)  # view: aliases acc
        v[0].clamp_(min=0)  # in-place through a view
        t = acc.t()
        t.unsqueeze_(0)  # metadata mutation, not re-run at replay
        return t * 2

    graph, out = _capture(f)
    out_storage = out.untyped_storage().data_ptr()
    for _ in _new_values(x):
        graph.replay()
        expected_acc = x * 3
        expected_acc.view(2, 16)[0].clamp_(min=0)
        assert torch.equal(acc, expected_acc)
        assert out.shape == (1, 8, 4)
        assert torch.equal(out, expected_acc.t().unsqueeze(0) * 2)
        assert out.untyped_storage().data_ptr() == out_storage


@pytest.mark.usefixtures("device")
def test_views_alias_captured_storage(x: torch.Tensor) -> None:
    def f() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x + 1
        return y, y.view(-1), y[1:, ::2].transpose(0, 1)

    graph, (y, flat, strided) = _capture(f)
    ptr = y.untyped_storage().data_ptr()
    assert flat.untyped_storage().data_ptr() == ptr == strided.untyped_storage().data_ptr()
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(flat, (x + 1).view(-1))
        assert torch.equal(strided, (x + 1)[1:, ::2].transpose(0, 1))


@pytest.mark.usefixtures("device")
def test_out_ops(x: torch.Tensor) -> None:
    buf = torch.empty(4, 8)
    mm_out = torch.empty(4, 4)

    def f() -> torch.Tensor:
        torch.add(x, 1, out=buf)
        torch.mul(buf, buf, out=buf)
        torch.mm(buf, x.t(), out=mm_out)
        return mm_out

    graph, out = _capture(f)
    assert out is mm_out
    for _ in _new_values(x):
        graph.replay()
        expected = (x + 1) * (x + 1)
        assert torch.equal(buf, expected)
        assert torch.equal(mm_out, expected @ x.t())


@pytest.mark.usefixtures("device")
def test_tensors_allocated_in_capture_stay_alive(x: torch.Tensor) -> None:
    def f() -> torch.Tensor:
        scale = torch.full((8,), 2.0)  # allocated inside the segment, dropped by the caller
        table = torch.arange(8.0)
        return x * scale + table

    graph, out = _capture(f)
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(out, x * 2 + torch.arange(8.0))


# -- breaks -----------------------------------------------------------------------------------


@pytest.mark.usefixtures("device")
@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_break_in_the_middle(x: torch.Tensor, kind: str) -> None:
    calls: list[int] = []

    @eager_on_graph
    def middle(h: torch.Tensor) -> Any:
        calls.append(int(h.sum().item() != 0))  # a host sync is fine inside a break
        a, b = h.sin(), h.cos()
        if kind == "tensor":
            return a
        if kind == "tuple":
            return a, b
        return {"a": a, "b": b}

    def combine(r: Any) -> torch.Tensor:
        if kind == "tensor":
            out: torch.Tensor = r * 2
        elif kind == "tuple":
            out = r[0] * r[1]
        else:
            out = r["a"] - r["b"]
        return out

    def f() -> torch.Tensor:
        return combine(middle(x * 3)) + 1

    graph, out = _capture(f)
    assert graph.step_kinds == ("graph", "break", "graph")
    calls.clear()
    for _ in _new_values(x):
        graph.replay()
        with torch.no_grad():
            assert torch.equal(out, f())
    assert len(calls) == 2 * REPLAYS  # once per replay, once per eager check


def test_strict_break_rejects_cpu_tensor_and_accepts_argument_buffers(x: torch.Tensor) -> None:
    @eager_on_graph(strict=True)
    def returns_tensor(h: torch.Tensor) -> torch.Tensor:
        return h + 1

    graph = BreakableCUDAGraph(backend="cpu")
    with pytest.raises(BreakOutputError, match="strict but returned a CPU tensor"):
        _capture(lambda: returns_tensor(x), graph)
    assert not is_breakable_capture_active()

    buf = torch.empty(4, 8)

    @eager_on_graph(strict=True)
    def writes_buffer(h: torch.Tensor, dst: torch.Tensor) -> None:
        torch.sigmoid(h, out=dst)

    def f() -> torch.Tensor:
        writes_buffer(x * 2, buf)
        return buf - 1

    graph.reset()
    graph, out = _capture(f, graph)
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(out, torch.sigmoid(x * 2) - 1)


@pytest.mark.usefixtures("device")
def test_capture_stub_runs_only_at_capture(x: torch.Tensor) -> None:
    real: list[int] = []
    stubbed: list[int] = []

    def stub(h: torch.Tensor) -> torch.Tensor:
        stubbed.append(1)
        return torch.zeros_like(h)

    @eager_on_graph(capture_stub=stub)
    def brk(h: torch.Tensor) -> torch.Tensor:
        real.append(1)
        return h.flip(0)

    graph, out = _capture(lambda: brk(x + 1) * 2)
    assert stubbed == [1] and real == []
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(out, (x + 1).flip(0) * 2)
    assert stubbed == [1] and len(real) == REPLAYS


@pytest.mark.usefixtures("device")
def test_barrier_fn_runs_before_each_break_at_capture_only(x: torch.Tensor) -> None:
    order: list[str] = []

    @eager_on_graph(name="first")
    def first(h: torch.Tensor) -> torch.Tensor:
        order.append("first")
        return h * 2

    @eager_on_graph(name="second")
    def second(h: torch.Tensor) -> torch.Tensor:
        order.append("second")
        return h - 1

    graph = _graph()
    with (
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, barrier_fn=lambda: order.append("barrier")),
    ):
        out = second(first(x).relu()).abs()
    assert order == ["barrier", "first", "barrier", "second"]
    order.clear()
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(out, ((x * 2).relu() - 1).abs())
    assert order == ["first", "second"] * REPLAYS


@pytest.mark.usefixtures("device")
def test_break_graph_splits_and_empty_segments_are_dropped(x: torch.Tensor) -> None:
    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        return h + 1

    def f() -> torch.Tensor:
        h = brk(x)  # a break first: the segment before it is empty
        h = brk(h)  # adjacent breaks: empty segment between them
        h = h * 2
        break_graph()
        h = h.view(-1)  # views only: an empty segment
        break_graph()
        h = h.exp()
        return brk(h)  # a break last: the final segment is empty

    graph, out = _capture(f)
    assert graph.step_kinds == ("break", "break", "graph", "graph", "break")
    assert graph.num_segments == 2 and graph.num_breaks == 3
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(out, (((x + 1) + 1) * 2).view(-1).exp() + 1)


# -- randomness -------------------------------------------------------------------------------


def test_random_ops_draw_fresh_values_per_replay(x: torch.Tensor) -> None:
    noise = torch.empty(4, 8)

    def f() -> tuple[torch.Tensor, torch.Tensor]:
        noise.normal_()
        return x + torch.rand(4, 8), F.dropout(x, p=0.5, training=True)

    graph, (jittered, dropped) = _capture(f)
    seen = [jittered.clone()]
    for _ in range(REPLAYS):
        graph.replay()
        assert not torch.equal(jittered, seen[-1])
        seen.append(jittered.clone())
        assert ((jittered - x) >= 0).all() and ((jittered - x) < 1).all()
    # Replays draw from the default generator in eager order: same seed, same numbers.
    torch.manual_seed(7)
    graph.replay()
    torch.manual_seed(7)
    expected = f()
    assert torch.equal(jittered, expected[0]) and torch.equal(dropped, expected[1])


# -- host synchronisation is refused ------------------------------------------------------------


def _sync_item(t: torch.Tensor) -> Any:
    return t.sum().item()  # sync:item


def _sync_tolist(t: torch.Tensor) -> Any:
    return t.tolist()  # sync:tolist


def _sync_print(t: torch.Tensor) -> Any:
    print(t)  # sync:print


def _sync_nonzero(t: torch.Tensor) -> Any:
    return t.nonzero()  # sync:nonzero


def _sync_bool(t: torch.Tensor) -> Any:
    return 1 if t.sum() > 0 else 0  # sync:bool


def _sync_mask(t: torch.Tensor) -> Any:
    return t[t > 0]  # sync:mask


@pytest.mark.parametrize(
    ("fn", "marker", "op"),
    [
        (_sync_item, "sync:item", "aten._local_scalar_dense"),
        (_sync_tolist, "sync:tolist", "Tensor.tolist"),
        (_sync_print, "sync:print", "Tensor.__repr__"),
        (_sync_nonzero, "sync:nonzero", "aten.nonzero"),
        (_sync_bool, "sync:bool", "aten._local_scalar_dense"),
        (_sync_mask, "sync:mask", "aten.index.Tensor"),
    ],
    ids=["item", "tolist", "print", "nonzero", "bool", "mask"],
)
def test_host_sync_raises_naming_op_and_line(
    x: torch.Tensor, fn: Callable[[torch.Tensor], Any], marker: str, op: str
) -> None:
    graph = BreakableCUDAGraph(backend="cpu")
    location = f"{__file__}:{_line_of(marker)}"
    with pytest.raises(HostSyncError) as info:
        _capture(lambda: fn(x * 2), graph)
    err = info.value
    message = str(err)
    assert message.startswith("operation not permitted when stream is capturing: ")
    assert op in message and err.op.startswith(op)
    assert err.location == location and location in message
    assert "@eager_on_graph" in message
    assert isinstance(err, CaptureError) and isinstance(err, RuntimeError)
    assert any("graph segment 1" in note for note in err.__notes__)
    # Clean state: nothing capturing, hooks gone, graph failed and reusable after reset().
    assert not is_breakable_capture_active()
    assert not hooks_installed()
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert "tolist" not in torch.Tensor.__dict__
    with pytest.raises(ReplayError, match="last capture of this graph failed"):
        graph.replay()
    graph.reset()
    graph, out = _capture(lambda: x * 2 + 1, graph)
    for _ in _new_values(x):
        graph.replay()
        assert torch.equal(out, x * 2 + 1)


def test_host_sync_inside_a_break_is_fine_and_outside_capture_too(x: torch.Tensor) -> None:
    graph, out = _capture(lambda: eager_on_graph(_sync_item)(x) * 1)
    assert isinstance(out, float) and graph.num_breaks == 1
    assert isinstance(x.tolist(), list)  # hooks act only while a segment is captured
    print(x[0, 0])


def test_swallowed_host_sync_still_fails_the_capture(x: torch.Tensor) -> None:
    def f() -> torch.Tensor:
        with contextlib.suppress(HostSyncError):  # CUDA would invalidate the capture anyway
            x.sum().item()
        return x + 1

    graph = BreakableCUDAGraph(backend="cpu")
    with pytest.raises(HostSyncError, match="previous error during capture") as info:
        _capture(f, graph)
    assert info.value.op.startswith("aten._local_scalar_dense")
    assert not is_breakable_capture_active()


# The collector's own answer: inside a capture gc.isenabled() answers with the user's switch.
_COLLECTOR_ENABLED = gc.isenabled


@pytest.mark.parametrize("user_disabled", [False, True])
def test_automatic_collection_paused_in_capture_and_restored(
    x: torch.Tensor, user_disabled: bool
) -> None:
    # Inside a capture a collection could destroy a dead CUDA graph, which invalidates it.
    if user_disabled:
        gc.disable()
    try:
        seen: list[bool] = []

        def f() -> torch.Tensor:
            seen.append(_COLLECTOR_ENABLED())
            y = eager_on_graph(_note_gc)(x * 2, seen)
            seen.append(_COLLECTOR_ENABLED())
            return y + 1

        graph, out = _capture(f)
        assert seen == [False, False, False]
        assert gc.isenabled() is not user_disabled
        with pytest.raises(RuntimeError, match="boom"):
            _capture(_boom)
        assert gc.isenabled() is not user_disabled
        graph.replay()
        assert torch.equal(out, x * 2 + 1)
    finally:
        gc.enable()


def _note_gc(t: torch.Tensor, seen: list[bool]) -> torch.Tensor:
    seen.append(_COLLECTOR_ENABLED())
    return t.clone()


def _boom() -> torch.Tensor:
    raise RuntimeError("boom")


def test_dispatch_mode_left_open_across_a_break_fails_cleanly(x: torch.Tensor) -> None:
    class Passthrough(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        return h + 1

    def f() -> torch.Tensor:
        with Passthrough():  # type: ignore[no-untyped-call]
            return brk(x)

    with pytest.raises(CaptureError, match="Passthrough entered inside a graph segment"):
        _capture(f)
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert not is_breakable_capture_active()


def test_get_current_stream_on_cpu(x: torch.Tensor) -> None:
    seen: list[Any] = []

    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        seen.append(get_current_stream())
        return h

    graph, _ = _capture(lambda: brk(x))
    graph.replay()
    assert isinstance(seen[0], CpuStream)
    if not torch.cuda.is_available():
        assert isinstance(seen[1], CpuStream)


# -- runner -----------------------------------------------------------------------------------


def test_runner_captures_and_replays(device: str, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        return h.softmax(-1)

    def forward(inp: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(inp)
        return brk(out) * 2

    runner = BreakableGraphRunner(forward, device=device)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="bcg_core"):
        first = runner.capture(torch.randn(3, 8))
        assert first.shape == (3, 4)
        for i in range(REPLAYS):
            inp = torch.randn(3, 8)
            with enable_breakable_cuda_graph():
                expected = forward(inp)
            assert torch.equal(runner(inp), expected), i
    assert "no CUDA device" not in caplog.text
    stats = runner.stats
    assert stats.captures == 1 and stats.hits == REPLAYS and stats.misses == 0
    (entry,) = stats.entries
    assert entry.segments == 2 and entry.breaks == 1
    assert (entry.pool_bytes is None) == (device == "cpu")


def test_runner_on_cpu_blocks_a_signature_whose_capture_syncs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def forward(inp: torch.Tensor) -> torch.Tensor:
        return inp * inp.max().item()

    runner = BreakableGraphRunner(forward, device="cpu")
    inp = torch.randn(5)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        assert torch.equal(runner.capture(inp), forward(inp))
    (reason,) = runner.blocked_signatures.values()
    assert "operation not permitted when stream is capturing" in reason
    assert runner.stats.failed_captures == 1


# -- the toy decoder -----------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 8])
def test_toy_decoder_replay_is_bit_identical_to_eager(device: str, batch: int) -> None:
    cfg = tiny_config(dtype=torch.bfloat16)
    assert cfg.layers >= 8
    eager = ToyDecoder(cfg, seed=0, device=device)
    graphed = ToyDecoder(cfg, seed=0, device=device)
    eager.allocate_cache(batch)
    graphed.allocate_cache(batch)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (batch,), generator=gen, device="cpu").to(device)
    positions = torch.zeros(batch, dtype=torch.long)
    with torch.no_grad():
        graph = _graph()
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            logits = graphed(tokens, positions)
        assert graph.break_names == ("toy_decoder.attention",) * cfg.layers
        assert graph.num_segments == cfg.layers + 1
        # The capture ran every op (segments and breaks) once; undo the cache writes.
        for block in graphed.blocks:
            assert block.attn.k_cache is not None and block.attn.v_cache is not None
            block.attn.k_cache.zero_()
            block.attn.v_cache.zero_()
        for step in range(4):
            new_tokens = torch.randint(0, cfg.vocab, (batch,), generator=gen, device="cpu")
            new_tokens = new_tokens.to(device)
            new_positions = torch.full((batch,), step) + torch.arange(batch) % 2
            tokens.copy_(new_tokens)
            positions.copy_(new_positions)
            graph.replay()
            assert torch.equal(logits, eager(new_tokens, new_positions)), f"step {step}"
        for a, b in zip(eager.blocks, graphed.blocks, strict=True):
            assert torch.equal(a.attn.k_cache, b.attn.k_cache)  # type: ignore[arg-type]
            assert torch.equal(a.attn.v_cache, b.attn.v_cache)  # type: ignore[arg-type]


# -- check_capture ------------------------------------------------------------------------------


def test_check_capture_reports_a_clean_capture(x: torch.Tensor) -> None:
    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        return h.sum().item() * h  # host sync inside a break: allowed

    report = check_capture(lambda t, scale: brk(t * scale) + 1, x, scale=2.0)
    assert report == CaptureCheck(ok=True, segments=2, breaks=1)
    assert str(report) == "captures cleanly, 2 segments (1 breaks)"
    assert not is_breakable_capture_active()


def test_check_capture_reports_the_first_host_sync(x: torch.Tensor) -> None:
    def model(t: torch.Tensor) -> torch.Tensor:
        h = t * 2
        if h.sum() > 0:  # check:first-sync
            h = h + 1
        print(h)
        return h

    report = check_capture(model, x)
    location = f"{__file__}:{_line_of('check:first-sync')}"
    assert not report.ok and report.segments == 0 and report.breaks == 0
    assert report.op is not None and report.op.startswith("aten._local_scalar_dense")
    assert report.location == location
    assert report.error is not None and "operation not permitted" in report.error
    assert "aten._local_scalar_dense" in str(report) and location in str(report)
    assert "@eager_on_graph" in str(report)
    assert not is_breakable_capture_active()


def test_check_capture_reports_bcg_errors_and_propagates_user_errors(x: torch.Tensor) -> None:
    @eager_on_graph(strict=True)
    def strict_brk(h: torch.Tensor) -> torch.Tensor:
        return h

    report = check_capture(strict_brk, x)
    assert not report.ok and report.op is None and report.location is None
    assert str(report).startswith("capture failed: break") and "CPU tensor" in str(report)

    def broken(t: torch.Tensor) -> None:
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        check_capture(broken, x)
    assert not is_breakable_capture_active()
