"""Compiled breaks that failed a review of torch.compile with breaks, on the CPU backend: each was
a raw internal error or a result that differed from the same function run eagerly. Every
compiled result is compared with the function uncompiled.

Backend ``aot_eager`` (dynamo and AOTAutograd, which make the op opaque); inductor would spend
minutes of C++ compilation on this 2-core box.
"""

from __future__ import annotations

import torch
import torch._dynamo

from bcg_core import eager_on_graph


@eager_on_graph(name="cr.scale_into")
def _scale_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(x * 2)  # writes an argument: the layout's dry run reads version counters
    return x + 1


def _uses_scale_into_in_inference_mode(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = torch.zeros_like(x)
        y = _scale_into(x.cos(), out)
        return y * out


def test_a_compiled_break_called_in_inference_mode_compiles() -> None:
    # The dry run's fake copies were inference tensors, which have no version counter: the
    # compile failed with torch's raw "Inference tensors do not track version counter".
    torch._dynamo.reset()
    compiled = torch.compile(_uses_scale_into_in_inference_mode, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(5)
        assert torch.equal(compiled(x), _uses_scale_into_in_inference_mode(x))
