"""GPU probe for issue 23: what loading a decode step's two small inputs adds to a call's
latency (the device synchronised after each call), as one ``_foreach_copy_`` (the runner's
``Entry.load``) or as two ``copy_`` calls (the hand replay), alone and before 2.7 ms of work.

``python3 benchmarks/probe_copy_sync.py`` (CUDA only): median of 2000 interleaved rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def main() -> None:
    if not torch.cuda.is_available():
        print("probe_copy_sync: CUDA is not available")
        return
    dev = torch.device("cuda")
    tokens = torch.zeros(1, dtype=torch.long, device=dev)
    positions = torch.zeros(1, dtype=torch.long, device=dev)
    statics = [tokens.clone(), positions.clone()]
    big = torch.randn(4096, 4096, device=dev)

    def foreach() -> None:
        torch._foreach_copy_(statics, [tokens, positions])

    def copies() -> None:
        statics[0].copy_(tokens)
        statics[1].copy_(positions)

    def nothing() -> None:
        pass

    def then_work(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            fn()
            torch.mm(big, big)

        return run

    rows = {
        "nothing": nothing,
        "foreach 2": foreach,
        "copy_ x2": copies,
        "nothing + mm": then_work(nothing),
        "foreach 2 + mm": then_work(foreach),
        "copy_ x2 + mm": then_work(copies),
    }
    times: dict[str, list[float]] = {k: [] for k in rows}
    for fn in rows.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    names = list(rows)
    for r in range(2000):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            rows[name]()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e6)
    for name in names:
        print(f"{name:16s} sync latency median {statistics.median(times[name]):8.2f} us")


if __name__ == "__main__":
    main()
