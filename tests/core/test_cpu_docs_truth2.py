"""Second pass over what the docs promise (README, DESIGN.md, public docstrings, the CLI's own
help), on the CPU backend: each test is a documented behaviour, run."""

from __future__ import annotations

import warnings

import pytest
import torch

from bcg_core import (
    BreakableGraphRunner,
    check_capture,
    check_divergence,
    eager_on_graph,
    is_breakable_capture_active,
)


@eager_on_graph
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _step(x: torch.Tensor) -> torch.Tensor:
    return _plus_one(x * 2) * 3


def test_an_unknown_bcg_debug_word_counts_as_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # _env.py: "another value counts as off, with a warning once per value", as BCG_DISABLE and
    # BCG_PROFILE do. BCG_DEBUG=verbose raised ValueError in every capture's constructor: a
    # runner blocked every signature (served eagerly), check_capture raised.
    monkeypatch.setenv("BCG_DEBUG", "verbose-typo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = BreakableGraphRunner(_step, device="cpu")
        out = runner.capture(torch.ones(2))
        check = check_capture(_step, torch.ones(2))
    assert torch.equal(out, torch.full((2,), 9.0))
    assert runner.stats.captures == 1 and runner.blocked_signatures == {}
    assert torch.equal(runner(torch.zeros(2)), torch.full((2,), 3.0))
    assert runner.stats.hits == 1
    assert check.ok, check
    said = [w for w in caught if "BCG_DEBUG='verbose-typo'" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "strict" in str(said[0].message)


def test_the_debug_argument_still_refuses_another_word() -> None:
    from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture

    with pytest.raises(ValueError, match="debug must be"):
        BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu"), debug="verbose")


def test_bench_names_an_unknown_workload_in_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # bcg's main(): "2 for an unknown workload ... reported in one line on stderr"; it went to
    # stdout (a script reading the table from stdout got the error in it).
    from bcg_core.bench import main

    assert main(["bench", "--smoke", "no-such-workload"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "unknown workload" in lines[0], captured.err


@pytest.mark.parametrize(
    "flags", [["--backend", "cuda"], ["--atol", "0.1"], ["--rtol", "1e-3"], ["--seed", "3"]]
)
def test_check_refuses_divergence_options_without_divergence(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # --backend, --atol, --rtol and --seed are the divergence check's ("with --divergence" in
    # the help); a plain check always captures on the CPU backend. `bcg check --backend cuda`
    # printed "captures cleanly" from the CPU backend, the flag dropped silently.
    from bcg_core.bench import main

    assert main(["check", "bcg_core:is_in_breakable_cuda_graph", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bcg check: "), captured.err
    assert flags[0] in lines[0] and "--divergence" in lines[0]
    assert main(["check", "bcg_core:is_in_breakable_cuda_graph", "--backend", "cpu"]) == 0


def test_check_capture_refuses_what_is_not_callable_before_capturing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # It raised the raw "'int' object is not callable" from inside the capture, and logged the
    # capture-failure hint ("Rerun with BCG_DISABLE=1 ...") for a wrong argument.
    with (
        caplog.at_level("ERROR", logger="bcg_core"),
        pytest.raises(TypeError, match="check_capture"),
    ):
        check_capture(torch.ones(2))  # type: ignore[arg-type]
    assert caplog.records == []


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_a_runner_refuses_a_device_no_graph_backend_captures(device: str) -> None:
    # "device: the device static buffers live on and graphs capture for": a device type with no
    # graph backend fell back to CUDA's, so without CUDA every call ran eagerly saying "no CUDA
    # device is available" (and on a CUDA machine a capture was attempted for "mps").
    from bcg_diffusion import DiTRunner

    with pytest.raises(ValueError, match=f"no breakable graph backend for device type '{device}'"):
        BreakableGraphRunner(_step, device=device)
    with pytest.raises(ValueError, match="no breakable graph backend"):
        DiTRunner(_step, device=device)


def test_continuous_batching_refuses_a_model_on_a_device_without_graphs() -> None:
    transformers = pytest.importorskip("transformers")
    model_runner = pytest.importorskip("transformers.generation.continuous_batching.model_runner")
    import bcg_core

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to("meta").eval()
    model.set_attn_implementation("sdpa")
    compute = vars(model_runner.ModelRunner)["compute_batch"]
    # It was enabled, and the engine's runner then served every batch eagerly saying "no CUDA
    # device is available"; now refused before anything is patched, like the other refusals.
    with pytest.raises(ValueError, match="no breakable graph backend for device type 'meta'"):
        bcg_core.enable_continuous_batching(model)
    assert vars(model_runner.ModelRunner)["compute_batch"] is compute


def test_a_dit_runner_sets_a_token_for_each_replay_and_none_for_eager_calls() -> None:
    # replay_token_scope's docstring said DiTRunner "enters one for every call"; it enters one
    # for every replay: an eager call (a miss) and the capture see None (DESIGN, "Replay tokens").
    from bcg_diffusion import DiTRunner, get_current_replay_token

    seen: list[int | None] = []

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            seen.append(get_current_replay_token())
            return q * 2

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x + 1) - 1

    runner = DiTRunner(Model(), attention_classes=(Attention,), device="cpu")
    try:
        runner.capture(torch.ones(1, 2))
        assert seen == [None, None, None] and runner.stats.entries[0].breaks == 1
        seen.clear()
        runner(torch.ones(1, 2))
        runner(torch.ones(1, 2))
        runner(torch.ones(3, 2))  # no graph for this shape: eager
        assert seen[0] is not None and seen[1] is not None and seen[1] > seen[0]
        assert seen[2] is None
    finally:
        runner.close()


@pytest.mark.parametrize("seed", ["a", 1.5, True])
def test_check_divergence_refuses_a_seed_that_is_not_an_int_before_capturing(seed: object) -> None:
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    inputs = [(torch.ones(3),), (torch.zeros(3),)]
    with pytest.raises(TypeError, match="seed must be an int"):
        check_divergence(step, inputs, seed=seed, backend="cpu")  # type: ignore[arg-type]
    assert calls == []  # refused before any warm-up or capture
    assert not is_breakable_capture_active()
