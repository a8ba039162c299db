"""Holes found by feeding the public API what an inference engine might (odd values, odd
tensors, threads), each pinned by a test on the CPU graph backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from graph_helpers import cpu_capture

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    CaptureError,
    breakable_attention,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
    keep_alive_ok,
    patch_attribute,
)
from bcg_diffusion import bucket_for


def _no_capture_state() -> None:
    assert not is_breakable_capture_active()
    assert not is_in_breakable_cuda_graph()


class _Name(str):
    """A str subclass (a tokenizer's or an engine's own string type)."""


@pytest.mark.parametrize(
    "host_value",
    [
        lambda n: _Name("x" * n),
        lambda n: frozenset(range(n)),
        lambda n: set(range(n)),
        lambda n: bytearray(n),
        lambda n: np.arange(n),
        lambda n: np.full((n,), 0.5),
    ],
    ids=["str-subclass", "frozenset", "set", "bytearray", "ndarray-int", "ndarray-float"],
)
def test_a_host_value_a_break_returns_anew_and_changed_is_refused_at_replay(
    host_value: Callable[[int], Any],
) -> None:
    # A break returning host metadata (a numpy array of lengths, a set of ids, a string) that
    # the code after it computes with: a replay whose break returned another value used to go
    # on with the capture's, silently (5x the input where eager gives 7x).
    x = torch.ones(3)

    @eager_on_graph
    def lengths(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return t * 1, host_value(int(t[0]))

    def step() -> torch.Tensor:
        y, meta = lengths(x * 5)
        return y * len(meta)

    graph, out = cpu_capture(step)
    assert out.tolist() == [25.0] * 3
    x.fill_(1.0)
    graph.replay()  # the same value again: replays
    assert out.tolist() == [25.0] * 3
    x.fill_(2.0)
    with pytest.raises(BreakOutputError, match=r"output\[1\] is .* at replay but was"):
        graph.replay()
    _no_capture_state()


def test_the_same_host_array_returned_again_is_what_later_breaks_read() -> None:
    # A persistent host buffer the break refills and returns, read by a later break: that
    # break receives the same object at every replay, so it is not judged (no false refusal).
    buf = np.zeros(3)
    x = torch.ones(3)

    @eager_on_graph
    def fill(t: torch.Tensor) -> np.ndarray:
        buf[:] = t.numpy()
        return buf

    @eager_on_graph
    def read(t: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        return t + torch.from_numpy(host).to(t.dtype)

    graph, out = cpu_capture(lambda: read(x * 2, fill(x * 1)) * 1)
    x.fill_(3.0)
    graph.replay()
    assert out.tolist() == [9.0] * 3


@pytest.mark.parametrize(
    "items",
    [
        lambda x: (x * k for k in (1, 2)),
        lambda x: map(lambda k: x * k, (1, 2)),
        lambda x: iter([x * 1, x * 2]),
        lambda x: zip([x * 1, x * 2]),
    ],
    ids=["generator", "map", "iter", "zip"],
)
def test_a_break_given_a_one_shot_iterator_is_refused_at_capture(
    items: Callable[[torch.Tensor], Any],
) -> None:
    # The capture's call consumed the iterator, and every replay passed it exhausted: the break
    # summed nothing and the replay returned 2x the input where eager gives 8x, silently.
    x = torch.ones(3)

    @eager_on_graph
    def total(base: torch.Tensor, parts: Any) -> torch.Tensor:
        out = base.clone()
        for part in parts:
            out += part[0] if isinstance(part, tuple) else part
        return out

    def step() -> torch.Tensor:
        base = x * 1
        try:
            return total(base, items(x)) * 1
        except CaptureError:
            return total(base, list(items(x))) * 1  # what the message says: a list replays

    with pytest.raises(CaptureError, match=r"args\[1\], a .*one-shot iterator.*list"):
        cpu_capture(lambda: total(x * 1, items(x)))
    _no_capture_state()
    graph, out = cpu_capture(step)  # code that catches the refusal goes on capturing
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == [8.0] * 3


def test_a_runner_call_holding_a_one_shot_iterator_runs_eagerly_once() -> None:
    # The warm-ups consumed the generator, and the capture (whose output the call returned)
    # computed without its items: 2x the input where eager gives 8x, silently.
    def step(x: torch.Tensor, parts: Any) -> torch.Tensor:
        out = x.clone()
        for part in parts:
            out = out + part
        return out * 2

    runner = BreakableGraphRunner(step, device="cpu")
    x = torch.ones(2)
    assert runner.capture(x, (x * k for k in (1, 2))).tolist() == [8.0, 8.0]
    report = runner.capture_many([((x, iter([x, x])), {})])
    assert not report.captured
    assert "iterator" in report.failed[0][1]
    assert runner.stats.captures == 0
    assert runner.stats.misses == 2
    # A tuple of the same items is captured and replayed.
    assert runner.capture(x, (x, x * 2)).tolist() == [8.0, 8.0]
    assert runner(x * 3, (x, x)).tolist() == step(x * 3, (x, x)).tolist() == [10.0, 10.0]
    assert runner.stats.hits == 1


@pytest.mark.parametrize("debug", [False, "strict"])
def test_keep_alive_ok_given_no_tensor_says_so(debug: bool | str) -> None:
    # Under the debug check it raised the raw "'list' object has no attribute
    # 'untyped_storage'" out of the break; without it, it passed silently (and the same code
    # failed later under BCG_DEBUG).
    kept: dict[str, Any] = {}

    @eager_on_graph
    def cache(t: torch.Tensor) -> torch.Tensor:
        kept["table"] = keep_alive_ok([t * 3])  # type: ignore[arg-type]
        return t * 2

    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(TypeError, match="keep_alive_ok takes a tensor, got a list"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, debug=debug),
    ):
        cache(torch.ones(2) * 1)
    _no_capture_state()
    assert keep_alive_ok(t := torch.ones(1)) is t


def test_breakable_attention_given_no_string_says_so() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match="breakable_attention takes an attention implementation"):
        breakable_attention(3)  # type: ignore[arg-type]


def test_bucket_for_refuses_a_nan_length() -> None:
    # NaN compares False with everything: it was below no bucket and not below 1, and came
    # back as the smallest bucket, silently.
    with pytest.raises(ValueError, match="at least one token, got length nan"):
        bucket_for(float("nan"), [2, 4])
    assert bucket_for(3, [4, 2]) == 4


def test_patch_attribute_refuses_a_wrap_that_is_not_callable() -> None:
    # It raised the raw "'int' object is not callable" from inside the patch machinery.
    class Model:
        def forward(self) -> int:
            return 1

    with pytest.raises(TypeError, match="patch_attribute's wrap must be callable"):
        patch_attribute(Model, "forward", 3)  # type: ignore[arg-type]
    assert Model().forward() == 1
    handle = patch_attribute(Model, "forward", lambda orig: lambda self: orig(self) + 1)
    assert Model().forward() == 2
    handle.remove()
    assert Model().forward() == 1
