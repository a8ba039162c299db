"""torch.compile + bcg over transformers families, holes of a review, on the CPU graph backend
(tiny random-weight configs, backend ``aot_eager``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo

import bcg_core

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_transformers_families import SMALL  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402


def _llama() -> Any:
    torch.manual_seed(0)
    config = CONFIG_MAPPING["llama"](**SMALL)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=bcg_core.breakable_attention("sdpa"), dtype=torch.float32
    ).eval()


def test_a_compiled_bcg_sdpa_step_in_grad_mode_graph_breaks_and_trains() -> None:
    """In grad mode (the parameters require grad) the sdpa op, which has no backward, made
    AOTAutograd fail the compile with the raw "Trying to backward through bcg.opaque.default",
    with or without fullgraph=True. As README says of breaks: the attention is a dynamo graph
    break there (fullgraph=True refuses it, saying to use no_grad), and autograd runs through
    it: the compiled step's logits and gradients equal eager's."""
    model = _llama()
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))

    def step(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, use_cache=False).logits
        return logits

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch\.no_grad\(\)"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(ids)

    expected = step(ids)
    expected.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager")(ids)
    got.square().mean().backward()
    torch.testing.assert_close(got, expected)
    assert grads and {n for n, p in model.named_parameters() if p.grad is not None} == set(grads)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], msg=n)
    assert not bcg_core.is_breakable_capture_active()
