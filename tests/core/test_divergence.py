"""The divergence check: replay vs eager, break call by break call, naming the first segment that
differs. Scenarios with the ``device`` fixture run on the CPU graph backend and, on a GPU, on CUDA
graphs with the same assertions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    DivergenceReport,
    check_divergence,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
)
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701
from bcg_core.bench import main


def _line_of(marker: str) -> str:
    """``file:line`` of the line of this file that ends with the comment ``# marker``."""
    with open(__file__, encoding="utf-8") as source:
        for number, line in enumerate(source, start=1):
            if line.rstrip().endswith(f"# {marker}"):
                return f"{__file__}:{number}"
    raise AssertionError(f"no line marked {marker!r}")


def _sets(n: int = 3, *shape: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randn(shape or (2, 8), generator=gen, device="cpu").to(torch.get_default_device())
        for _ in range(n)
    ]


@eager_on_graph(name="mix")
def mix(h: torch.Tensor) -> torch.Tensor:
    return h * 2 + 1


@eager_on_graph(name="absmax")
def absmax(x: torch.Tensor) -> float:
    return float(x.abs().max().item())


@eager_on_graph(name="absmax_t")
def absmax_t(x: torch.Tensor) -> torch.Tensor:
    return x.abs().max()


def _diverged(report: DivergenceReport, segment: int | None, before: Any, after: Any) -> None:
    assert report.status == "diverged", str(report)
    assert not report.ok
    assert (report.segment, report.break_before, report.break_after) == (segment, before, after)
    assert report.diffs
    assert "REPLAY DIFFERS FROM EAGER" in str(report)


# -- (a) a Python float from .item() ------------------------------------------------------------


def test_item_returned_by_a_break_is_frozen_into_the_next_segment(device: str) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        h = mix(x)
        scale = absmax(h)
        return mix(h / (scale + 1.0))  # uses-scale

    report = check_divergence(model, _sets())
    _diverged(report, 3, "absmax", "mix")
    assert report.cause == "frozen_break_output"
    assert report.observed_at == "the outputs of break 'absmax' (call 2)"
    (diff,) = report.diffs
    assert diff.path == "output" and diff.shape is None and "frozen at capture" in diff.detail
    if device == "cpu":
        assert report.source_lines == (_line_of("uses-scale"),)

    def fixed(x: torch.Tensor) -> torch.Tensor:
        h = mix(x)
        return mix(h / (absmax_t(h) + 1.0))

    assert check_divergence(fixed, _sets()).ok


