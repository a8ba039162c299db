"""Holes found by porting, to bcg's API on the CPU backend, behaviours that sglang's, vLLM's and
Meta's breakable / piecewise CUDA graph test suites check and that the earlier ports
(test_cpu_peers_holes.py, test_cpu_peers2_holes.py) did not cover, each pinned by a test that
failed before its fix."""

from __future__ import annotations

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    ReplayError,
    describe_difference,
    eager_on_graph,
    enable_breakable_cuda_graph,
    signature_of,
)

# -- a later segment reading a 0-dim element of a buffer a break wrote ----------------------------


@eager_on_graph(strict=True, name="peers3.sum_into")
def _sum_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src.sum().unsqueeze(0))


def test_a_scalar_a_break_writes_into_its_argument_is_reread_at_replay() -> None:
    # Meta's package reduces into a one-element buffer in a break and fills with buffer[0] in
    # the next segment. With the buffer passed to the break (the strict=True pattern), the CPU
    # backend took buffer[0] for a 0-dim operand from outside the graph (only a break's
    # returned outputs counted as graph memory) and refused the second replay, telling the
    # user to "pass it through a break", which the value already was. On CUDA it is re-read.
    n = 4
    a, b, total = torch.ones(n, n), torch.empty(n, n), torch.empty(1)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        b.copy_(a * 2)
        _sum_into(b, total)
        b.fill_(total[0])
    for value in (1.0, 3.0, 0.5):
        a.fill_(value)
        graph.replay()
        assert torch.equal(total, torch.tensor([value * 2 * n * n]))
        assert torch.equal(b, torch.full((n, n), value * 2 * n * n))


def test_a_scalar_from_outside_the_graph_is_still_refused_when_it_changes() -> None:
    # The fix notes what a break *wrote*, not every argument: a 0-dim tensor the break only
    # reads stays outside the graph, and its change still refuses the segment reading it
    # (CUDA bakes a 0-dim CPU operand).
    sigma, x, out = torch.tensor(2.0), torch.ones(3), torch.empty(3)

    @eager_on_graph(name="peers3.reads_sigma")
    def reads_sigma(s: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(x * s)

    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        reads_sigma(sigma, out)
        out.mul_(sigma)
    sigma.fill_(3.0)
    with pytest.raises(ReplayError, match="0-dim"):
        graph.replay()


# -- a capture of a loss warns nothing that eager does not ---------------------------------------


def test_capturing_an_mse_loss_warns_nothing(recwarn: pytest.WarningsRecorder) -> None:
    # Meta's drop-in tests capture a whole training step with nn.MSELoss. The CPU recorder
    # tried mse_loss's out= overload on an output shaped like the result, which that overload
    # resizes (it uses its output as the elementwise scratch first): torch's deprecation
    # warning "An output with one or more elements was resized" was raised at the user's
    # F.mse_loss line, where eager warns nothing (and under -W error the capture failed).
    x, t = torch.randn(6, 4), torch.randn(6, 4)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        loss = torch.nn.functional.mse_loss(x * 2, t)
    assert [str(w.message) for w in recwarn] == []
    for _ in range(2):
        x.copy_(torch.randn(6, 4))
        t.copy_(torch.randn(6, 4))
        graph.replay()
        assert torch.equal(loss, torch.nn.functional.mse_loss(x * 2, t))


# -- describe_difference given one signature for the list -----------------------------------------


def test_describe_difference_given_one_signature_for_the_list_says_so() -> None:
    # sglang's diffusion runner tests explain a video's temporal-only shape miss against the
    # captured signatures. Passing the captured signature itself, not a list of it, failed with
    # a raw "too many values to unpack (expected 3)" from bcg's tree code.
    def video(frames: int) -> dict[str, torch.Tensor]:
        return {"hidden_states": torch.zeros(1, 16, frames, 6, 10), "timestep": torch.zeros(1)}

    serving, captured = signature_of((), video(5)), signature_of((), video(21))
    with pytest.raises(TypeError, match=r"pass \[other\]"):
        describe_difference(serving, captured)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="an item of others is int"):
        describe_difference(serving, [captured, 3])  # type: ignore[list-item]
    text = describe_difference(serving, [captured])
    assert "[1, 16, 5, 6, 10]" in text and "[1, 16, 21, 6, 10]" in text


def test_a_scalar_a_break_writes_from_its_closure_is_refused_with_the_way_out() -> None:
    # Meta's exact pattern: the break fills the buffer it closes over. The CPU backend cannot
    # see that write (only arguments and returns), so it still refuses the ambiguous 0-dim read;
    # its advice, "pass it through a break", read as already done: it now names the two ways
    # the backend sees (return it, or pass the buffer as an argument the break writes).
    n = 4
    a, b, total = torch.ones(n, n), torch.empty(n, n), torch.empty(1)

    @eager_on_graph(name="peers3.sum_closure")
    def sum_closure() -> None:
        total.copy_(b.sum().unsqueeze(0))

    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        b.copy_(a * 2)
        sum_closure()
        b.fill_(total[0])
    a.fill_(3.0)
    with pytest.raises(ReplayError, match="an argument it writes"):
        graph.replay()
