"""Holes found by the third review (diagnostics, CLI, patching, the decorator), each a test that
failed before its fix. CPU only: the CPU graph backend captures and replays."""

from __future__ import annotations

from typing import Any

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    eager_on_graph,
    enable_breakable_cuda_graph,
)

# -- eager_on_graph over @staticmethod / @classmethod --------------------------------------------


def test_a_break_decorated_over_staticmethod_and_classmethod_keeps_their_kind() -> None:
    # @eager_on_graph over @staticmethod made a plain function: an instance call passed self
    # as x (silently, with *rest); over @classmethod it raised "decorates a callable".
    calls: list[str] = []

    class Model:
        @eager_on_graph
        @staticmethod
        def scale(x: torch.Tensor, *rest: Any) -> torch.Tensor:
            calls.append(f"static rest={len(rest)}")
            return x * 2

        @eager_on_graph
        @classmethod
        def shift(cls, x: torch.Tensor) -> torch.Tensor:
            calls.append(f"class {cls.__name__}")
            return x + 1

    class SubModel(Model):
        pass

    x = torch.ones(2)
    assert torch.equal(Model().scale(x), x * 2)
    assert torch.equal(SubModel().shift(x), x + 1)
    assert torch.equal(SubModel.shift(x), x + 1)
    assert calls == ["static rest=0", "class SubModel", "class SubModel"]
    assert isinstance(vars(Model)["scale"], staticmethod)
    assert isinstance(vars(Model)["shift"], classmethod)
    graph = BreakableCUDAGraph(backend="cpu")
    static = torch.ones(2)
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = Model().shift(Model().scale(static) + 1)
    assert [n.rsplit(".", 1)[-1] for n in graph.break_names] == ["scale", "shift"]
    static.fill_(3.0)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 8.0))
