"""A diffusion runtime's inputs through DiTRunner on the CPU graph backend (review 27): holes
found driving tiny diffusers models as a serving runtime does, each replay compared with eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bcg_diffusion import DiTRunner, make_attention_ops_breakable

diffusers = pytest.importorskip(
    "diffusers", reason='diffusers is not installed (pip install "bcg-diffusion[diffusers]")'
)
from test_cpu_review43_dit_holes import flux_in, tiny_flux  # noqa: E402


def _set_ip_adapter(model: torch.nn.Module) -> list[Any]:
    """Flux IP-Adapter processors on the dual blocks (what load_ip_adapter sets)."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    procs: dict[str, Any] = {}
    made: list[Any] = []
    for name, proc in model.attn_processors.items():
        if name.startswith("transformer_blocks"):
            proc = FluxIPAdapterAttnProcessor(
                hidden_size=32, cross_attention_dim=32, num_tokens=(2,)
            )
            made.append(proc)
        procs[name] = proc
    model.set_attn_processor(procs)
    return made


def test_processors_set_after_the_handle_was_made_are_patched_at_capture() -> None:
    """An IP-Adapter set on the model after make_attention_ops_breakable(model), before the
    capture: its processor's __call__ was not patched (the handle scanned the processors it was
    made with), so the scale that set_ip_adapter_scale writes was a constant of the graph and a
    new scale replayed the capture's (silently not eager). The runner now patches, at capture,
    processors the model gained since, and releases them on close()."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    model = tiny_flux(1)
    handle = make_attention_ops_breakable(model)
    processors = _set_ip_adapter(model)
    original = vars(FluxIPAdapterAttnProcessor)["__call__"]
    ip = {"ip_hidden_states": [torch.randn(1, 2, 32)]}
    runner = DiTRunner(model, breakable_attention=handle, device="cpu")
    try:
        with torch.no_grad():
            runner.capture(**flux_in(0), joint_attention_kwargs=ip)
            for step, scale in enumerate((1.0, 0.0, 5.0), start=1):
                for proc in processors:
                    proc.scale = [scale]
                got = runner(**flux_in(step), joint_attention_kwargs=ip).sample
                expected = model(**flux_in(step), joint_attention_kwargs=ip).sample
                assert torch.equal(got, expected), f"scale {scale} replayed stale"
            assert runner.stats.hits == 3
    finally:
        runner.close()
    assert vars(FluxIPAdapterAttnProcessor)["__call__"] is original
