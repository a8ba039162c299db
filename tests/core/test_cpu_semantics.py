"""Core semantics that need no GPU: flag, decorator, aliases, bridges, capture-info parsing,
argument validation and clean failure on a machine without CUDA."""

from __future__ import annotations

import dataclasses
import enum
import gc
import logging
import threading
import weakref
from collections import namedtuple
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import (
    BCG_FAILURE_HINT,
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputError,
    CaptureError,
    ReplayError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
)
from bcg_core._backends import CaptureStatus, backend_for  # noqa: PLC2701
from bcg_core._backends.cudart import RUNTIME, CudaRuntimeError, parse_is_capturing  # noqa: PLC2701
from bcg_core._capture.aliases import alias_tensor, alias_tree  # noqa: PLC2701
from bcg_core._capture.bridges import Bridge  # noqa: PLC2701
from bcg_core._capture.streams import hooks_installed, stream_hooks  # noqa: PLC2701
from bcg_core._trees import tensor_leaves  # noqa: PLC2701

# -- runtime flag ------------------------------------------------------------------------------


def test_flag_nests_and_restores() -> None:
    assert not is_in_breakable_cuda_graph()
    with enable_breakable_cuda_graph():
        assert is_in_breakable_cuda_graph()
        with enable_breakable_cuda_graph(False):
            assert not is_in_breakable_cuda_graph()
        assert is_in_breakable_cuda_graph()
    assert not is_in_breakable_cuda_graph()


def test_flag_is_per_thread() -> None:
    seen: list[bool] = []
    with enable_breakable_cuda_graph():
        t = threading.Thread(target=lambda: seen.append(is_in_breakable_cuda_graph()))
        t.start()
        t.join()
        assert is_in_breakable_cuda_graph()
    assert seen == [False]


def test_flag_env_disable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_DISABLE", "1")
    with enable_breakable_cuda_graph():
        assert not is_in_breakable_cuda_graph()


def test_flag_logs_hint_and_reraises(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="bcg_core"),
        pytest.raises(ValueError, match="boom"),
        enable_breakable_cuda_graph(),
    ):
        raise ValueError("boom")
    assert BCG_FAILURE_HINT in caplog.text
    assert "BCG_DISABLE=1" in BCG_FAILURE_HINT
    assert not is_in_breakable_cuda_graph()


def test_flag_rejects_non_bool() -> None:
    with pytest.raises(TypeError, match="takes a bool"), enable_breakable_cuda_graph("yes"):  # type: ignore[arg-type]
        pass


# -- decorator ---------------------------------------------------------------------------------


@eager_on_graph
def _double(x: torch.Tensor) -> torch.Tensor:
    """Doubles x."""
    return x * 2


class _Layer:
    def __init__(self) -> None:
        self.scale = 3.0

    @eager_on_graph(strict=True, name="layer.apply")
    def apply(self, x: torch.Tensor, *, out: torch.Tensor) -> None:
        out.copy_(x * self.scale)


def test_decorator_passes_through_outside_capture() -> None:
    x = torch.arange(4.0)
    assert torch.equal(_double(x), x * 2)
    assert _double.__name__ == "_double"
    assert _double.__doc__ == "Doubles x."
    out = torch.empty(4)
    _Layer().apply(x, out=out)
    assert torch.equal(out, x * 3)
    assert not is_breakable_capture_active()


def test_decorator_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="capture_stub must be callable"):
        eager_on_graph(capture_stub=3)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="decorates a callable"):
        eager_on_graph()(5)  # type: ignore[type-var]
    # a string option would be truthy whatever it says
    with pytest.raises(TypeError, match="strict must be a bool"):
        eager_on_graph(strict="false")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="gated must be a bool"):
        eager_on_graph(gated=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="enable must be a bool"):
        eager_on_graph(enable=None)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        eager_on_graph(name="")
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        eager_on_graph(name=7)  # type: ignore[call-overload]


def test_break_graph_is_noop_outside_capture() -> None:
    bcg_core.break_graph()
    assert not is_breakable_capture_active()


# -- aliases -----------------------------------------------------------------------------------


def test_alias_shares_memory_and_layout() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, ::2]
    alias = alias_tensor(view)
    assert alias.data_ptr() == view.data_ptr()
    assert alias.shape == view.shape and alias.stride() == view.stride()
    assert alias.storage_offset() == view.storage_offset()
    view.add_(100)
    assert torch.equal(alias, view)
    assert alias_tensor(torch.empty(0, 3)).shape == (0, 3)


