"""Holes an adversarial pass found in what breaks return and take, on the shared ``device``
fixture (the CPU graph backend, and CUDA where a GPU is): each was a silently wrong replay or
a debug check that missed a leak, and is now a :class:`BreakOutputError`, a right replay, or
the CPU backend replaying what CUDA replays."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputError,
    CaptureError,
    check_divergence,
    eager_on_graph,
    enable_breakable_cuda_graph,
)


def _capture(device: str, step: Any, *args: Any, debug: Any = None) -> tuple[Any, Any]:
    graph = BreakableCUDAGraph(backend=device)
    extra = {} if debug is None else {"debug": debug}
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph, **extra):
        out = step(*args)
    return graph, out


_host: dict[str, Any] = {}


@eager_on_graph(name="boh.length")
def _length(t: torch.Tensor) -> int:
    return int(t.item())


@eager_on_graph(name="boh.meta")
def _meta(t: torch.Tensor) -> tuple[int, str]:
    return int(t.item()), "decode"


@eager_on_graph(name="boh.bias")
def _bias(x: torch.Tensor) -> Any:
    return _host.get("bias")


@pytest.mark.parametrize("kind", ["int", "tuple"])
def test_a_changed_host_value_returned_without_tensors_raises(device: str, kind: str) -> None:
    lens = torch.tensor([3])
    x = torch.arange(10.0, device=device)

    def step(x: torch.Tensor) -> torch.Tensor:
        n = _length(lens) if kind == "int" else _meta(lens)[0]
        return x[:n].sum().reshape(1)

    graph, out = _capture(device, step, x)
    graph.replay()  # the same value: fine
    assert out.item() == 3.0
    lens.fill_(5)
    with pytest.raises(BreakOutputError, match=r"is 5 at replay but was 3 at capture"):
        graph.replay()  # used to replay 3.0 where eager gives 10.0


def test_a_break_that_returned_none_and_then_a_value_raises(device: str) -> None:
    _host.clear()
    x = torch.arange(4.0, device=device)
    graph, _ = _capture(device, lambda x: x[:2] + (0 if _bias(x) is None else _bias(x)), x)
    graph.replay()
    _host["bias"] = torch.full((2,), 10.0, device=device)
    try:
        with pytest.raises(BreakOutputError, match="returned None at capture but a value"):
            graph.replay()
    finally:
        _host.clear()


@dataclasses.dataclass
class _AttnMeta:
    scale: torch.Tensor | None = None


_META = _AttnMeta()
_HOLDER: list[Any] = [None]


@eager_on_graph(name="boh.build_meta")
def _build_meta(x: torch.Tensor) -> _AttnMeta:
    _META.scale = x.sum().reshape(1) * 2  # a new tensor on the same object every call
    return _META


@eager_on_graph(name="boh.fill_holder")
def _fill_holder(x: torch.Tensor) -> list[Any]:
    _HOLDER[0] = x * 2
    return _HOLDER


def test_the_same_mutable_object_returned_again_is_copied(device: str) -> None:
    x = torch.ones(3, device=device)
    graph, out = _capture(device, lambda x: x * _build_meta(x).scale, x)
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 24.0, device=device))  # was the capture's 12
    y = torch.ones(3, device=device)
    graph, out = _capture(device, lambda y: _fill_holder(y)[0] + 1, y)
    y.fill_(5.0)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 11.0, device=device))  # was the capture's 3


@eager_on_graph(name="boh.scale")
def _scale(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    return x * 1, _host["scale"]


def test_negative_zero_returned_by_a_break_is_another_value(device: str) -> None:
    _host["scale"] = 0.0
    try:
        graph, _ = _capture(
            device, lambda x: (lambda y, s: y / s)(*_scale(x)), torch.ones(2, device=device)
        )
        _host["scale"] = -0.0
        with pytest.raises(BreakOutputError, match=r"is -0.0 at replay but was 0.0"):
            graph.replay()  # used to replay inf where eager gives -inf
    finally:
        _host.clear()


@eager_on_graph(name="boh.append")
def _append(x: torch.Tensor, cache: list[torch.Tensor]) -> None:
    cache.append(x * 2)  # a fresh tensor kept in a list argument


def test_strict_debug_reports_a_tensor_appended_to_a_list_argument(device: str) -> None:
    def step(x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        _append(x + 1, cache)
        return cache[-1] + 1

    with pytest.raises(CaptureError, match=r"'boh.append' created 1 .* tensor"):
        _capture(device, step, torch.ones(3, device=device), [], debug="strict")


_LIST_META: list[Any] = []


@eager_on_graph(name="boh.attn")
def _attn(q: torch.Tensor, meta: list[Any]) -> torch.Tensor:
    n = meta[1]
    return q[:n].sum().reshape(1) + meta[0][:n].sum()


def test_a_host_value_in_a_list_argument_is_the_captures_on_every_backend(device: str) -> None:
    # CUDA rebuilds a list holding a device tensor around aliases, so a host value changed in
    # place is not seen at replay; the CPU backend now does the same, so its replays and its
    # divergence check show what a CUDA replay would (it used to say "equal to eager").
    _LIST_META[:] = [torch.tensor([1.0, 2.0, 3.0], device=device), 2]
    q = torch.ones(3, device=device)

    def step(q: torch.Tensor) -> torch.Tensor:
        return _attn(q * 1, _LIST_META) * 1

    graph, out = _capture(device, step, q)
    _LIST_META[1] = 3
    graph.replay()
    assert out.item() == 5.0  # the capture's n = 2 (eager now gives 9)

    def load(n: int) -> Any:
        def call() -> tuple[torch.Tensor]:
            _LIST_META[1] = n
            return (torch.ones(3, device=device),)

        return call

    report = check_divergence(step, [load(2), load(3)], backend=device)
    assert not report.ok


@eager_on_graph(name="boh.absmax")
def _absmax(h: torch.Tensor) -> float:
    return float(h.abs().max().item())


def test_the_divergence_check_still_names_a_frozen_host_value(device: str) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return h / (_absmax(h) + 1.0)

    sets = [(torch.arange(3.0, device=device) + i,) for i in range(2)]
    report = check_divergence(model, sets)
    assert report.cause == "frozen_break_output"
    assert report.observed_at == "the outputs of break 'boh.absmax' (call 1)"


def test_a_capture_into_another_pool_makes_it_the_graphs_pool(device: str) -> None:
    first = BreakableCUDAGraph(backend=device)
    shared = first.pool()
    graph = BreakableCUDAGraph(backend=device)
    x = torch.ones(2, device=device)
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph, pool=shared):
        out = x * 2
    assert graph.pool() is shared  # used to be a pool of its own, which held nothing
    x.fill_(3.0)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 6.0, device=device))
