"""The diffusers families of ``test_cpu_diffusers_families`` on a real GPU (float32, as on the
CPU: some families feed the timestep to their embedders as given): every attention op a break
(Mochi's host-reading processor one whole break), replays of new latents and timesteps equal
eager bit for bit, and the models that cannot be captured refused and served eagerly, equal.
Some only on CUDA: they copy pageable host tensors to the device inside the forward (rotary
tables built on the host), which the CPU backend cannot see (there is no copy there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree  # noqa: PLC2701
from torch.overrides import TorchFunctionMode

from bcg_core import is_in_breakable_cuda_graph
from bcg_diffusion import DiTRunner, make_attention_ops_breakable

pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)

from test_cpu_diffusers_families import FAMILIES, HOST_READERS, REPLAYED

pytestmark = pytest.mark.cuda

_DTYPE = torch.float32
# Capture fails on CUDA only: "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
CUDA_HOST_COPIES = {"chroma", "chronoedit", "cogview4", "kandinsky5", "ltx2", "qwenimage"}


class _CountSDPA(TorchFunctionMode):
    """Counts the calls of ``F.scaled_dot_product_attention`` from Python: on CUDA its math
    backend decomposes below the dispatcher, so a dispatch-level count (the CPU tests') misses
    the calls that take it. torch's own callers inside ``F.multi_head_attention_forward``
    (HunyuanDiT's pooled text embedding, which stays captured) are not counted either."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.count += 1
        return func(*args, **(kwargs or {}))


def attention_ops(step: Callable[..., torch.Tensor], latents: torch.Tensor) -> int:
    with torch.no_grad(), _CountSDPA() as counter:
        step(latents, torch.ones(1, device="cuda"))
    return counter.count


def _on_cuda(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("cuda", _DTYPE if value.is_floating_point() else None)
    return value


def _cuda_step(family: str) -> tuple[torch.nn.Module, Callable[..., torch.Tensor], torch.Tensor]:
    model, kwargs, latents = FAMILIES[family]()
    model = model.to("cuda", _DTYPE).eval()
    # The families' constant inputs (text embeddings, masks) are CPU tensors made once: moved
    # once, on the first (eager) call, since a capture may not copy pageable host memory.
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_cuda(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.is_cuda:
            return value
        if id(value) not in moved:
            moved[id(value)] = (value, _on_cuda(value))
        return moved[id(value)][1]

    def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(**pytree.tree_map(on_cuda, kwargs(x, t)), return_dict=False)
        out = out[0] if isinstance(out, tuple) else out
        return torch.stack(out) if isinstance(out, list) else out

    return model, step, _on_cuda(latents)


def _calls(latents: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(7)
    xs = [latents] + [
        torch.randn(latents.shape, generator=gen, device="cuda", dtype=_DTYPE) for _ in range(2)
    ]
    return [(x, torch.full((1,), 1.0 - i / 3, device="cuda")) for i, x in enumerate(xs)]


@pytest.mark.parametrize("family", sorted(set(REPLAYED) - CUDA_HOST_COPIES))
def test_family_on_cuda_breaks_at_every_attention_op_and_replays_equal_eager(family: str) -> None:
    torch.manual_seed(0)
    model, step, latents = _cuda_step(family)
    ops = attention_ops(step, latents)
    calls = _calls(latents)
    with torch.no_grad():
        expected = [step(*c) for c in calls]
        runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model))
        try:
            runner.capture(latents, torch.ones(1, device="cuda"))
            (entry,) = runner.stats.entries
            assert entry.breaks == ops > 0
            got = [runner(*c) for c in calls]
            assert runner.stats.hits == len(calls) and runner.stats.misses == 0
        finally:
            runner.close()
        assert not is_in_breakable_cuda_graph()
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize("family", sorted(set(HOST_READERS) | CUDA_HOST_COPIES))
def test_uncapturable_family_on_cuda_is_refused_and_served_eagerly(family: str) -> None:
    torch.manual_seed(0)
    model, step, latents = _cuda_step(family)
    calls = _calls(latents)
    with torch.no_grad():
        expected = [step(*c) for c in calls]
        runner = DiTRunner(step, breakable_attention=make_attention_ops_breakable(model))
        try:
            runner.capture(latents, torch.ones(1, device="cuda"))
            (why,) = runner.blocked_signatures.values()
            assert runner.stats.entries == ()
            if family in CUDA_HOST_COPIES:
                assert "Cannot copy between CPU and CUDA tensors" in why
            got = [runner(*c) for c in calls]
        finally:
            runner.close()
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
