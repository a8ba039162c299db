# ruff: noqa: PLC2701  (a probe stamps the runner's private pieces one by one)
"""GPU probe for issue 23: the host time of each piece of a runner call made right after a
device synchronisation (as in a decode loop that samples every step), against the same pieces
in a hot loop.

``python3 benchmarks/probe_runner_cold.py [--rounds N]`` (sources on PYTHONPATH; ``--smoke``
for the tiny decoder, also on CPU). For the ``bench_call_cost`` decoder-8b case, the runner's
call path up to its first replay step is replayed piece by piece with a host stamp after each
(lock, the can-graph tests, signature, entry lookup, current stream, turn wait, flag, input load,
graph replay up to its first plan step), in two ways: ``cold`` (the device synchronised before
every call) and ``hot`` (calls back to back; the replay between calls leaves the host's caches
as cold for this code as a sync does). Rows: the replica, the replica with its input load done
as one bare ``_foreach_copy_`` or as one ``copy_`` per input, the replica with the stream taken
as a raw handle, the replica with the runner's last-hit guard in place of the signature (its
"signature" column is the guard, its "lookup" only the bookkeeping), and the real runner
call's time to its first plan step (the replica must match it). Medians in us.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_call_cost import _sync, decoder_probe, settle

from bcg_core._capture.flag import breakable_graphs_disabled, flag_on, flag_reset
from bcg_core._signature import signature_and_tensors

PIECES = ("lock", "can_graph", "signature", "lookup", "stream", "turn", "flag", "load", "to s0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args(argv)
    device, case, variants = decoder_probe(args.smoke)
    runner = variants["_keep"]()["runner"]
    (entry,) = runner._entries.values()
    graph = entry.graph
    marks = [0.0]
    first = graph._plan[0]

    def stamped_first() -> None:
        marks[0] = time.perf_counter()
        first()

    graph._plan = (stamped_first, *graph._plan[1:])
    call_args = case.args

    dst = list(entry.statics)
    index = torch.cuda.current_device() if device.type == "cuda" else 0

    def load_with(how: str, e: object, live: list[torch.Tensor]) -> None:
        if how == "entry":
            e.load(live, [])  # type: ignore[attr-defined]
        elif how == "foreach":
            torch._foreach_copy_(dst, live)
        else:
            for d, s in zip(dst, live, strict=True):
                d.copy_(s)

    def current(how: str) -> object:
        if how == "raw" and device.type == "cuda":
            return torch._C._cuda_getCurrentRawStream(index)
        return runner._graph_backend.current_stream(runner._stream_device)

    def replica(
        how: str = "entry", stream_how: str = "backend", guard: bool = False
    ) -> list[float]:
        t = [time.perf_counter()]
        with runner._lock:
            t.append(time.perf_counter())
            _ = runner.disabled_reason is None and not breakable_graphs_disabled()
            runner._graph_backend.is_available()
            t.append(time.perf_counter())
            last = runner._last if guard else None
            if last is not None:
                live = last[0].match(call_args, {})
                t.append(time.perf_counter())
                sig, e = last[1], last[2]
            else:
                sig, live = signature_and_tensors(call_args, {})
                t.append(time.perf_counter())
                e = runner._entries.get(sig)
            runner._entries.move_to_end(sig)
            runner._counts["hits"] += 1
            t.append(time.perf_counter())
            stream = current(stream_how)
            t.append(time.perf_counter())
            if stream_how == "raw":
                _ = runner._turn._stream is None or runner._turn._stream == stream
            else:
                runner._turn.wait(stream)
            t.append(time.perf_counter())
            token = flag_on()
            t.append(time.perf_counter())
            try:
                load_with(how, e, live)
                t.append(time.perf_counter())
                e.graph.replay()
                t.append(marks[0])
                e.clone()
            finally:
                flag_reset(token)
                if stream_how != "raw":
                    runner._turn.record(stream)
        return [(b - a) * 1e6 for a, b in itertools.pairwise(t)]

    def real() -> list[float]:
        start = time.perf_counter()
        runner(*call_args)
        return [(marks[0] - start) * 1e6]

    fns = {
        "replica": replica,
        "load: one _foreach_copy_": lambda: replica("foreach"),
        "load: copy_ each": lambda: replica("copy"),
        "stream: raw handle": lambda: replica("entry", "raw"),
        "signature: last-hit guard": lambda: replica(guard=True),
        "real": real,
    }
    settle(fns.values(), device, warmups=5)
    names = list(fns)
    for mode in ("cold", "hot"):
        rows: dict[str, list[list[float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if mode == "cold":
                    _sync(device)
                rows[name].append(fns[name]())
        _sync(device)
        print(f"decoder-8b on {device.type}, {mode}: us from the call's start, per piece")
        print(f"  {'':26s}" + " ".join(f"{p:>9s}" for p in PIECES) + f" {'sum':>9s}")
        for name in names:
            n = len(rows[name][0])
            med = [statistics.median(v[j] for v in rows[name]) for j in range(n)]
            total = statistics.median(sum(v) for v in rows[name])
            cells = " ".join(f"{v:9.2f}" for v in med) if n > 1 else " " * 89
            print(f"  {name:26s}" + cells + f" {total:9.2f}")
    gc.enable()
    case.close()


if __name__ == "__main__":
    main()
