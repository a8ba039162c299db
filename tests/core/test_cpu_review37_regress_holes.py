"""Regressions found reviewing the changes merged on top of dea02dc (hook_attribute, returned
views, StaticCache reorder, leave_unwalked, ...), on the CPU graph backend."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import BreakableGraphRunner

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from transformers import cache_utils  # noqa: E402


def _read_keys(layer: Any, x: torch.Tensor) -> torch.Tensor:
    return x + layer.keys.sum()


def test_a_hybrid_sliding_layer_s_position_is_no_part_of_the_signature() -> None:
    # transformers' hybrid (linear attention + sliding window) layer is a subclass of
    # StaticSlidingWindowLayer: it runs the patched update, which reads cumulative_length_int
    # at every replay, yet leave_unwalked took the exact class only, so the int moving every
    # decode step keyed a new signature each time (every step a miss, run eagerly).
    bcg_core.breakable_attention()  # installs the sliding-window patch
    layer = cache_utils.LinearAttentionAndStaticSlidingWindowAttentionLayer(
        max_cache_len=8, sliding_window=4
    )
    layer.lazy_initialization(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    runner = BreakableGraphRunner(_read_keys, device="cpu")
    runner.capture(layer, torch.zeros(2))
    for step in range(1, 4):
        layer.cumulative_length_int = step
        layer.keys.fill_(step)
        expected = _read_keys(layer, torch.zeros(2))
        assert torch.equal(runner(layer, torch.zeros(2)), expected)
    assert runner.stats.hits == 3
    assert runner.stats.misses == 0


def test_a_static_indexed_layer_is_reordered_in_place() -> None:
    # StaticIndexedLayer (DeepSeek V3.2 / GLM DSA sparse attention) overrides reorder_cache: it
    # calls StaticLayer's (patched: keys and values kept in place), then rebinds indexer_keys to
    # index_select's new tensor, so a graph over the cache read a stale indexer cache after
    # the first beam reorder, silently.
    bcg_core.breakable_attention()  # installs the reorder patch
    layer = cache_utils.StaticIndexedLayer(max_cache_len=4)
    kv = torch.arange(2 * 1 * 2 * 3, dtype=torch.float32).reshape(2, 1, 2, 3)
    layer.update(kv, kv.clone())
    layer.update_indexer(torch.arange(2 * 2 * 3, dtype=torch.float32).reshape(2, 2, 3))
    held = {name: getattr(layer, name) for name in ("keys", "values", "indexer_keys")}
    expected = {name: t.flip(0) for name, t in held.items()}
    layer.reorder_cache(torch.tensor([1, 0]))
    for name, t in held.items():
        assert getattr(layer, name) is t, name  # the captured tensor, at its address
        assert torch.equal(t, expected[name]), name


def _dtype_views(x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.view(torch.int32)[1:], torch.view_as_real(z)


@pytest.mark.parametrize("views", [False, True])
def test_a_returned_view_in_another_dtype_is_that_view_of_the_caller_s_tensor(views: bool) -> None:
    # x.view(torch.int32) and view_as_real(z) are views of the argument, as x[1:] is, yet a
    # replay returned clones of them (the dtype differed from the buffer's): writes through
    # them missed the caller's tensor, unlike eager, with the caller's tensor laid out as its
    # buffer (the Runner docstring's condition).
    runner = BreakableGraphRunner(_dtype_views, device="cpu", return_views=views)
    runner.capture(torch.zeros(4)[1:], torch.zeros(2, dtype=torch.complex64))
    x, z = torch.arange(4.0)[1:], torch.ones(2, dtype=torch.complex64)
    got = runner(x, z)
    assert runner.stats.hits == 1
    for mine, eager in zip(got, _dtype_views(x, z), strict=True):
        assert mine.untyped_storage().data_ptr() == eager.untyped_storage().data_ptr()
        assert (mine.dtype, mine.stride()) == (eager.dtype, eager.stride())
        assert mine.storage_offset() == eager.storage_offset()
        assert torch.equal(mine, eager)
    got[0].fill_(0)
    got[1].fill_(-1)
    assert torch.equal(x, torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(z, torch.full((2,), -1 - 1j, dtype=torch.complex64))


def _maybe_collect(x: torch.Tensor, store: list[torch.Tensor] | None = None) -> torch.Tensor:
    if store is not None:
        store.append(x * 2)  # changes the caller's list
    return x + 1


def test_a_break_refused_for_a_list_stays_one_op_where_called_without_one() -> None:
    # A break found changing a list it was given (063eb72c/045c843) had every call made a dynamo
    # graph break from then on, also the calls passing no container, which lose nothing: a
    # fullgraph=True function calling it so compiled alone, but failed once another compiled
    # function had passed the break a list (the outcome depended on the order of the calls).
    import torch._dynamo

    torch._dynamo.reset()
    collect = bcg_core.eager_on_graph(_maybe_collect, name="r37.maybe_collect")
    with_list = torch.compile(lambda x, s: collect(x.sin(), s) * len(s), backend="aot_eager")
    x = torch.randn(3)
    store: list[torch.Tensor] = []
    assert torch.equal(with_list(x, store), (x.sin() + 1) * 1)
    assert len(store) == 1
    alone = torch.compile(lambda x: collect(x.cos()) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(alone(x), (x.cos() + 1) * 2)  # raised: a graph break under fullgraph
