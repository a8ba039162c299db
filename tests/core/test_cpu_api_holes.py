"""API holes found by review, on a machine without a GPU: patches of a base class and a
subclass, coroutine and generator functions as breaks, ``get_current_stream`` with a device that
is not there, and ``bcg check --divergence --backend cuda`` without CUDA."""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    PatchHandle,
    eager_on_graph,
    enable_breakable_cuda_graph,
    get_current_stream,
    is_breakable_capture_active,
    patch_attribute,
)
from bcg_core._backends import backend_for  # noqa: PLC2701
from bcg_core.bench import main

# -- patches of a base class and its subclasses ------------------------------------------------


def _tag(name: str) -> Callable[[Any], Any]:
    def wrap(fn: Any) -> Any:
        def wrapped(*args: Any) -> str:
            return f"{name}({fn(*args)})"

        return wrapped

    return wrap


class _Attention:
    def forward(self) -> str:
        return "orig"


class _LlamaAttention(_Attention):
    pass


class _DeepAttention(_LlamaAttention):
    pass


class _OwnAttention(_Attention):
    def forward(self) -> str:
        return "own"


_CLASSES: dict[str, type[_Attention]] = {
    "base": _Attention,
    "sub": _LlamaAttention,
    "deep": _DeepAttention,
    "own": _OwnAttention,
}
_WRAPS = {name: _tag(name) for name in _CLASSES}


def _expected(active: set[str]) -> dict[str, str]:
    """Each class's forward() with the patches in ``active``: its MRO's wraps, innermost the
    base's, over its own original (a class that defines forward is untouched by its bases')."""
    out = {}
    for name, cls in _CLASSES.items():
        if cls is _OwnAttention:
            value = "own(own)" if "own" in active else "own"
        else:
            value = "orig"
            for patched in ("base", "sub", "deep"):  # base first: the innermost wrap
                if patched in active and issubclass(cls, _CLASSES[patched]):
                    value = f"{patched}({value})"
        out[name] = value
    return out


def _seen() -> dict[str, str]:
    return {name: cls().forward() for name, cls in _CLASSES.items()}


def test_hole7_sub_loses_the_base_wrap_when_the_base_handle_goes() -> None:
    base = patch_attribute(_Attention, "forward", _WRAPS["base"])
    sub = patch_attribute(_LlamaAttention, "forward", _WRAPS["sub"])
    assert _LlamaAttention().forward() == "sub(base(orig))"
    base.remove()
    assert _Attention().forward() == "orig"
    assert _LlamaAttention().forward() == "sub(orig)"  # was sub(base(orig)): the removed wrap
    sub.remove()
    assert "forward" not in vars(_LlamaAttention)


def test_hole7_sub_patched_first_gets_the_base_wrap_added_later() -> None:
    sub = patch_attribute(_LlamaAttention, "forward", _WRAPS["sub"])
    base = patch_attribute(_Attention, "forward", _WRAPS["base"])
    assert _LlamaAttention().forward() == "sub(base(orig))"  # was sub(orig)
    sub.remove()
    assert _LlamaAttention().forward() == "base(orig)"
    base.remove()
    assert _LlamaAttention().forward() == "orig"


def test_base_and_subclass_patches_compose_in_any_order_and_restore_exactly() -> None:
    originals = {name: dict(vars(cls)) for name, cls in _CLASSES.items()}
    for order in itertools.permutations(_CLASSES):
        for release in itertools.permutations(_CLASSES):
            handles: dict[str, PatchHandle] = {}
            for name in order:
                handles[name] = patch_attribute(_CLASSES[name], "forward", _WRAPS[name])
                assert _seen() == _expected(set(handles)), (order, name)
            active = set(handles)
            for name in release:
                handles[name].remove()
                active.discard(name)
                assert _seen() == _expected(active), (order, release, name)
            for name, cls in _CLASSES.items():
                assert vars(cls).keys() == originals[name].keys()
                for key, value in originals[name].items():
                    assert vars(cls)[key] is value, (name, key)
            assert PatchHandle.count(_Attention, "forward") == 0


