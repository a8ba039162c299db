"""The divergence check on the toy decoder with a varlen-style attention whose sequence lengths
come from a host-side list, left unmarked.

``PYTHONPATH=packages/bcg-core/src python3 benchmarks/divergence_demo.py [--backend cpu|cuda]``

An engine keeps each sequence's length in host metadata (``HostMetadata.lengths``, a Python
list it updates in place before every step). The attention of every layer of the toy decoder
(``tiny_config()``) is replaced by a varlen attention that masks the keys beyond ``lengths[b]``:

* **unmarked**: the mask is built from the list inside the graph segment (``torch.arange(window)
  < n`` for each host ``n``); the attention itself is a break. At capture the lengths become
  kernel arguments, so every replay masks with the capture-time lengths. The check names
  segment 1 (before the first attention break) and, on the CPU backend, the mask's source line.
* **fixed**: the break receives the metadata object and builds the mask itself, eagerly, at
  every replay. The check reports ok.

Three input sets (tokens, positions, lengths): set 0 is captured, set 1 has the same lengths
(and passes), set 2 has other lengths. Runs on the CPU graph backend, and on CUDA when a GPU is
present (``--backend`` picks one). (``torch.tensor(lengths)`` in the segment would be silent on
the CPU backend too, but fails CUDA capture: the host-to-device copy synchronises.) Prints each
report; exits 0 when the unmarked variant diverged and the fixed one passed on every backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from bcg_core import DivergenceReport, check_divergence, eager_on_graph
from bcg_core.bench import ToyDecoder, tiny_config


class HostMetadata:
    """Per-step host metadata of an engine: one object, updated in place before every step."""

    def __init__(self) -> None:
        self.lengths: list[int] = []


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Write k/v at ``positions``, attend over the cache window where ``visible`` [B, window]."""
    batch, heads, head_dim = q.shape
    kv_heads, window = k_cache.shape[1], k_cache.shape[2]
    slot = positions.view(batch, 1, 1, 1).expand(batch, kv_heads, 1, head_dim)
    k_cache[:batch].scatter_(2, slot, k.unsqueeze(2))
    v_cache[:batch].scatter_(2, slot, v.unsqueeze(2))
    queries = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    mask = visible.view(batch, 1, 1, window)
    out = F.scaled_dot_product_attention(queries, k_cache[:batch], v_cache[:batch], attn_mask=mask)
    return out.reshape(batch, heads * head_dim)


def _visible(lengths: list[int], window: int, device: torch.device) -> torch.Tensor:
    return torch.stack([torch.arange(window, device=device) < n for n in lengths])


varlen_attention = eager_on_graph(name="varlen_attention")(_attend)


def unmarked(meta: HostMetadata) -> Callable[..., torch.Tensor]:
    """The bug: the mask is computed from the host list inside the graph segment."""

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: Any, vc: Any, pos: Any) -> Any:
        visible = _visible(meta.lengths, kc.shape[2], q.device)  # lengths baked at capture
        return varlen_attention(q, k, v, kc, vc, pos, visible)

    return core


@eager_on_graph(name="varlen_attention_host")
def varlen_attention_host(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    meta: HostMetadata,
) -> torch.Tensor:
    """The fix: the break reads the host metadata (the same object, updated in place) at every
    replay and builds the mask eagerly."""
    visible = _visible(meta.lengths, k_cache.shape[2], q.device)
    return _attend(q, k, v, k_cache, v_cache, positions, visible)


def fixed(meta: HostMetadata) -> Callable[..., torch.Tensor]:
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: Any, vc: Any, pos: Any) -> Any:
        return varlen_attention_host(q, k, v, kc, vc, pos, meta)

    return core


def run(
    backend: str, variant: Callable[[HostMetadata], Callable[..., torch.Tensor]], layers: int
) -> DivergenceReport:
    device = torch.device(backend)
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    config = dataclasses.replace(tiny_config(dtype), layers=layers)
    model = ToyDecoder(config, seed=0, device=device)
    model.allocate_cache(2)
    meta = HostMetadata()
    model.set_attention(variant(meta))
    gen = torch.Generator().manual_seed(0)

    def input_set(positions: list[int]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        tokens = torch.randint(0, model.config.vocab, (2,), generator=gen).to(device)
        pos = torch.tensor(positions, device=device)

        def prepare() -> tuple[torch.Tensor, torch.Tensor]:
            meta.lengths = [p + 1 for p in positions]  # the engine updates its metadata
            return tokens, pos

        return prepare

    sets = [input_set([4, 9]), input_set([4, 9]), input_set([11, 2])]
    with torch.no_grad():
        return check_divergence(model, sets, backend=backend)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cpu", "cuda"), action="append")
    parser.add_argument("--layers", type=int, default=tiny_config().layers)
    args = parser.parse_args(argv)
    backends = args.backend or ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    expected = True
    for backend in backends:
        for name, variant, want_ok in (("unmarked", unmarked, False), ("fixed", fixed, True)):
            report = run(backend, variant, args.layers)
            print(f"== {backend}, {name} lengths ==\n{report}\n")
            expected &= report.ok == want_ok
    return 0 if expected else 1


if __name__ == "__main__":
    sys.exit(main())