def test_alias_does_not_keep_storage_alive() -> None:
    t = torch.randn(1024)
    ref = weakref.ref(t.untyped_storage())
    alias = alias_tensor(t)
    del t
    gc.collect()
    assert ref() is None  # the alias never owned the memory (it is not read after this)
    del alias


def test_alias_tree_keeps_structure_and_passes_cpu_through() -> None:
    Pair = namedtuple("Pair", "a b")
    x = torch.ones(2)
    tree: Any = {"p": Pair(x, 3), "l": [x, "s"], "t": (x,)}
    out = alias_tree(tree, frozenset({"cuda"}), "cuda")
    assert isinstance(out["p"], Pair) and out["p"].b == 3
    assert out["p"].a is x and out["l"][0] is x and out["t"][0] is x  # CPU: unchanged
    forced = alias_tree(tree, frozenset({"cpu"}), "cpu")
    assert forced["p"].a is not x and forced["p"].a.data_ptr() == x.data_ptr()
    assert forced["l"][1] == "s"


# -- bridges -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    meta: dict[str, torch.Tensor]


class _Plain:
    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


@pytest.mark.parametrize(
    "make",
    [
        lambda v: v,
        lambda v: (v, v + 1),
        lambda v: {"x": v, "y": [v * 2, "tag"]},
        lambda v: _Out(v, {"z": v - 1}),
        lambda v: _Plain(v, v * v),
    ],
    ids=["tensor", "tuple", "dict", "dataclass", "object"],
)
def test_bridge_copies_fresh_outputs_into_capture_buffers(make: Any) -> None:
    captured = make(torch.zeros(3))
    bridge = Bridge("b", captured)
    before = [t.data_ptr() for t in tensor_leaves(captured)]
    for i in range(3):
        fresh = make(torch.full((3,), float(i + 1)))
        bridge.update(fresh)
        for dst, src in zip(tensor_leaves(captured), tensor_leaves(fresh), strict=True):
            assert torch.equal(dst, src)
    assert [t.data_ptr() for t in tensor_leaves(captured)] == before


def test_bridge_accepts_output_already_in_place() -> None:
    buf = torch.zeros(4)
    bridge = Bridge("inplace", (buf, buf[:2]))
    buf.fill_(7)
    bridge.update((buf, buf[:2]))
    assert torch.equal(buf, torch.full((4,), 7.0))


def test_bridge_rejects_structure_and_shape_changes() -> None:
    bridge = Bridge("attn", (torch.zeros(2), torch.zeros(3)))
    with pytest.raises(BreakOutputError, match="returned 1 tensors at replay but 2"):
        bridge.update((torch.zeros(2),))
    with pytest.raises(BreakOutputError, match=r"'attn'.*\(4,\).*\(3,\)"):
        bridge.update((torch.zeros(2), torch.zeros(4)))


@pytest.mark.parametrize("grad", [True, False])
def test_single_tensor_bridge_copies_checks_and_skips_in_place(grad: bool) -> None:
    dst = torch.zeros(2, 3)
    bridge = Bridge("one", dst)
    with torch.set_grad_enabled(grad):
        fresh = torch.arange(6.0, requires_grad=True).view(2, 3)
        bridge.update(fresh)
        assert torch.equal(dst, torch.arange(6.0).view(2, 3))
        assert not dst.requires_grad  # the copy is never recorded by autograd
        dst.fill_(5)
        bridge.update(dst)  # already in the bridge: no copy, value kept
        assert torch.equal(dst, torch.full((2, 3), 5.0))
        bridge.update(dst.t().contiguous().t())  # same values, other storage: copied
        with pytest.raises(BreakOutputError, match=r"'one'.*\(3, 2\).*\(2, 3\)"):
            bridge.update(torch.zeros(3, 2))
        with pytest.raises(BreakOutputError, match=r"torch\.float64"):
            bridge.update(torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("many", [False, True])
def test_expanded_break_outputs_replay_their_new_values(many: bool) -> None:
    # A break returning a broadcast (stride-0) view, a mask or positions expanded to the batch:
    # the bridge is written through its first element along the repeated dimensions (a copy
    # into every element failed at replay: "more than one element ... refers to a single
    # memory location").
    x = torch.randn(6)

    @eager_on_graph(name="expand")
    def spread(h: torch.Tensor) -> Any:
        wide = (h * 2).expand(4, 6)
        return (wide, h + 1) if many else wide

    def step() -> torch.Tensor:
        out = spread(x)
        return (out[0] if many else out) * 3

    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn(6))
        graph.replay()
        assert torch.equal(out, step())


