"""One captured signature of a runner: its graph, static inputs and output, and the per-call
work of a replay precomputed at capture (which inputs are copied, which filled, how the output
is cloned)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg_core import _trees
from bcg_core._capture.graph import BreakableCUDAGraph


def _cloner(output: Any) -> Callable[[], Any]:
    """A callable returning a copy of ``output`` with every tensor cloned (types kept)."""
    if isinstance(output, torch.Tensor):
        return output.clone
    return lambda: _trees.map_tensors(output, torch.Tensor.clone)


@dataclass
class Entry:
    """A captured signature.

    ``statics`` are the static buffers of the call's tensors in containers, in signature walk
    order; ``scalars`` the 0-dim buffers of lifted Python numbers. At each call a live tensor
    is copied into its buffer with one batched ``_foreach_copy_`` (skipped when it already is
    the buffer), except those at the positions in ``fill`` (0-dim CPU tensors whose buffer
    lives on a device): they are written with ``fill_``, which passes the value as a kernel
    argument, where a host-to-device copy would synchronise the stream.
    """

    graph: BreakableCUDAGraph
    statics: list[torch.Tensor]
    fill: tuple[int, ...]
    scalars: list[torch.Tensor]
    output: Any
    static_call: tuple[tuple[Any, ...], dict[str, Any]]
    keep_alive: list[Any]
    capture_runs: int
    capture_ms: float
    pool_bytes: int | None
    replays: int = 0
    warmup_ms: float = 0.0
    _copy: tuple[int, ...] = field(init=False)
    clone: Callable[[], Any] = field(init=False)

    def __post_init__(self) -> None:
        self._copy = tuple(i for i in range(len(self.statics)) if i not in self.fill)
        self.clone = _cloner(self.output)

    def load(self, live: list[torch.Tensor], values: list[bool | int | float]) -> None:
        """Write one call's inputs into the static buffers."""
        statics = self.statics
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i in self._copy:
            d, s = statics[i], live[i]
            if d.data_ptr() != s.data_ptr():
                dst.append(d)
                src.append(s)
        if dst:
            torch._foreach_copy_(dst, src)
        for i in self.fill:
            statics[i].fill_(live[i])
        for buf, value in zip(self.scalars, values, strict=True):
            buf.fill_(value)
