"""Holes found in the CPU backend's fidelity to CUDA graphs (review 17, second pass), each pinned
by a test: code the CPU backend captured or replayed otherwise than a CUDA graph would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from graph_helpers import cpu_capture

from bcg_core import (
    CaptureError,
    check_capture,
    eager_on_graph,
    get_current_stream,
)
from bcg_core._backends import backend_for  # noqa: PLC2701
from bcg_core._errors import HostSyncError, capture_refusal_hint  # noqa: PLC2701

_A = torch.tensor([[4.0, 1.0], [1.0, 3.0]])


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: torch.linalg.svd(a),
        lambda a: torch.linalg.svdvals(a),
        lambda a: torch.linalg.matrix_norm(a, 2),
        lambda a: torch.linalg.matrix_rank(a),
        lambda a: torch.linalg.eigh(a),
        lambda a: torch.linalg.eigvalsh(a),
        lambda a: torch.linalg.eig(a),
        lambda a: torch.linalg.eigvals(a),
        lambda a: torch.linalg.pinv(a),
    ],
    ids=["svd", "svdvals", "norm2", "matrix_rank", "eigh", "eigvalsh", "eig", "eigvals", "pinv"],
)
def test_a_decomposition_checking_its_convergence_is_a_host_sync(
    fn: Callable[[torch.Tensor], Any],
) -> None:
    # torch's _linalg_svd, _linalg_eigh and linalg_eig kernels end in _linalg_check_errors, which
    # reads the info tensor on the host on CUDA (a capture refuses it); on the CPU that call is
    # below the dispatcher, so the CPU backend captured and replayed them.
    with pytest.raises(HostSyncError, match="info tensor") as info:
        cpu_capture(lambda: fn(_A * 1))
    assert "@eager_on_graph" in str(info.value)
    report = check_capture(fn, _A)
    assert not report.ok


def test_a_decomposition_of_an_empty_matrix_still_captures() -> None:
    # The kernels return before their check for an empty input: nothing is read on the host.
    graph, (_, s, _) = cpu_capture(lambda: torch.linalg.svd(torch.zeros(0, 0) * 1))
    graph.replay()
    assert s.shape == (0,)


def test_a_draw_from_a_private_generator_is_refused_as_on_cuda() -> None:
    # torch refuses a random op on a CUDA generator the graph was not given ("Attempt to
    # increase offset for a CUDA generator not in capture mode"); the CPU backend captured it
    # and drew from it at every replay, so check_capture said ok for a step CUDA cannot capture.
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(3)
    with pytest.raises(CaptureError, match=r"private torch\.Generator") as info:
        cpu_capture(lambda: x + torch.rand(3, generator=gen))
    assert "@eager_on_graph" in str(info.value) and "test_cpu_review17" in str(info.value)
    assert not check_capture(lambda t: t.uniform_(generator=gen), x).ok
    # On CUDA the runner's capture-failure reason carries the same advice for torch's error.
    cuda = RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode.")
    assert "default generator" in (capture_refusal_hint(cuda) or "")
    # The default generator, named or not, is the graph's own: drawn anew at every replay.
    graph, out = cpu_capture(lambda: x + torch.rand(3, generator=torch.default_generator))
    first = out.clone()
    graph.replay()
    assert not torch.equal(out, first)
    # Nothing was left behind: the next capture records.
    graph, out = cpu_capture(lambda: x + 1)
    x.fill_(2)
    graph.replay()
    assert out.tolist() == [3.0, 3.0, 3.0]


def test_a_private_generator_in_a_break_replays() -> None:
    gen = torch.Generator().manual_seed(0)

    @eager_on_graph(name="review17.noise")
    def noise(t: torch.Tensor) -> torch.Tensor:
        return t + torch.rand(t.shape, generator=gen)

    x = torch.zeros(3)
    graph, out = cpu_capture(lambda: noise(x * 1) * 2)
    first = out.clone()
    graph.replay()
    assert not torch.equal(out, first)


@pytest.mark.parametrize(
    ("what", "sync"),
    [
        ("Stream.synchronize", lambda: get_current_stream().synchronize()),
        ("Event.synchronize", lambda: backend_for("cpu").new_event().synchronize()),
        ("synchronize", lambda: backend_for("cpu").synchronize()),
    ],
    ids=["stream", "event", "backend"],
)
def test_waiting_for_the_device_inside_a_segment_is_a_host_sync(
    what: str, sync: Callable[[], None]
) -> None:
    # cudaStreamSynchronize / cudaEventSynchronize / cudaDeviceSynchronize inside a capture are
    # refused (and invalidate it); the CPU stand-ins did nothing, so the capture went on.
    x = torch.ones(3)

    def step() -> torch.Tensor:
        y = x * 2
        sync()
        return y + 1

    with pytest.raises(HostSyncError, match=what) as info:
        cpu_capture(step)
    assert "@eager_on_graph" in str(info.value)
    assert not check_capture(step).ok
    sync()  # outside a segment: nothing to wait for

    @eager_on_graph(name="review17.waits")
    def waits(t: torch.Tensor) -> torch.Tensor:
        sync()  # a break runs eagerly: waiting is fine there
        return t + 1

    graph, out = cpu_capture(lambda: waits(x * 2))
    x.fill_(3)
    graph.replay()
    assert out.tolist() == [7.0, 7.0, 7.0]


def test_reseeding_inside_a_segment_is_refused_or_a_no_op_as_on_cuda() -> None:
    # CUDA's generator refuses a new seed during capture ("set_current_seed can be called during
    # stream capture only if new seed is the same as the original seed") and ignores the same
    # seed. The CPU backend reseeded at capture (replays never did), so a segment reseeding to
    # another value captured, and one reseeding to the same value drew other numbers than CUDA.
    # (torch.manual_seed is not torch.random's once dynamo is imported: dynamo wraps it.)
    seeders = (torch.manual_seed, torch.random.manual_seed)
    torch.manual_seed(5)
    x = torch.zeros(2)
    with pytest.raises(CaptureError, match="seed") as info:
        cpu_capture(lambda: (torch.manual_seed(6), x + torch.rand(2))[1])
    assert "@eager_on_graph" in str(info.value)
    with pytest.raises(CaptureError, match="seed"):
        cpu_capture(lambda: (torch.seed(), x + 1)[1])
    assert torch.initial_seed() == 5
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    graph, out = cpu_capture(lambda: (torch.random.manual_seed(5), x + torch.rand(2))[1])
    assert out.tolist() == expected[:2].tolist()  # the same seed did not reset the generator
    graph.replay()
    assert out.tolist() == expected[2:].tolist()
    torch.manual_seed(7)  # outside a segment: reseeds as always
    assert torch.initial_seed() == 7 and (torch.manual_seed, torch.random.manual_seed) == seeders


def test_a_copy_to_the_host_inside_a_segment_is_a_host_sync() -> None:
    # .cpu() in code written for a device copies to the host and waits for it, which a CUDA
    # capture refuses; on CPU tensors it is a no-op that dispatches nothing, so it captured.
    x = torch.ones(3)
    with pytest.raises(HostSyncError, match=r"Tensor\.cpu") as info:
        cpu_capture(lambda: (x * 2).cpu() + 1)
    assert "@eager_on_graph" in str(info.value)
    assert x.cpu() is x and "Tensor.cpu" not in repr(torch.Tensor.cpu)  # hook removed

    @eager_on_graph(name="review17.to_host")
    def to_host(t: torch.Tensor) -> torch.Tensor:
        return t.cpu() + 1  # a break runs eagerly: copying to the host is fine there

    graph, out = cpu_capture(lambda: to_host(x * 2))
    x.fill_(3)
    graph.replay()
    assert out.tolist() == [7.0, 7.0, 7.0]
