"""Holes found by the error-quality review (session 48): user mistakes at the public API that
reached a raw torch/Python error, or a bcg error naming the wrong function or the wrong cause."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    ReplayError,
    describe_difference,
    enable_breakable_cuda_graph,
    enable_continuous_batching,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
)
from bcg_diffusion import (
    DiTRunner,
    bucket_for,
    install_breakable_attention,
    is_breakable_attention_installed,
    make_breakable_attention_forward,
    pad_prompt,
)


@pytest.mark.parametrize("device", ["foo", None, "cuda:x"])
def test_a_malformed_runner_device_names_the_argument_and_the_accepted_forms(device: Any) -> None:
    # torch.device's raw "Expected one of cpu, cuda, ... device type" or "device() received an
    # invalid combination of arguments" named neither the runner nor a fix.
    with pytest.raises(
        ValueError, match=r"device must be a torch.device or a device string.*'cpu'"
    ):
        BreakableGraphRunner(lambda x: x * 2, device=device)


def test_capture_many_over_a_non_iterable_names_the_expected_list() -> None:
    runner = BreakableGraphRunner(lambda x: x * 2, device="cpu")
    # Was Python's raw "'int' object is not iterable".
    with pytest.raises(TypeError, match=r"capture_many takes a list of \(args, kwargs\) pairs"):
        runner.capture_many(5)  # type: ignore[arg-type]
    assert runner(torch.ones(2)).tolist() == [2.0, 2.0]  # still usable


def test_a_dit_runner_over_a_non_callable_names_dit_runner() -> None:
    # The message named BreakableGraphRunner, a class the DiTRunner user never wrote.
    with pytest.raises(TypeError, match=r"^DiTRunner wraps a callable"):
        DiTRunner(3)  # type: ignore[arg-type]


def test_attention_class_errors_name_no_other_function_and_spot_an_instance() -> None:
    # is_breakable_attention_installed(3) said "install_breakable_attention takes ...".
    with pytest.raises(TypeError) as caught:
        is_breakable_attention_installed(3)  # type: ignore[arg-type]
    assert "install_breakable_attention" not in str(caught.value)
    assert "attention classes with a forward or __call__" in str(caught.value)

    class Attention(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    # An instance for its class: now says to pass type(module).
    with pytest.raises(TypeError, match=r"type\(module\)"):
        install_breakable_attention(Attention())  # type: ignore[arg-type]
    assert not is_breakable_attention_installed(Attention)


def test_make_breakable_attention_forward_of_a_non_callable_names_itself() -> None:
    # Said "@eager_on_graph decorates a callable": a decorator the caller never used.
    with pytest.raises(TypeError, match=r"^make_breakable_attention_forward takes an attention"):
        make_breakable_attention_forward(None)  # type: ignore[type-var]


@pytest.mark.parametrize("model", [None, torch.nn.Linear(2, 2)], ids=["none", "module"])
def test_continuous_batching_over_a_non_transformers_model_says_so(model: Any) -> None:
    pytest.importorskip("transformers")
    # Said "the model's attention is None ... load the model with attn_implementation=sdpa":
    # wrong about the cause.
    with pytest.raises(TypeError, match=r"takes a transformers model .*got (NoneType|Linear)"):
        enable_continuous_batching(model)


def test_bucket_for_and_pad_prompt_name_their_bad_arguments() -> None:
    # Each was a raw TypeError ("'int' object is not iterable", "'>=' not supported between
    # instances of 'str' and 'int'", "'list' object has no attribute 'dim'").
    with pytest.raises(TypeError, match=r"buckets takes a collection of lengths.*got 8"):
        bucket_for(3, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"buckets takes a collection of lengths.*got None"):
        pad_prompt(torch.ones(1, 3, 4), None, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"length must be a number of tokens.*'3'"):
        bucket_for("3", [8])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pad_prompt takes tensors.*got list and NoneType"):
        pad_prompt([[[1.0]]], None, [8])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pad_prompt takes tensors.*got Tensor and list"):
        pad_prompt(torch.ones(1, 3, 4), [[1, 1, 1]], [8])  # type: ignore[arg-type]
    # The accepted forms still work.
    assert bucket_for(3, (8, 4)) == 4
    assert bucket_for(torch.tensor(3), [8]) == 8
    embeds, mask = pad_prompt(torch.ones(1, 3, 4), None, [8])
    assert embeds.shape == (1, 8, 4) and mask.sum().item() == 3


def test_describe_difference_over_a_non_list_names_others() -> None:
    with pytest.raises(TypeError, match=r"describe_difference takes a list of signatures.*int"):
        describe_difference(3, 4)  # type: ignore[arg-type]


def test_reset_inside_a_capture_says_when_to_call_it_and_leaves_no_capture_behind() -> None:
    # The message said only what happened ("reset() was called while this graph is being
    # captured"), not what to do.
    graph = BreakableCUDAGraph(backend="cpu")
    x = torch.ones(4)
    after = r"call it after the capture's with block has exited"
    with (
        pytest.raises(ReplayError, match=after),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        _ = x * 2
        graph.reset()
    assert not is_breakable_capture_active() and not is_in_breakable_cuda_graph()
    graph.reset()  # as the message says: the graph can be captured again
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        y = x * 2
    x.fill_(3.0)
    graph.replay()
    assert y.tolist() == [6.0] * 4
