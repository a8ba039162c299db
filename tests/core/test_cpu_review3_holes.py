"""Holes found by the third review (diagnostics, CLI, patching, the decorator), each a test that
failed before its fix. CPU only: the CPU graph backend captures and replays."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    PatchHandle,
    breakable_graphs_disabled,
    check_divergence,
    eager_on_graph,
    enable_breakable_cuda_graph,
    patch_attribute,
)
from bcg_core.bench import main

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


# -- patch_attribute on an instance whose value is not in its __dict__ ---------------------------


def test_an_instance_patch_of_a_submodule_or_slot_is_restored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An nn.Module keeps submodules in _modules and a __slots__ class in a member descriptor:
    # bcg read "its own value" from __dict__ only, so release warned "replaced by other code"
    # and left the wrapper in the model for good (submodule), or raised vars()'s TypeError
    # with the handle already emptied, the patch left in place (slots).
    class Doubled(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * 2

    model = torch.nn.Sequential()
    model.attn = torch.nn.Linear(2, 2)
    original = model.attn
    with patch_attribute(model, "attn", Doubled):
        assert isinstance(model.attn, Doubled) and model.attn.inner is original
    assert model.attn is original
    assert PatchHandle.count(model, "attn") == 0

    class Slotted:
        __slots__ = ("f",)

        def __init__(self) -> None:
            self.f: Any = lambda: 1

    obj = Slotted()
    first = obj.f
    handle = patch_attribute(obj, "f", lambda f: lambda: f() + 1)
    assert obj.f() == 2
    handle.remove()
    assert obj.f is first
    assert PatchHandle.count(obj, "f") == 0
    assert "replaced by other code" not in caplog.text


# -- the divergence check -----------------------------------------------------------------------


def _xs(n: int = 3) -> list[torch.Tensor]:
    return [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def test_a_frozen_numpy_scalar_out_of_a_break_is_named() -> None:
    # np.float64 == np.float64 gives np.bool_, not bool: the check took the two values as not
    # comparable, so a frozen numpy output passed on to the next break went unseen and that
    # break was blamed ("break_itself": different tensors from identical arguments).
    np = pytest.importorskip("numpy")

    @eager_on_graph(name="np_absmax")
    def np_absmax(x: torch.Tensor) -> Any:
        return np.float64(x.abs().max().item())

    @eager_on_graph(name="apply")
    def apply(x: torch.Tensor, s: Any) -> torch.Tensor:
        return x / (s + 1.0)

    report = check_divergence(lambda x: apply(x, np_absmax(x)), _xs())
    assert report.status == "diverged", str(report)
    assert report.cause == "frozen_break_output", str(report)
    assert report.observed_at == "the outputs of break 'np_absmax' (call 1)"
    assert (report.segment, report.break_before, report.break_after) == (2, "np_absmax", "apply")


def test_a_nan_attribute_the_step_leaves_alone_is_not_state_it_changes() -> None:
    # float("nan") != float("nan"): a module holding NaN (an unset threshold) was reported
    # "stateful", blaming an attribute the step never touched.
    @eager_on_graph(name="double")
    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.threshold = float("nan")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return double(self.lin(x))

    with torch.no_grad():
        report = check_divergence(Block(), _xs())
    assert report.ok, str(report)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"atol": float("nan")}, ValueError, "atol and rtol must be >= 0"),
        ({"rtol": float("nan")}, ValueError, "atol and rtol must be >= 0"),
        ({"atol": "0.1"}, TypeError, "atol must be a number"),
    ],
)
def test_a_tolerance_that_is_no_number_is_refused_before_anything_runs(
    kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    # NaN passed the >= 0 check and failed after the capture inside torch.isclose; a string
    # failed on '<' between str and int.
    ran: list[int] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return x * 2

    with pytest.raises(error, match=words):
        check_divergence(step, _xs(), **kwargs)
    assert ran == []


def test_a_tensor_given_as_the_input_sets_is_refused() -> None:
    # list(tensor) is its rows: check_divergence(fn, x) checked fn on rows of x, "ok".
    with pytest.raises(TypeError, match="a list of input sets"):
        check_divergence(lambda x: x * 2, torch.randn(3, 4))


# -- the bcg command ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--repeats", "0"],
        ["demo", "--steps", "0"],
        ["bench", "--smoke", "--steps", "-1"],
        ["check", "x.py:f", "--divergence", "--atol", "nan"],
        ["check", "x.py:f", "--divergence", "--rtol", "-1"],
    ],
)
def test_counts_and_tolerances_out_of_range_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # --repeats 0 ended in statistics' "no median for empty data", --steps 0 in a
    # ZeroDivisionError after the whole run; a NaN or negative tolerance in a traceback.
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: bcg" in err and ("at least 1" in err or ">= 0" in err), err


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The run went to the end, then mkdir/write raised a traceback and the figures were lost.
    a_file = tmp_path / "results.txt"
    a_file.write_text("")
    for bad in (a_file / "out.json", tmp_path):
        assert main(["bench", "--smoke", "break-overhead", option, str(bad)]) == 2
        out, err = capsys.readouterr()
        assert out == "", out  # nothing ran
        assert err.startswith(f"bcg bench: {option} {bad}") and err.count("\n") == 1, err


# -- BCG_* variables with a value bcg does not read ---------------------------------------------


def test_a_flag_variable_with_an_unknown_value_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # BCG_DISABLE=2 (or "disable", "y") meant off without a word: a user ruling bcg out with it
    # kept bcg on and blamed something else.
    monkeypatch.setenv("BCG_DISABLE", " Review3-Odd ")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not breakable_graphs_disabled()
        assert not breakable_graphs_disabled()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "BCG_DISABLE='review3-odd'" in messages[0] and "BCG_DISABLE=1" in messages[0]
    for word in ("", "0", "off", "No", "1", "TRUE", " yes "):
        monkeypatch.setenv("BCG_DISABLE", word)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert breakable_graphs_disabled() is (word.strip().lower() in ("1", "true", "yes"))