def test_a_shared_base_reference_keeps_the_subclass_composed_over_it() -> None:
    first = patch_attribute(_Attention, "forward", _WRAPS["base"])
    second = patch_attribute(_Attention, "forward", _WRAPS["base"])  # same wrap: one more ref
    sub = patch_attribute(_LlamaAttention, "forward", _WRAPS["sub"])
    first.remove()
    assert _LlamaAttention().forward() == "sub(base(orig))"  # the base patch is still on
    second.remove()
    assert _LlamaAttention().forward() == "sub(orig)"
    sub.remove()
    assert "forward" not in vars(_LlamaAttention)


def test_an_instance_patch_follows_its_class_patch() -> None:
    one = _LlamaAttention()
    own = patch_attribute(one, "forward", _WRAPS["own"])
    base = patch_attribute(_Attention, "forward", _WRAPS["base"])
    assert one.forward() == "own(base(orig))" and _LlamaAttention().forward() == "base(orig)"
    base.remove()
    assert one.forward() == "own(orig)"
    own.remove()
    assert "forward" not in vars(one) and one.forward() == "orig"


class _Maker:
    @classmethod
    def make(cls) -> str:
        return cls.__name__

    @staticmethod
    def plain() -> str:
        return "plain"


class _SubMaker(_Maker):
    pass


def test_inherited_classmethods_and_staticmethods_keep_their_kind_over_a_base_patch() -> None:
    make = _Maker.__dict__["make"]
    plain = _Maker.__dict__["plain"]
    sub = patch_attribute(_SubMaker, "make", _WRAPS["sub"])
    base = patch_attribute(_Maker, "make", _WRAPS["base"])
    assert _SubMaker.make() == "sub(base(_SubMaker))" and _Maker.make() == "base(_Maker)"
    base.remove()
    assert _SubMaker.make() == "sub(_SubMaker)" and _Maker.__dict__["make"] is make
    sub.remove()
    assert "make" not in vars(_SubMaker)
    with patch_attribute(_SubMaker, "plain", _WRAPS["sub"]):
        with patch_attribute(_Maker, "plain", _WRAPS["base"]):
            assert _SubMaker.plain() == "sub(base(plain))"
        assert _SubMaker.plain() == "sub(plain)"
    assert _Maker.__dict__["plain"] is plain and "plain" not in vars(_SubMaker)


def test_a_base_wrap_a_subclass_cannot_take_is_rolled_back_everywhere() -> None:
    def picky(fn: Any) -> Any:
        if getattr(fn, "refused", False):
            raise ValueError("picky refuses this base")
        return _WRAPS["sub"](fn)

    def refused(fn: Any) -> Any:
        wrapped = _WRAPS["base"](fn)
        wrapped.refused = True  # type: ignore[attr-defined]
        return wrapped

    original = _Attention.__dict__["forward"]
    sub = patch_attribute(_LlamaAttention, "forward", picky)
    installed = vars(_LlamaAttention)["forward"]
    with pytest.raises(ValueError, match="picky refuses"):
        patch_attribute(_Attention, "forward", refused)
    assert _Attention.__dict__["forward"] is original
    assert PatchHandle.count(_Attention, "forward") == 0
    assert _LlamaAttention().forward() == "sub(orig)"
    assert vars(_LlamaAttention)["forward"] is not installed  # recomposed back over orig
    sub.remove()
    assert "forward" not in vars(_LlamaAttention)


# -- coroutine and generator functions are not breaks ------------------------------------------


async def _coroutine(x: torch.Tensor) -> torch.Tensor:
    return x * 2


async def _async_generator(x: torch.Tensor) -> AsyncIterator[torch.Tensor]:
    yield x * 2


def _generator(x: torch.Tensor) -> Iterator[torch.Tensor]:
    yield x * 2


class _AsyncCallable:
    async def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        (_coroutine, "async def function"),
        (_async_generator, "async generator function"),
        (_generator, "generator function"),
        (_AsyncCallable(), "async def function"),
        (functools.partial(_coroutine), "async def function"),
    ],
)
def test_eager_on_graph_refuses_functions_whose_body_would_not_run(fn: Any, kind: str) -> None:
    with pytest.raises(TypeError, match=f"is an? {kind}.*make it a plain function"):
        eager_on_graph(fn)
    with pytest.raises(TypeError, match=f"is an? {kind}"):
        eager_on_graph(strict=True)(fn)
    with pytest.raises(TypeError, match=f"capture_stub .* is an? {kind}"):
        eager_on_graph(capture_stub=fn)


