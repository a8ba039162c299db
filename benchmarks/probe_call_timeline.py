# ruff: noqa: PLC2701  (a probe reuses bench_call_cost's private cases)
"""GPU probe for issue 23: where a synchronous call's time goes, on the device's own clock.

``python3 benchmarks/probe_call_timeline.py [--out DIR]`` (sources on PYTHONPATH; ``--smoke``
for the tiny decoder, also on CPU where only the host figures mean anything). For the
``bench_call_cost`` decoder-8b case, four ways of running it (``hand``, ``hand (own capture)``,
``runner_views``, ``runner``: all but the second on the runner's graph), every call
synchronised:

1. ``events``: per call the host latency (call to result) and the device span between an event
   recorded just before the call and one recorded just after it (the device idle before: the
   span counts the wait for the first launch as well); samples interleaved, order rotated every
   round, paired medians against ``hand``.
2. ``trace`` (CUDA only): a few calls of each under the profiler; from its trace per call the
   delay from the call's start to its first kernel, the span first to last kernel, the time
   kernels ran (overlaps merged), the idle gaps inside the span (count of gaps over 5 us and
   their sum) and the time from the last kernel's end to the call's return. Kernels of graph
   replays included. The profiler slows the host; compare rows, not absolute figures.
3. ``stamps`` (CUDA only): the first ``--steps`` steps of each graph's replay plan wrapped to
   note the host time each starts and to record an event after it; per call the host time from
   the call's start to each step, and the device time from the call's start to the end of each
   step (medians): where a slower call falls behind, and whether the device waits for the host
   there. The wrappers cost the same in every row.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_call_cost import OWN_CAPTURE, _sync, decoder_probe, settle

ROWS = ("hand", OWN_CAPTURE, "runner_views", "runner")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _events(
    rows: dict[str, Callable[[], object]], rounds: int, device: torch.device
) -> dict[str, dict[str, list[float]]]:
    cuda = device.type == "cuda"
    out: dict[str, dict[str, list[float]]] = {n: {"host": [], "device": []} for n in rows}
    names = list(rows)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(device)
            if cuda:
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            if cuda:
                e0.record()
            rows[name]()
            if cuda:
                e1.record()
            _sync(device)
            out[name]["host"].append((time.perf_counter() - start) * 1e6)
            out[name]["device"].append(e0.elapsed_time(e1) * 1e3 if cuda else 0.0)
    return out


def _merge(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Busy time of sorted ``(start, end)`` spans with overlaps merged, and the gaps between."""
    busy, gaps = 0.0, []
    cur_s, cur_e = spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy, gaps


def _trace(
    rows: dict[str, Callable[[], object]], calls: int, device: torch.device
) -> dict[str, dict[str, list[float]]]:
    from torch.profiler import ProfilerActivity, profile, record_function

    names = list(rows)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for r in range(calls):
            for i, name in enumerate(names[r % len(names) :] + names[: r % len(names)]):
                _sync(device)
                with record_function(f"call|{names.index(name)}|{r}|{i}"):
                    rows[name]()
                    _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    calls_at = sorted(
        (e["ts"], e["ts"] + e["dur"], names[int(e["name"].split("|")[1])])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("call|")
        and e.get("cat") == "user_annotation"
    )  # fmt: skip
    dev = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS
    )
    out: dict[str, dict[str, list[float]]] = {
        n: {k: [] for k in ("to_first", "span", "busy", "gaps_5us", "gap_sum", "to_return", "n")}
        for n in names
    }
    for start, end, name in calls_at:
        inside = [(s, e) for s, e in dev if start <= s <= end]
        if not inside:
            continue
        busy, gaps = _merge(inside)
        big = [g for g in gaps if g > 5.0]
        row = out[name]
        row["to_first"].append(inside[0][0] - start)
        row["span"].append(max(e for _, e in inside) - inside[0][0])
        row["busy"].append(busy)
        row["gaps_5us"].append(float(len(big)))
        row["gap_sum"].append(sum(gaps))
        row["to_return"].append(end - max(e for _, e in inside))
        row["n"].append(float(len(inside)))
    return out