def test_expanded_at_capture_but_not_at_replay_is_refused_by_name() -> None:
    bridge = Bridge("mask", torch.zeros(3).expand(4, 3))
    bridge.update(torch.ones(3).expand(4, 3))
    assert torch.equal(bridge.output, torch.ones(4, 3))
    with pytest.raises(BreakOutputError, match=r"'mask'.*expanded at capture .* not at replay"):
        bridge.update(torch.ones(4, 3))


# -- capture-info parsing (cuda-bindings 12.x and 13.x result tuples) ---------------------------


class _Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorStreamCaptureImplicit = 906


class _Status(enum.IntEnum):
    cudaStreamCaptureStatusNone = 0
    cudaStreamCaptureStatusActive = 1
    cudaStreamCaptureStatusInvalidated = 2


def test_parse_is_capturing() -> None:
    # Status only: no graph or dependency handle is ever read from the runtime's answer.
    for status, want in (
        (_Status.cudaStreamCaptureStatusActive, CaptureStatus.ACTIVE),
        (_Status.cudaStreamCaptureStatusNone, CaptureStatus.NONE),
        (_Status.cudaStreamCaptureStatusInvalidated, CaptureStatus.INVALIDATED),
    ):
        info = parse_is_capturing((_Err.cudaSuccess, status))
        assert info.status is want and info.capture_id is None


def test_parse_is_capturing_errors() -> None:
    with pytest.raises(CudaRuntimeError, match="cudaErrorStreamCaptureImplicit"):
        parse_is_capturing((_Err.cudaErrorStreamCaptureImplicit, None))
    with pytest.raises(TypeError, match=r"expected \(err, status\)"):
        parse_is_capturing((0, 1, 2, None, [], 0))


def test_capture_node_count_of_a_stream_not_capturing_is_unknown() -> None:
    # No driver library, no initialised driver, or a stream that is not capturing: unknown
    # (None), so no segment is ever dropped on a guess.
    assert RUNTIME.capture_node_count(_FakeStream()) is None


class _FakeStream:
    cuda_stream = 0


# -- validation and the no-CUDA path -----------------------------------------------------------


def test_capture_validates_arguments() -> None:
    graph = BreakableCUDAGraph()
    with pytest.raises(TypeError, match="needs a BreakableCUDAGraph"):
        BreakableCUDAGraphCapture(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capture_error_mode must be one of"):
        BreakableCUDAGraphCapture(graph, capture_error_mode="local")
    with pytest.raises(TypeError, match="barrier_fn must be callable"):
        BreakableCUDAGraphCapture(graph, barrier_fn=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"stream must be a torch\.cuda\.Stream"):
        BreakableCUDAGraphCapture(graph, stream="s")


def test_replay_before_capture_says_what_to_do() -> None:
    with pytest.raises(ReplayError, match="holds no capture yet"):
        BreakableCUDAGraph().replay()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_capture_without_cuda_fails_cleanly() -> None:
    graph = BreakableCUDAGraph()
    with (
        pytest.raises(CaptureError, match=r"needs a CUDA device.*BCG_DISABLE=1"),
        BreakableCUDAGraphCapture(graph),
    ):
        pass
    assert not is_breakable_capture_active()
    assert not hooks_installed()
    assert not graph.is_captured
    with pytest.raises(ReplayError, match="holds no capture yet"):
        graph.replay()


def test_stream_hooks_are_refcounted_and_removed() -> None:
    record = torch.cuda.Event.record
    with stream_hooks(backend_for("cuda")):
        with stream_hooks(backend_for("cuda")):
            assert torch.cuda.Event.record is not record
        assert hooks_installed()
    assert not hooks_installed()
    assert torch.cuda.Event.record is record
    with pytest.raises(KeyError), stream_hooks(backend_for("cuda")):
        raise KeyError("x")
    assert torch.cuda.Event.record is record
