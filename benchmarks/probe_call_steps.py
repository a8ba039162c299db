# ruff: noqa: PLC2701  (a probe times the runner's private pieces one by one)
"""GPU probe for issue 23: which step of a runner call costs the 8B decoder's host time.

``python3 benchmarks/probe_call_steps.py`` (sources on PYTHONPATH; ``--smoke`` for the tiny
decoder, also on CPU). The host time of one call (the device idle at its start, synchronised
outside the timed span; ``--mode sync``: the time to its result, synchronised inside), for the
``bench_call_cost`` decoder-8b case built up step by step from the hand replay to the runner
call, each row adding one piece of the runner's path; samples interleaved, order rotated every
round, median of the paired differences against ``hand``. Then the break's function alone (the
graph's first break step, on its capture-time arguments) timed right after each kind of call,
to tell a slower call from slower torch ops after it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_call_cost import _sync, decoder_probe, settle

from bcg_core._capture.flag import flag_on, flag_reset
from bcg_core._capture.graph import BreakStep
from bcg_core._signature import signature_and_tensors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument(
        "--mode", choices=("host", "sync"), default="host", help="host time, or call to result"
    )
    args = parser.parse_args(argv)
    device, case, variants = decoder_probe(args.smoke)
    runner = variants["_keep"]()["runner"]
    runner.return_views = True
    (entry,) = runner._entries.values()
    stream = runner._graph_backend.current_stream(device)
    _, live = signature_and_tensors(case.args, {})
    brk = next(s for s in entry.graph._steps if isinstance(s, BreakStep))

    def load_replay() -> None:
        entry.load(live, [])
        entry.graph.replay()

    def load_flag_replay() -> None:
        token = flag_on()
        try:
            load_replay()
        finally:
            flag_reset(token)

    def with_turn() -> None:
        runner._turn.wait(stream)
        load_flag_replay()
        runner._turn.record(stream)

    def signature_too() -> None:
        signature_and_tensors(case.args, {})
        with_turn()

    rows: dict[str, Callable[[], object]] = {
        "hand": variants["hand"],
        "its graph": entry.graph.replay,
        "+ entry.load": load_replay,
        "+ flag": load_flag_replay,
        "+ turn wait/record": with_turn,
        "+ signature": signature_too,
        "runner._replay": lambda: runner._replay(entry, live, []),
        "runner()": lambda: runner(*case.args),
    }
    after: dict[str, list[float]] = {k: [] for k in rows}
    times: dict[str, list[float]] = {k: [] for k in rows}
    settle(rows.values(), device)
    names = list(rows)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(device)
            start = time.perf_counter()
            rows[name]()
            if args.mode == "sync":
                _sync(device)
            mid = time.perf_counter()
            brk.fn(*brk.args, **brk.kwargs)  # the break alone, right after the call
            end = time.perf_counter()
            _sync(device)
            times[name].append((mid - start) * 1e6)
            after[name].append((end - mid) * 1e6)
    gc.enable()
    hand, hand_after = times["hand"], after["hand"]
    what = "host us per call" if args.mode == "host" else "us per call to its result (sync)"
    print(f"decoder-8b{' (smoke)' if args.smoke else ''} on {device.type}: {what}")
    for name in names:
        diff = statistics.median(a - b for a, b in zip(times[name], hand, strict=True))
        diff_after = statistics.median(a - b for a, b in zip(after[name], hand_after, strict=True))
        print(
            f"  {name:22s} {statistics.median(times[name]):9.1f}  vs hand {diff:+8.1f}   "
            f"break alone after it {statistics.median(after[name]):7.1f} ({diff_after:+6.1f})"
        )
    case.close()


if __name__ == "__main__":
    main()