class _Stamps:
    """Wraps a graph's first replay steps: host start times and device events per call."""

    def __init__(self, graph: object, steps: int) -> None:
        self.host = [0.0] * steps
        self.events: list[torch.cuda.Event] = []
        plan = list(graph._plan)  # type: ignore[attr-defined]
        steps = min(steps, len(plan))
        for j in range(steps):
            plan[j] = self._wrap(plan[j], j)
        graph._plan = tuple(plan)  # type: ignore[attr-defined]
        self.steps = steps

    def _wrap(self, run: Callable[[], object], j: int) -> Callable[[], None]:
        def stamped() -> None:
            self.host[j] = time.perf_counter()
            run()
            self.events[j].record()

        return stamped

    def arm(self) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(self.steps)]


def _stamps(
    rows: dict[str, Callable[[], object]],
    graphs: dict[str, object],
    steps: int,
    rounds: int,
    device: torch.device,
) -> dict[str, dict[str, list[list[float]]]]:
    stamps = {id(g): _Stamps(g, steps) for g in {id(g): g for g in graphs.values()}.values()}
    names = list(rows)
    out: dict[str, dict[str, list[list[float]]]] = {n: {"host": [], "device": []} for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            st = stamps[id(graphs[name])]
            st.arm()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _sync(device)
            start = time.perf_counter()
            e0.record()
            rows[name]()
            e1.record()
            _sync(device)
            end = time.perf_counter()
            host = [(h - start) * 1e6 for h in st.host] + [(end - start) * 1e6]
            dev = [e0.elapsed_time(e) * 1e3 for e in st.events] + [e0.elapsed_time(e1) * 1e3]
            out[name]["host"].append(host)
            out[name]["device"].append(dev)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--trace-calls", type=int, default=12)
    parser.add_argument("--stamp-steps", type=int, default=8)
    parser.add_argument("--stamp-rounds", type=int, default=150)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device, case, variants = decoder_probe(args.smoke)
    rows = {n: variants[n] for n in ROWS}
    settle(rows.values(), device)
    ev = _events(rows, args.rounds, device)
    result: dict[str, object] = {"events": ev}
    print(f"decoder-8b{' (smoke)' if args.smoke else ''} on {device.type}, sync calls")
    print(f"  {'':24s} {'host':>9s} {'vs hand':>8s} {'device':>9s} {'vs hand':>8s}")
    for name in ROWS:
        h = statistics.median(ev[name]["host"])
        dh = statistics.median(
            a - b for a, b in zip(ev[name]["host"], ev["hand"]["host"], strict=True)
        )
        d = statistics.median(ev[name]["device"])
        dd = statistics.median(
            a - b for a, b in zip(ev[name]["device"], ev["hand"]["device"], strict=True)
        )
        print(f"  {name:24s} {h:9.1f} {dh:+8.1f} {d:9.1f} {dd:+8.1f}")
    if device.type == "cuda":
        tr = _trace(rows, args.trace_calls, device)
        result["trace"] = tr
        keys = ("n", "to_first", "span", "busy", "gaps_5us", "gap_sum", "to_return")
        print("  under the profiler, medians per call (us):")
        print(f"  {'':24s} " + " ".join(f"{k:>9s}" for k in keys))
        for name in ROWS:
            vals = [statistics.median(tr[name][k]) if tr[name][k] else float("nan") for k in keys]
            print(f"  {name:24s} " + " ".join(f"{v:9.1f}" for v in vals))
        keep = variants["_keep"]()
        graph = next(iter(keep["runner"]._entries.values())).graph
        graphs = {"hand": graph, OWN_CAPTURE: keep["own"], "runner_views": graph, "runner": graph}
        sp = _stamps(rows, graphs, args.stamp_steps, args.stamp_rounds, device)
        result["stamps"] = sp
        n = len(sp["hand"]["host"][0])
        cols = [f"s{j}" for j in range(n - 1)] + ["end"]
        for kind in ("host", "device"):
            print(
                f"  {kind} us from the call's start to each plan step's start (host) / end "
                "(device), medians:"
            )
            print(f"  {'':24s} " + " ".join(f"{c:>8s}" for c in cols))
            for name in ROWS:
                vals = [statistics.median(v[j] for v in sp[name][kind]) for j in range(n)]
                print(f"  {name:24s} " + " ".join(f"{v:8.1f}" for v in vals))
    gc.enable()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-call-timeline.json").write_text(json.dumps(result))
    case.close()


if __name__ == "__main__":
    main()
