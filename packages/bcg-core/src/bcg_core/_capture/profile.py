"""Named profiler ranges around each replay step, built only when profiling is on.

With ``BreakableCUDAGraph(profile=True)`` (or ``BCG_PROFILE=1``) every step of the replay plan is
wrapped so it runs inside ``torch.profiler.record_function`` and the backend's device range
(NVTX on CUDA), named ``bcg.segment[i]`` (i counts launched segments from 0) or
``bcg.break:<name>``. Off, the plan holds the bare launchers: profiling costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bcg_core._backends import GraphBackend
from bcg_core._env import EnvFlag

_BCG_PROFILE = EnvFlag("BCG_PROFILE")


def profile_enabled(option: bool | None) -> bool:
    """``option``, or when None whether ``BCG_PROFILE`` is set to 1/true/yes/on."""
    if option is not None:
        return option
    return _BCG_PROFILE()


def named(launch: Callable[[], Any], name: str, backend: GraphBackend) -> Callable[[], None]:
    """``launch`` run inside a profiler event and a device range called ``name``."""
    record_function = torch.profiler.record_function
    push, pop = backend.range_push, backend.range_pop

    def run() -> None:
        with record_function(name):
            push(name)
            try:
                launch()
            finally:
                pop()

    return run
