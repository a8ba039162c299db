"""Holes found reviewing the whole-processor break (a processor whose ``__call__`` reads values
on the host) and DiTRunner's probe of a model's ``return_dict=False`` form, on the CPU graph
backend (tiny models, random weights, float32):

- a processor class another handle had patched already was scanned through bcg's own wrapper,
  whose code names no host read: the second model's handle held no reference on it, so closing
  the first runner removed the break the second relied on (its capture was then refused);
- a ``__call__`` that is a staticmethod or a decorated function was not recognised (the scan
  read the descriptor's or the decorator's code only): capture refused, served eagerly;
- the probe ran the model a second time on a runner that serves every call eagerly
  (``disable_breakable_graphs``), for nothing;
- a model whose ``return_dict=True`` output has no ``to_tuple()`` (a bare tensor, a tuple)
  crashed with AttributeError on its first ``return_dict=False`` call, and one whose
  ``return_dict=False`` tuple is not that ``to_tuple()`` (another length) got the wrong
  structure silently: both now get eager's own ``return_dict=False`` output.

Also pinned, as they held: Mochi with two samples and per-sample prompt masks, an inherited
``__call__``, two nested handles, the probe's effect on the runner's counters.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bcg_core import PatchHandle, disable_breakable_graphs
from bcg_diffusion import DiTRunner, make_attention_ops_breakable

D = pytest.importorskip("diffusers")

from diffusers.models.attention_processor import MochiAttnProcessor2_0  # noqa: E402
from diffusers.utils import BaseOutput  # noqa: E402
from test_cpu_diffusers import attention_ops  # noqa: E402
from test_cpu_diffusers_families import R, _step  # noqa: E402, PLC2701


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


# -- the whole-processor break -----------------------------------------------------------------


def _mochi_masked(model: nn.Module, batch: int) -> Callable[..., torch.Tensor]:
    text = R(batch, 16, 16, seed=3)

    def step(x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(
            hidden_states=x,
            encoder_hidden_states=text,
            timestep=t * 1000,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        return out

    return step


def _masks(batch: int, *lengths: int) -> torch.Tensor:
    mask = torch.ones(batch, 16)
    for i, n in enumerate(lengths):
        mask[i, n:] = 0
    return mask


def test_second_model_sharing_a_host_reading_processor_class_keeps_its_break() -> None:
    """Two Mochi models, two handles: the second holds its own reference on the processor
    class's ``__call__`` (was: none, its scan read bcg's wrapper), so it still breaks there
    after the first runner closes."""
    original = vars(MochiAttnProcessor2_0)["__call__"]
    first, *_ = _step("mochi")
    second, *_ = _step("mochi")
    x = R(1, 4, 2, 8, 8)
    step = _mochi_masked(second, 1)
    with torch.no_grad():
        runner_a = DiTRunner(
            _mochi_masked(first, 1), breakable_attention=make_attention_ops_breakable(first),
            device="cpu",
        )  # fmt: skip
        runner_b = DiTRunner(
            step, breakable_attention=make_attention_ops_breakable(second), device="cpu"
        )
        try:
            assert PatchHandle.count(MochiAttnProcessor2_0, "__call__") == 2
            runner_a.close()
            assert PatchHandle.count(MochiAttnProcessor2_0, "__call__") == 1
            runner_b.capture(x, torch.ones(1), _masks(1, 16))
            (entry,) = runner_b.stats.entries  # was: refused at the processor's nonzero
            assert entry.breaks == attention_ops(lambda x, t: step(x, t, _masks(1, 16)), x)
            got = runner_b(x, torch.tensor([0.4]), _masks(1, 9))
            assert runner_b.stats.hits == 1
        finally:
            runner_a.close()
            runner_b.close()
        assert vars(MochiAttnProcessor2_0)["__call__"] is original
        assert torch.equal(got, step(x, torch.tensor([0.4]), _masks(1, 9)))


def test_mochi_two_samples_with_their_own_prompt_masks_replay_equal_eager() -> None:
    model, *_ = _step("mochi")
    step = _mochi_masked(model, 2)
    x = R(2, 4, 2, 8, 8)
    calls = [
        (torch.tensor([0.3, 0.7]), _masks(2, 5, 12)),
        (torch.tensor([0.9, 0.1]), _masks(2, 16, 3)),
    ]
    with torch.no_grad():
        expected = [step(x, t, m) for t, m in calls]
        outer = make_attention_ops_breakable(model)
        inner = make_attention_ops_breakable(model)  # nested handles on the same classes
        runner = DiTRunner(step, breakable_attention=inner, device="cpu")
        try:
            runner.capture(x, torch.ones(2), _masks(2, 16, 16))
            got = [runner(x, t, m) for t, m in calls]
            assert runner.stats.hits == 2 and runner.stats.misses == 0
        finally:
            runner.close()
            assert PatchHandle.count(MochiAttnProcessor2_0, "__call__") == 1
            outer.remove()
        assert PatchHandle.count(MochiAttnProcessor2_0, "__call__") == 0
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


class _PlainProcessor:
    """Reads the mask on the host (as Mochi's processor does), then runs one sdpa."""

    def __call__(self, attn: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = attn.to_q(x)[:, None]  # [B, 1, L, D]
        kv = q[:, :, torch.nonzero(mask[0]).flatten()]
        return F.scaled_dot_product_attention(q, kv, kv)[:, 0]


class _InheritedProcessor(_PlainProcessor):
    pass


class _StaticProcessor:
    @staticmethod
    def __call__(attn: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = attn.to_q(x)[:, None]
        kv = q[:, :, torch.nonzero(mask[0]).flatten()]
        return F.scaled_dot_product_attention(q, kv, kv)[:, 0]


def _logged(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class _DecoratedProcessor:
    @_logged
    def __call__(self, attn: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = attn.to_q(x)[:, None]
        kv = q[:, :, torch.nonzero(mask[0]).flatten()]
        return F.scaled_dot_product_attention(q, kv, kv)[:, 0]


class _Attention(nn.Module):
    def __init__(self, processor: Any) -> None:
        super().__init__()
        self.to_q = nn.Linear(8, 8)
        self.processor = processor

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.processor(self, x, mask)
        return out


class _Model(nn.Module):
    def __init__(self, processor: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attn = nn.ModuleList([_Attention(processor), _Attention(processor)])
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for a in self.attn:
            x = x + a(x, mask)
        out: torch.Tensor = self.out(x)
        return out


@pytest.mark.parametrize(
    "processor", [_PlainProcessor, _InheritedProcessor, _StaticProcessor, _DecoratedProcessor]
)
def test_host_reading_processor_call_of_any_kind_is_one_break(processor: type) -> None:
    """A staticmethod or decorated ``__call__`` (was: not recognised, capture refused) and an
    inherited one break like a plain one; the class is as before once the handle goes."""
    before = dict(vars(processor))
    model = _Model(processor()).eval()
    x, mask = R(1, 6, 8), torch.ones(1, 6)
    short = mask.clone()
    short[:, 2:] = 0
    with torch.no_grad():
        expected = model(R(1, 6, 8, seed=5), short)
        runner = DiTRunner(
            model, breakable_attention=make_attention_ops_breakable(model), device="cpu"
        )
        try:
            runner.capture(x, mask)
            (entry,) = runner.stats.entries
            assert entry.breaks == 2  # one per processor call; its sdpa inside is no other
            got = runner(R(1, 6, 8, seed=5), short)
            assert runner.stats.hits == 1
        finally:
            runner.close()
    assert dict(vars(processor)) == before
    assert sys.modules[__name__].F is torch.nn.functional
    assert torch.equal(got, expected)


# -- the probe of return_dict=False ------------------------------------------------------------


# By the module itself, weakly: an id() key was reused by a later test's model (a flaky count).
_RUNS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


@dataclass
class _Out(BaseOutput):
    sample: torch.Tensor


class _Formed(nn.Module):
    """``forward(x, return_dict=True)``; ``form`` says what each value of the flag returns."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.form = form

    @property
    def runs(self) -> int:
        return _RUNS.get(self, 0)

    def forward(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        _RUNS[self] = _RUNS.get(self, 0) + 1  # outside the module: no step state to check
        y = self.lin(x)
        if self.form == "bare":  # no output class at all: the flag is ignored
            return y
        if self.form == "always_tuple":
            return (y,)
        if return_dict:
            return y if self.form == "tensor_default" else _Out(sample=y)
        return (y, y * 2) if self.form == "longer" else (y,)


@pytest.mark.parametrize("form", ["bare", "tensor_default", "always_tuple", "longer"])
def test_return_dict_false_whose_form_is_no_to_tuple_gets_eagers_output(form: str) -> None:
    """Was: AttributeError (``tensor_default``, ``always_tuple``: the default output has no
    ``to_tuple()``) or a 1-tuple where eager gives a 2-tuple (``longer``). ``bare`` held."""
    model = _Formed(form)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x, return_dict=False)
        runner = DiTRunner(model, device="cpu")
        try:
            first = runner(x, return_dict=False)  # the probe's call
            runner.capture(x, return_dict=False)  # its own graph now
            later = runner(x, return_dict=False)
            assert runner.stats.hits == 1
        finally:
            runner.close()
    for got in (first, later):
        assert type(got) is type(expected) and len(got) == len(expected)
        assert all(map(torch.equal, got, expected))


def test_return_dict_false_on_a_disabled_runner_runs_the_model_once() -> None:
    model = _Formed("tuple")
    x = torch.randn(2, 4)
    runner = DiTRunner(model, device="cpu")
    with torch.no_grad(), disable_breakable_graphs():
        out = runner(x, return_dict=False)
        assert model.runs == 1  # was 2: the probe, then the eager call
        assert runner(x, return_dict=False)[0].shape == (2, 4) and model.runs == 2
    assert isinstance(out, tuple) and torch.equal(out[0], model(x, return_dict=False)[0])
    with torch.no_grad():  # enabled again: learnt now, and to_tuple() of the one graph
        runner.capture(x)
        runs = model.runs
        got = runner(x, return_dict=False)
        assert model.runs == runs + 1  # the probe, once; the call itself replays
        runner(x, return_dict=False)
        assert model.runs == runs + 1
        # The two disabled calls are its misses; none since.
        assert runner.stats.hits == 2 and runner.stats.misses == 2
        assert runner.stats.captures == 1
    runner.close()
    assert isinstance(got, tuple) and torch.equal(got[0], model(x, return_dict=False)[0])


def test_return_dict_false_probe_under_inference_mode_keeps_the_counters() -> None:
    model = _Formed("tuple")
    x = torch.randn(2, 4)
    with torch.inference_mode():
        runner = DiTRunner(model, device="cpu")
        try:
            runner.capture(x, return_dict=False)  # the probe runs inside the capture window
            assert runner.stats.captures == 1 and runner.stats.misses == 0
            got = runner(x, return_dict=False)
            report = runner.check_divergence(torch.randn(2, 4), return_dict=False)
            assert runner.stats.hits == 1 and runner.stats.misses == 0
        finally:
            runner.close()
    assert report.ok, report
    assert isinstance(got, tuple) and torch.equal(got[0], model(x, return_dict=False)[0])
