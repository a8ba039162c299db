"""Holes found in what bcg leaves to the garbage collector (review 21), each pinned by a test on
the CPU backend: a public path, successful or failing, that made a reference cycle holding bcg
objects (graphs, pools, runners) or tensors. On CUDA each such pool holds device memory (and a
capture lane with its cuBLAS workspace) until the collector happens to run.

The technique is test_stress's: one warm-up call (lazily made caches are not garbage), then the
path a few times with the collector off and DEBUG_SAVEALL on; what one collection then finds is
what the path left to the collector.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from graph_helpers import cpu_capture, left_to_the_collector

import bcg_core
from bcg_core import BreakableGraphRunner, check_capture, eager_on_graph


@eager_on_graph(name="review21_tanh")
def _tanh(h: torch.Tensor) -> torch.Tensor:
    return h.tanh()


@dataclasses.dataclass
class _Box:
    t: torch.Tensor


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    # Log records of failed captures would keep their errors (and tracebacks) alive.
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


def test_a_failed_check_capture_leaves_nothing_to_the_garbage_collector() -> None:
    # check_capture kept the failure in a local of its own frame, which the error's traceback
    # holds: the graph, its recorder and the call's tensors were left in a cycle.
    def run() -> None:
        x = torch.randn(8)
        check = check_capture(lambda: x * float(x.sum().item()))
        assert not check.ok and check.op is not None

    assert left_to_the_collector(run) == []


def test_a_continuous_batching_engine_leaves_nothing_to_the_garbage_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each engine's session gave its runner its own bound method as the module: session ->
    # runner -> method -> session, so every generate_batch left the session's graphs, pool and
    # static tensors to the collector.
    pytest.importorskip("transformers")
    from test_cpu_continuous_batching import configs, make_model
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    model = make_model()
    gen, cb = configs()
    gen.max_new_tokens = 3

    def run() -> None:
        with bcg_core.enable_continuous_batching(model, capture_after=0) as handle:
            model.generate_batch([[1, 2, 3, 4, 5], [6, 7, 8]], gen, continuous_batching_config=cb)
            assert handle.stats().graphs >= 1

    assert left_to_the_collector(run) == []


def test_a_runner_called_with_an_object_leaves_nothing_to_the_garbage_collector() -> None:
    # Finding the objects in a call (_trees.outer_objects, at every capture) left a recursive
    # closure in a cycle holding the list of them: the caller's objects, and their tensors,
    # outlived the runner until the collector ran.
    def run() -> None:
        runner = BreakableGraphRunner(lambda b: _tanh(b.t * 2) + 1, device="cpu", warmup_iters=0)
        box = _Box(torch.randn(4))
        assert torch.equal(runner.capture(box), (box.t * 2).tanh() + 1)
        assert torch.equal(runner(box), (box.t * 2).tanh() + 1)
        runner.reset()

    assert left_to_the_collector(run) == []


def test_a_dropped_break_leaves_nothing_to_the_garbage_collector() -> None:
    # Every break was in a cycle (its wrapper held the dynamo-disabled form of itself), so a
    # break made in a function, over a model's weights or any tensor, kept them after it was
    # dropped, until the collector ran; a break over @staticmethod kept its decorator too.
    def run() -> None:
        weight = torch.randn(4)
        scale = eager_on_graph(name="review21_scale")(lambda h: h * weight)
        x = torch.randn(4)
        graph, out = cpu_capture(lambda: scale(x) + 1)
        graph.replay()
        assert torch.equal(out, x * weight + 1)
        graph.reset()

        # (Over a staticmethod outside a class: a class is a cycle of its own.)
        times = eager_on_graph(capture_stub=lambda h: h * weight)(
            staticmethod(lambda h: h * weight)
        )
        assert torch.equal(times.__func__(x), x * weight)

    assert left_to_the_collector(run) == []
