"""transformers ``generate()`` and torch.compile with bcg in the loop, holes of a review, on the
CPU graph backend (tiny random-weight configs, backend ``aot_eager``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo

import bcg_core

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_generate_holes import graphed_forward  # noqa: E402
from test_cpu_transformers_families import SMALL  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.generation.configuration_utils import CompileConfig  # noqa: E402


def _model(family: str, attn: str) -> Any:
    torch.manual_seed(0)
    config = CONFIG_MAPPING[family](**SMALL)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_runner_in_forward_under_generates_auto_compile_captures_and_replays(
    family: str,
) -> None:
    """``generate()`` with a StaticCache compiles ``model.__call__`` itself (by default on
    CUDA; ``compile_config._compile_all_devices`` here): with ``model.forward`` routed through
    a runner, dynamo traced into the runner, its lock broke the frame and the step's frames
    were compiled under it, so every capture failed with the raw "attempted to set_stance in a
    torch.compile region" and no decode step ever replayed (tokens right, served eagerly). The
    runner is a graph break for dynamo now: it captures and every later decode step replays,
    the tokens equal plain transformers'."""
    prompt = torch.randint(4, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    settings: dict[str, Any] = {
        "max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False,
        "cache_implementation": "static", "pad_token_id": 0,
    }  # fmt: skip
    with torch.no_grad():
        want = _model(family, "sdpa").generate(prompt, disable_compile=True, **settings)
    torch._dynamo.reset()
    model = _model(family, bcg_core.breakable_attention("sdpa"))
    runner = graphed_forward(model)
    compile_config = CompileConfig(backend="aot_eager")
    compile_config._compile_all_devices = True
    with torch.no_grad():
        got = model.generate(prompt, compile_config=compile_config, **settings)
    assert torch.equal(got, want)
    assert not runner.blocked_signatures, list(runner.blocked_signatures.values())
    assert (runner.stats.hits, runner.stats.misses) == (7, 0)  # captured at the first decode step
    assert not bcg_core.is_breakable_capture_active()
