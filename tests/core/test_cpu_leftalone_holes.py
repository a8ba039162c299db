"""Holes around patches and hooks (session leftalone): bcg's temporary hooks removed while
another library's patch sits over them, ``bcg bench --json`` recording its settings, and a step
that returns a view of its argument."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from graph_helpers import cpu_capture

from bcg_core import BreakableGraphRunner, PatchHandle, patch_attribute
from bcg_core._patching import hook_attribute  # noqa: PLC2701
from bcg_core.bench import main


@pytest.fixture
def _restore_manual_seed() -> Iterator[None]:
    saved = torch.manual_seed, torch.random.manual_seed
    yield
    torch.manual_seed, torch.random.manual_seed = saved


def _counting(calls: list[Any]) -> Callable[[Any], Any]:
    def wrap(original: Any) -> Any:
        def patched(seed: Any) -> Any:
            calls.append(seed)
            return original(seed)

        return patched

    return wrap


@pytest.mark.usefixtures("_restore_manual_seed")
def test_a_patch_made_over_the_cpu_hooks_during_a_capture_survives_their_removal() -> None:
    calls: list[Any] = []
    theirs: list[Any] = []
    under: list[Any] = []
    original = torch.manual_seed  # not torch.random's once dynamo is imported (it wraps it)
    own = torch.random.manual_seed

    def step() -> torch.Tensor:
        # Another library patches torch.manual_seed while bcg's capture hooks are installed.
        under.append(torch.manual_seed)
        torch.manual_seed = _counting(calls)(torch.manual_seed)
        theirs.append(torch.manual_seed)
        return torch.ones(2) * 2

    try:
        cpu_capture(step)
        # Restoring the saved original dropped their patch.
        assert torch.manual_seed is theirs[0]
        torch.manual_seed(5)  # theirs, then bcg's old hook, now only forwarding
        assert calls == [5]
        assert torch.default_generator.initial_seed() == 5
        # A later capture installs the hooks again, over their patch: a reseed is still refused.
        with pytest.raises(Exception, match="reseeds the generator"):
            cpu_capture(lambda: torch.manual_seed(6))
        assert torch.manual_seed is theirs[0]
        assert torch.default_generator.initial_seed() == 5
        # They undo their patch, putting bcg's pass-through back on top: the next capture's
        # hooks restore torch's own function, as if nobody had patched it.
        torch.manual_seed = under[0]
        assert torch.manual_seed is not original
        cpu_capture(lambda: torch.ones(1) + 1)
        assert torch.manual_seed is original and torch.random.manual_seed is own
    finally:
        torch.manual_seed = original


class _Target:
    def greet(self, who: str) -> str:
        return f"hello {who}"


def test_hook_attribute_leaves_a_later_patch_working_and_removes_cleanly_when_alone() -> None:
    def loud(original: Any) -> Any:
        return lambda self, who: original(self, who).upper()

    remove = hook_attribute(_Target, "greet", loud)
    assert _Target().greet("a") == "HELLO A"
    remove()
    assert "greet" in vars(_Target)  # its own attribute, restored as is
    assert _Target().greet("a") == "hello a"

    class _Child(_Target):
        pass

    remove = hook_attribute(_Child, "greet", loud)
    assert _Child().greet("b") == "HELLO B"
    under = _Child.greet
    _Child.greet = lambda self, who: "[" + under(self, who) + "]"  # type: ignore[method-assign]
    remove()
    remove()  # twice: nothing more
    assert _Child().greet("b") == "[hello b]"  # theirs kept, ours under it only forwards
    remove = hook_attribute(_Child, "greet", loud)
    assert _Child().greet("c") == "[HELLO C]".upper()
    remove()
    assert _Child().greet("c") == "[hello c]"

    class _Plain(_Target):
        pass

    remove = hook_attribute(_Plain, "greet", loud)
    remove()
    assert "greet" not in vars(_Plain)  # inherited before: inherited again


def test_the_cuda_stream_hooks_keep_a_patch_made_over_them() -> None:
    from bcg_core._backends.cuda import _install_stream_hooks  # noqa: PLC2701

    record, enter = torch.cuda.Event.record, vars(torch.cuda.Stream).get("__enter__")
    before = torch.cuda.set_stream
    uninstall = _install_stream_hooks(lambda: None)
    ours = torch.cuda.set_stream
    seen: list[Any] = []

    def theirs(stream: Any) -> None:
        seen.append(stream)
        ours(stream)

    torch.cuda.set_stream = theirs
    try:
        uninstall()
        assert torch.cuda.set_stream is theirs  # not overwritten by the saved original
        assert torch.cuda.Event.record is record  # the untouched ones are restored
        assert vars(torch.cuda.Stream).get("__enter__") is enter
    finally:
        torch.cuda.set_stream = before


def test_bench_json_records_the_runs_settings(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--smoke", "--repeats", "2", "--steps", "1", "break-overhead"]
    assert main([*argv, "--skip", "nothing-such", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["settings"] == {
        "device": "cpu",
        "smoke": True,
        "repeats": 2,
        "steps": 1,
        "skip": ["nothing-such"],
        "workloads": ["break-overhead"],
        "cases": {"break-overhead": list(dict.fromkeys(m["case"] for m in data["measurements"]))},
    }
    assert data["environment"]["torch"] == torch.__version__
    assert data["environment"]["date"]


def _views_of(x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x[1:], x.t(), x[:, 0], x.add_(1)[0], h * 2


@pytest.mark.parametrize("views", [False, True])
def test_a_returned_view_of_an_argument_is_that_view_of_the_caller_s_tensor(views: bool) -> None:
    # Eager returns views of the argument; a replay returned clones of views of its static
    # buffer (or, with return_views, the buffer's views): writes through them missed the
    # caller's tensor.
    runner = BreakableGraphRunner(_views_of, device="cpu", return_views=views)
    for i in range(4):
        x, h = torch.full((3, 2), float(i)), torch.ones(2)
        got = runner.capture(x, h) if i == 0 else runner(x, h)
        if i:  # (the capture ran the step 3 times: x.add_(1) advanced x that often)
            assert torch.equal(x, torch.full((3, 2), i + 1.0))
        expected = (x[1:], x.t(), x[:, 0], x[0])  # eager's views of the caller's tensor
        for mine, eager in zip(got[:4], expected, strict=True):
            assert mine.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            assert mine.stride() == eager.stride()
            assert mine.storage_offset() == eager.storage_offset()
            assert torch.equal(mine, eager)
        assert torch.equal(got[4], h * 2)
        got[0].fill_(-1)  # reaches the caller's tensor, as eager
        assert torch.equal(x[1:], torch.full((2, 2), -1.0))
    assert runner.stats.hits == 3
    # A non-contiguous argument (laid out unlike a contiguous buffer) is served right.
    x = torch.arange(12.0).reshape(3, 4)[:, ::2]
    got = runner(x, torch.ones(2))
    for mine, eager in zip(got[:4], (x[1:], x.t(), x[:, 0], x[0]), strict=True):
        assert torch.equal(mine, eager)


def _tag(text: str) -> Callable[[Any], Any]:
    def wrap(original: Any) -> Any:
        return lambda *args: f"{text}({original(*args)})"

    return wrap


def test_a_wrap_raising_at_release_does_not_leave_the_handle_s_other_patches() -> None:
    class _A:
        def f(self) -> str:
            return "A"

    class _B:
        def g(self) -> str:
            return "B"

    made = [0]

    def flaky(original: Any) -> Any:
        made[0] += 1
        if made[0] == 2:  # recomposed when the handle below is released
            raise ValueError("flaky wrap")
        return _tag("fl")(original)

    both = PatchHandle.patch_all([(_B, "g", _tag("w")), (_A, "f", _tag("w"))])
    other = patch_attribute(_A, "f", flaky)
    assert (_A().f(), _B().g()) == ("fl(w(A))", "w(B)")
    with pytest.raises(ValueError, match="flaky wrap"):
        both.remove()
    assert _B().g() == "B"  # released although _A.f's recomposition raised first
    assert "g" in vars(_B)
    assert PatchHandle.count(_B, "g") == 0
    other.remove()
    assert _A().f() == "A"
    assert PatchHandle.count(_A, "f") == 0


def test_a_capture_keeps_dynamo_s_wrap_of_torch_manual_seed() -> None:
    # Importing dynamo wraps torch.manual_seed (not torch.random's) in a dynamo-disabled
    # function; the capture hooks once restored both names to torch.random's, dropping it.
    import torch._dynamo

    seeders = (torch.manual_seed, torch.random.manual_seed)
    cpu_capture(lambda: torch.ones(1) + 1)
    assert (torch.manual_seed, torch.random.manual_seed) == seeders