def test_a_plain_break_still_runs_at_capture_and_replay() -> None:
    calls: list[float] = []

    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        calls.append(float(h[0]))
        return h * 2

    x = torch.ones(2)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = brk(x + 1) - 1
    x.fill_(3.0)
    graph.replay()
    assert calls == [2.0, 4.0] and out.tolist() == [7.0, 7.0]


# -- get_current_stream with a device that is not there ----------------------------------------


def test_get_current_stream_refuses_a_string_that_names_no_device() -> None:
    with pytest.raises(ValueError, match="'bogus' is not a device"):
        get_current_stream("bogus")
    with pytest.raises(ValueError, match="must not be negative"):
        get_current_stream(-1)
    with pytest.raises(ValueError, match=r"'mps' has no graph streams"):
        get_current_stream("mps")
    with pytest.raises(TypeError, match=r"got 1\.5"):
        get_current_stream(1.5)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize(
    "device",
    ["cuda:1", "cuda", 0, torch.device("cuda", 0)],
    ids=["string-index-1", "string-bare", "int-0", "torch-device-0"],  # an id "cuda" would skip
)
def test_get_current_stream_refuses_a_cuda_device_without_cuda(device: Any) -> None:
    with pytest.raises(RuntimeError, match=r"is a 'cuda' device, but none is available here"):
        get_current_stream(device)


def test_get_current_stream_gives_the_cpu_stream_for_cpu_and_checks_during_capture() -> None:
    cpu = backend_for("cpu").current_stream()
    assert get_current_stream("cpu") is cpu and get_current_stream(torch.device("cpu")) is cpu
    if not torch.cuda.is_available():
        assert get_current_stream() is cpu
    seen: list[Any] = []
    errors: list[str] = []

    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        seen.append(get_current_stream("cpu"))
        try:
            get_current_stream("bogus")
        except ValueError as exc:
            errors.append(str(exc))
        return h + 1

    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        brk(torch.ones(1))
    graph.replay()
    assert len(seen) == 2 and seen[0] is not cpu  # the capturing stream, then the replay's
    assert seen[1] is cpu
    assert len(errors) == 2 and all("'bogus' is not a device" in e for e in errors)


# -- bcg check --divergence --backend cuda without CUDA ----------------------------------------

BUILDER = """
import torch

RAN = []

def make_check():
    RAN.append(1)
    return (lambda x: x * 2), [(torch.ones(2),), (torch.zeros(2),)]
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_check_divergence_on_cuda_without_cuda_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "builder_cuda.py"
    path.write_text(BUILDER)
    assert main(["check", f"{path}:make_check", "--divergence", "--backend", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("bcg check: --backend cuda needs a CUDA device")
    assert "--backend cpu" in lines[0]
    assert main(["check", f"{path}:make_check", "--divergence", "--backend", "cpu"]) == 0
    assert "ok" in capsys.readouterr().out


def test_a_pool_of_another_kind_is_refused_where_it_is_given() -> None:
    """A pool the backend cannot capture into is refused at construction, naming what to pass
    (the CPU backend used to take any object and share nothing through it)."""
    for bad in ("pool", 3, (1, 2), object()):
        with pytest.raises(TypeError, match="captures into its own pools"):
            BreakableCUDAGraph(pool=bad, backend="cpu")
        with pytest.raises(TypeError, match="captures into its own pools"):
            BreakableGraphRunner(torch.nn.Identity(), device="cpu", pool=bad)
        graph = BreakableCUDAGraph(backend="cpu")
        with pytest.raises(TypeError, match="captures into its own pools"):
            BreakableCUDAGraphCapture(graph, pool=bad)
        assert not is_breakable_capture_active()
    graph = BreakableCUDAGraph(backend="cpu")
    shared = BreakableCUDAGraph(pool=graph.pool(), backend="cpu")
    x = torch.ones(3)
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(shared):
        out = x + 1
    x.fill_(4)
    shared.replay()
    assert torch.equal(out, torch.full((3,), 5.0))
