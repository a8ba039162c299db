# ruff: noqa: PLC2701  (a probe times the runner's private pieces)
"""GPU probe for issue 23: what the decoder-8b runner call pays before its first launch, to its
result.

``python3 benchmarks/probe_call_load.py [--rounds N]`` (sources on PYTHONPATH; ``--smoke`` for
the tiny decoder, also on CPU). Every row replays the runner's own graph of the
``bench_call_cost`` decoder-8b case, every call synchronised before and after (the device idle
at its start, as in a decode loop that samples each step): the host latency from call to result
and the device span between events recorded just before and just after the call. Rows: the hand
replay with the two inputs copied by one ``copy_`` each, or by one ``_foreach_copy_``; the hand
replay after the runner's signature and entry lookup; the runner; the runner with its input
load done by one ``copy_`` each. Samples interleaved, order rotated every round; medians of the
paired differences against the first row.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_call_cost import decoder_probe, settle
from probe_call_timeline import _events

from bcg_core._capture.flag import breakable_graphs_disabled
from bcg_core._signature import signature_and_tensors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args(argv)
    device, case, variants = decoder_probe(args.smoke)
    runner = variants["_keep"]()["runner"]
    (entry,) = runner._entries.values()
    statics, graph, call_args = entry.statics, entry.graph, case.args

    def copy_each() -> None:
        for s, a in zip(statics, call_args, strict=True):
            s.copy_(a)

    def hand() -> None:
        copy_each()
        graph.replay()

    def hand_foreach() -> None:
        torch._foreach_copy_(statics, list(call_args))
        graph.replay()

    def hand_lookup() -> None:
        sig, _ = signature_and_tensors(call_args, {})
        runner._entries.get(sig)
        copy_each()
        graph.replay()

    class CopyEach:  # the entry, its load done by one copy_ each
        def __init__(self) -> None:
            self.__dict__.update(entry.__dict__)

        def load(self, live: list[torch.Tensor], values: list[object]) -> None:
            for s, t in zip(statics, live, strict=True):
                s.copy_(t)

        def store(self, live: list[torch.Tensor]) -> None:
            pass

    copy_entry = CopyEach()
    _, live = signature_and_tensors(call_args, {})

    def runner_copy_each() -> None:
        with runner._lock:
            _ = runner.disabled_reason is None and not breakable_graphs_disabled()
            runner._graph_backend.is_available()
            sig, live = signature_and_tensors(call_args, {})
            runner._entries.get(sig)
            runner._replay(copy_entry, live, [])  # type: ignore[arg-type]

    rows: dict[str, Callable[[], object]] = {
        "hand: copy_ each": hand,
        "hand: _foreach_copy_": hand_foreach,
        "hand + signature, lookup": hand_lookup,
        "runner": lambda: runner(*call_args),
        "runner, load: copy_ each": runner_copy_each,
        "runner._replay": lambda: runner._replay(entry, live, []),
    }
    settle(rows.values(), device)
    out = _events(rows, args.rounds, device)
    gc.enable()
    names = list(rows)
    base = out[names[0]]
    print(f"decoder-8b{' (smoke)' if args.smoke else ''} on {device.type}, sync calls, us")
    print(f"  {'':28s} {'host':>9s} {'vs row 1':>9s} {'device':>9s} {'vs row 1':>9s}")
    for name in names:
        row = out[name]
        dh = statistics.median(a - b for a, b in zip(row["host"], base["host"], strict=True))
        dd = statistics.median(a - b for a, b in zip(row["device"], base["device"], strict=True))
        print(
            f"  {name:28s} {statistics.median(row['host']):9.1f} {dh:+9.1f} "
            f"{statistics.median(row['device']):9.1f} {dd:+9.1f}"
        )
    case.close()


if __name__ == "__main__":
    main()