def test_item_taken_by_the_caller_and_passed_as_a_float(device: str) -> None:
    def model(x: torch.Tensor, scale: float) -> torch.Tensor:
        return mix(x * scale)  # baked-scale

    xs = _sets()
    report = check_divergence(model, [(x, x.abs().max().item()) for x in xs])
    _diverged(report, 1, None, "mix")
    assert report.cause == "baked_in_segment" and report.input_set == 1
    (diff,) = report.diffs
    assert diff.path == "args[0]" and diff.shape == (2, 8)
    assert diff.max_abs_diff is not None and diff.max_abs_diff > 0
    if device == "cpu":
        assert report.source_lines == (_line_of("baked-scale"),)

    def fixed(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return mix(x * scale)

    assert check_divergence(fixed, [(x, x.abs().max()) for x in xs]).ok


# -- (b) a host list turned into a tensor inside the segment ------------------------------------


def test_host_list_made_a_tensor_inside_the_segment_cpu() -> None:
    # CPU only: on CUDA, torch.tensor(host_list) inside a segment copies host to device
    # synchronously, which CUDA capture refuses (a loud failure, not a silent one).
    def model(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        h = mix(x)
        lens = torch.tensor(lengths)  # list-to-tensor
        visible = torch.arange(8) < lens[:, None]
        return mix(h * visible)

    xs = _sets()
    sets = [((xs[0], [3, 5]), {}), ((xs[1], [3, 5]), {}), ((xs[2], [7, 2]), {})]
    report = check_divergence(model, sets)
    _diverged(report, 2, "mix", "mix")
    assert report.input_set == 2 and report.cause == "baked_in_segment"
    assert report.observed_at == "the arguments of break 'mix' (call 2)"
    assert _line_of("list-to-tensor") in report.source_lines

    def fixed(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return mix(mix(x) * (torch.arange(8) < lengths[:, None]))

    assert check_divergence(
        fixed, [(x, torch.tensor(n)) for x, n in zip(xs, [[3, 5], [3, 5], [7, 2]], strict=True)]
    ).ok


def test_host_list_passed_to_a_break_is_frozen(device: str) -> None:
    @eager_on_graph(name="mask")
    def mask(h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return h * (torch.arange(h.shape[1]) < torch.tensor(lengths)[:, None])

    def model(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return mix(mask(x + 1, lengths))

    xs = _sets()
    report = check_divergence(model, [(xs[0], [3, 5]), (xs[1], [6, 1])])
    _diverged(report, 1, None, "mask")
    assert report.cause == "frozen_break_argument"
    assert [d.path for d in report.diffs if d.shape is None] == ["args[1][0]", "args[1][1]"]


# -- (c) varlen attention whose lengths are not a break input -----------------------------------


@eager_on_graph(name="attention")
def attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, kv, kv, attn_mask=visible)


class HostMetadata:
    """Engine-side metadata, one object updated in place before every step."""

    def __init__(self) -> None:
        self.lengths: list[int] = []


@eager_on_graph(name="attention_host")
def attention_host(q: torch.Tensor, kv: torch.Tensor, meta: HostMetadata) -> torch.Tensor:
    visible = torch.stack([torch.arange(kv.shape[-2]) < n for n in meta.lengths])
    return F.scaled_dot_product_attention(q, kv, kv, attn_mask=visible[:, None, None, :])


def _varlen_sets() -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    gen = torch.Generator().manual_seed(3)
    dev = torch.get_default_device()
    out = []
    for lengths in ([5, 3], [5, 3], [2, 8]):
        q, kv = (torch.randn(2, 2, 1, 4, generator=gen, device="cpu").to(dev) for _ in range(2))
        out.append(
            (q, torch.randn(2, 2, 8, 4, generator=gen, device="cpu").to(dev) + kv.mean(), lengths)
        )
    return out


def test_varlen_attention_mask_from_host_lengths(device: str) -> None:
    def model(q: torch.Tensor, kv: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q = mix(q)
        visible = torch.stack([torch.arange(8) < n for n in lengths])  # varlen-mask
        return attention(q * 0.5, kv, visible[:, None, None, :]) + 1

    report = check_divergence(model, _varlen_sets())
    _diverged(report, 2, "mix", "attention")
    assert report.input_set == 2
    assert [d.path for d in report.diffs] == ["args[2]"]
    assert report.diffs[0].shape == (2, 1, 1, 8) and report.diffs[0].max_abs_diff == 1.0
    if device == "cpu":
        assert _line_of("varlen-mask") in report.source_lines


def test_varlen_attention_fixed_with_a_tensor_or_host_metadata_in_the_break(device: str) -> None:
    def with_tensor(q: torch.Tensor, kv: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        visible = torch.arange(8) < lengths[:, None]
        return attention(mix(q) * 0.5, kv, visible[:, None, None, :]) + 1

    sets = _varlen_sets()
    assert check_divergence(with_tensor, [(q, kv, torch.tensor(n)) for q, kv, n in sets]).ok

    meta = HostMetadata()

    def with_metadata(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return attention_host(mix(q) * 0.5, kv, meta) + 1

    def step(q: torch.Tensor, kv: torch.Tensor, lengths: list[int]) -> Any:
        def prepare() -> tuple[torch.Tensor, torch.Tensor]:
            meta.lengths = lengths  # the engine updates its metadata before each step
            return q, kv

        return prepare

    assert check_divergence(with_metadata, [step(*s) for s in sets]).ok


# -- control flow, randomness, tolerance ---------------------------------------------------------


def test_python_branch_on_a_host_value_changes_the_breaks(device: str) -> None:
    def model(x: torch.Tensor, deep: bool) -> torch.Tensor:
        h = mix(x)
        if deep:
            h = absmax_t(h) * h
        return mix(h)

    xs = _sets(2)
    report = check_divergence(model, [(xs[0], False), (xs[1], True)])
    _diverged(report, 2, "mix", "mix")
    assert report.cause == "break_sequence"
    assert "eager called 'absmax_t', replay 'mix'" in report.diffs[0].detail


def test_dropout_with_the_same_seed_is_not_a_divergence(device: str) -> None:
    @eager_on_graph(name="noisy")
    def noisy(h: torch.Tensor) -> torch.Tensor:
        return h + torch.rand_like(h)

    def model(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x * 2, p=0.5, training=True)
        h = F.dropout(noisy(h), p=0.3, training=True)
        return mix(h) + torch.randn_like(h)

    report = check_divergence(model, _sets(3, 64, 32), seed=11)
    assert report.ok, str(report)
    assert report.segments == 3 and report.breaks == 2


def test_unseeded_randomness_is_reported_as_nondeterministic(device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(0)

    @eager_on_graph(name="jitter")
    def jitter(h: torch.Tensor) -> torch.Tensor:
        # draws from its own generator, which no seed resets
        return h + 1e-6 * torch.randn(h.shape, generator=gen, device=h.device)

    def model(x: torch.Tensor) -> torch.Tensor:
        return mix(jitter(x * 2))

    report = check_divergence(model, _sets())
    assert report.status == "nondeterministic" and not report.ok
    assert report.observed_at == "the outputs of break 'jitter' (call 1)"
    assert "EAGER IS NOT REPRODUCIBLE" in str(report)
    assert check_divergence(model, _sets(), atol=1e-4).ok


@pytest.mark.cuda
def test_cuda_replay_after_manual_seed_redraws_eager_dropout() -> None:
    # The check's RNG rule on CUDA: a graph reads the generator's seed and offset at replay
    # (torch's graph-safe philox), segment by segment, so manual_seed(s) before a replay gives
    # the numbers eager draws after manual_seed(s), breaks that draw in between included.
    x = torch.ones(128, 128, device="cuda")

    @eager_on_graph(name="noise")
    def noise(h: torch.Tensor) -> torch.Tensor:
        return h + torch.rand_like(h)

    def step() -> torch.Tensor:
        h = F.dropout(noise(F.dropout(x, 0.5, training=True)), 0.5, training=True)
        return h * torch.rand_like(h)

    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph():
        step()
        torch.cuda.synchronize()
        with BreakableCUDAGraphCapture(graph):
            static = step()
        torch.manual_seed(5)
        eager = step()
    for _ in range(2):
        torch.manual_seed(5)
        graph.replay()
        assert torch.equal(static, eager)
    graph.replay()  # without reseeding: fresh numbers
    assert not torch.equal(static, eager)


# -- the runner ----------------------------------------------------------------------------------


class Adapters(torch.nn.Module):
    """A LoRA-style adapter index kept on the host: a classic value baked at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = [0.5, 2.0]
        self.adapter = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mix(x * self.scales[self.adapter])


def test_runner_checks_a_captured_signature(device: str) -> None:
    model = Adapters()
    runner = BreakableGraphRunner(model, device=device)
    x, y = _sets(2)
    runner.capture(x)
    assert runner.check_divergence(y).ok
    model.adapter = 1
    report = runner.check_divergence(y)
    _diverged(report, 1, None, "mix")
    assert report.input_set == 1 and report.input_sets == 2
    with pytest.raises(ValueError, match="no graph is captured for this call's signature"):
        runner.check_divergence(torch.zeros(3, 3))


# -- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_raise_before_anything_runs() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        return mix(x)

    with pytest.raises(ValueError, match="at least two input sets"):
        check_divergence(model, [torch.zeros(2)])
    with pytest.raises(ValueError, match=r"input set 1: args\[0\] is a tensor \[3\].*\[2\]"):
        check_divergence(model, [torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="input set 1 has another structure"):
        check_divergence(model, [(torch.zeros(2),), (torch.zeros(2), 1)])
    with pytest.raises(ValueError, match="backend must be"):
        check_divergence(model, [torch.zeros(2)] * 2, backend="mps")
    with pytest.raises(ValueError, match="atol and rtol"):
        check_divergence(model, [torch.zeros(2)] * 2, atol=-1)
    assert not is_breakable_capture_active() and not hooks_installed()


# -- the demo: the toy decoder with varlen attention from host lengths --------------------------

DEMO = Path(__file__).resolve().parents[2] / "benchmarks" / "divergence_demo.py"


def _demo_main() -> Any:
    spec = importlib.util.spec_from_file_location("divergence_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_demo_on_the_cpu_backend(capsys: pytest.CaptureFixture[str]) -> None:
    # The attention break updates each layer's KV cache: state that the runs leave identical.
    assert _demo_main()(["--backend", "cpu", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "diverging graph segment 1: from the start of the step, before break " in out
    assert "args[6] shape (2, 256)" in out and "divergence_demo.py:" in out
    assert out.count("ok, replay equals eager") == 1


@pytest.mark.cuda
def test_demo_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert _demo_main()(["--backend", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "diverging graph segment 1" in out and "args[6] shape (2, 256)" in out


# -- the CLI -------------------------------------------------------------------------------------

CLI_MODEL = """
import torch
from bcg_core import eager_on_graph

@eager_on_graph(name="mix")
def mix(h):
    return h * 2

def model(x, lengths):
    h = mix(x)
    return mix(h * (torch.arange(4) < torch.tensor(lengths)[:, None]))

def fixed(x, lengths):
    return mix(mix(x) * (torch.arange(4) < lengths[:, None]))

def bad():
    xs = [torch.ones(2, 4) * i for i in range(3)]
    return model, [(xs[0], [1, 2]), (xs[1], [1, 2]), (xs[2], [3, 4])]

def good():
    xs = [torch.ones(2, 4) * i for i in range(3)]
    return fixed, [(x, torch.tensor(n)) for x, n in zip(xs, [[1, 2], [1, 2], [3, 4]])]
"""


def test_cli_divergence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "div_model.py"
    path.write_text(CLI_MODEL)
    assert main(["check", f"{path}:bad", "--divergence"]) == 1
    out = capsys.readouterr().out
    assert "REPLAY DIFFERS FROM EAGER" in out and "diverging graph segment 2" in out
    assert f"{path}:11" in out
    assert main(["check", f"{path}:good", "--divergence", "--atol", "0"]) == 0
    assert "ok, replay equals eager" in capsys.readouterr().out
