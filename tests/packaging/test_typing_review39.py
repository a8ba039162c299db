"""The public API as a typed user and a packager see it (review 39).

``typed_user.py`` uses every public name the way README shows; ``mypy --strict`` must accept it
with no cast and no ignore. The runtime tests check that what the annotations promise holds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bcg_core
import bcg_diffusion
from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph
from bcg_diffusion import (
    get_current_replay_token,
    make_breakable_attention_forward,
    replay_token_scope,
)

REPO = Path(__file__).resolve().parents[2]
TYPED_USER = Path(__file__).with_name("typed_user.py")


def _names_used(text: str) -> set[str]:
    return {name for mod in (bcg_core, bcg_diffusion) for name in mod.__all__ if name in text}


def test_typed_user_covers_every_public_name() -> None:
    text = TYPED_USER.read_text()
    expected = set(bcg_core.__all__) | set(bcg_diffusion.__all__)
    assert _names_used(text) == expected


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_typed_user_passes_mypy_strict() -> None:
    # The repository's own mypy configuration (pyproject.toml, as `hatch run dev:types` uses),
    # pointed at the typed user program instead of the packages.
    env = dict(os.environ)
    env["MYPYPATH"] = os.pathsep.join(
        str(REPO / p) for p in ("packages/bcg-core/src", "packages/bcg-diffusion/src")
    )
    config = str(REPO / "pyproject.toml")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", config, "--strict", str(TYPED_USER)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_replay_token_scope_as_decorator_gives_each_call_a_fresh_token() -> None:
    # Its annotation said AbstractContextManager[int], so `@replay_token_scope()` failed mypy
    # although the object is a ContextDecorator that makes a fresh scope per call.
    @replay_token_scope()
    def current() -> int | None:
        return get_current_replay_token()

    first, second = current(), current()
    assert first is not None and second is not None
    assert second > first
    assert get_current_replay_token() is None


def test_adapted_attention_forward_keeps_its_result_on_replay() -> None:
    # The adapted forward is annotated as the forward itself; the runtime keeps that promise:
    # the caller gets the forward's own return structure, refreshed at every replay.
    class Attention(torch.nn.Module):
        @make_breakable_attention_forward
        def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return q * 2, q.sum(-1)

    attn = Attention()
    static_in = torch.ones(2, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out, lse = attn.forward(static_in + 1)
    assert graph.num_breaks == 1
    static_in.copy_(torch.full((2, 3), 4.0))
    graph.replay()
    assert torch.equal(out, torch.full((2, 3), 10.0))
    assert torch.equal(lse, torch.full((2,), 15.0))
