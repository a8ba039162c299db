"""GPU probe: two threads making, capturing, replaying and dropping graphs at once.

``torch`` mode uses bare ``torch.cuda.CUDAGraph`` objects (torch registers each with the CUDA
generator in an unlocked set at capture_begin and removes it in the destructor); ``bcg`` mode
does the same through bcg's breakable graphs (whose torch graphs are captured and destroyed
under one lock, ``_backends/cuda_graph.py``). Each mode runs in a child process, so a crash is
an exit status, not the end of the probe::

    python benchmarks/probe_graph_race.py [--iterations 3000]

prints one line per variant: the child's exit status (-11 is SIGSEGV), how many graphs were
captured, and the first frames of a crash. Variants switch parts of bcg off (``--without``:
``nodecount`` the cuda-bindings node count of a segment, ``bindings`` every cuda-bindings call,
``routing`` the allocation routing of breaks, ``outalias``/``inalias`` the non-owning aliases of
break outputs and arguments, ``gcpause``) and run one or two threads, to tell which part a crash
needs. ``torch+EXTRAS`` is the bare mode with some of bcg's native calls made around each
capture: ``isc``/``count`` its capture queries, ``routing`` a routed allocation, ``alias`` an
alias kept, ``snapshot`` the pool's allocator snapshot read (what bcg did before issue 21's
fix), ``newpool`` a new pool per graph. tests/core/test_cuda_trust.py runs the bcg mode
as a test.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch


def _read_snapshot(pool: Any) -> int:
    # What bcg did before issue 21's fix: the pool's segments, read field by field.
    segments = torch.cuda.memory.memory_snapshot(pool, include_traces=False)
    return sum(int(s["total_size"]) for s in segments if tuple(s["segment_pool_id"]) == pool)


def _torch_work(iterations: int, seed: int, counts: list[int], extras: str = "") -> None:
    # extras: bcg's native calls made around a bare torch capture, one kind at a time.
    from bcg_core._backends import backend_for  # noqa: PLC2701
    from bcg_core._backends.cudart import RUNTIME  # noqa: PLC2701
    from bcg_core._capture.aliases import alias_tensor  # noqa: PLC2701

    cuda = backend_for("cuda")
    pool = cuda.new_pool()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    x = torch.full((256,), float(seed), device="cuda")
    kept: list[torch.Tensor] = []
    with torch.cuda.stream(stream):
        for _ in range(iterations):
            if "newpool" in extras:  # a pool per graph, dropped with it, as BreakableCUDAGraph
                pool = cuda.new_pool()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool.id, capture_error_mode="thread_local")
            y = x * 2 + 1
            if "isc" in extras:
                RUNTIME.capture_info(stream)
            if "count" in extras:
                RUNTIME.capture_node_count(stream)
            graph.capture_end()
            if "routing" in extras:
                with cuda.allocate_to_pool(pool, "cuda"):
                    z = x + 3
                if "snapshot" in extras:
                    _read_snapshot(pool.id)
                if "alias" in extras:
                    kept = [alias_tensor(z)]
                del z
            elif "snapshot" in extras:
                _read_snapshot(pool.id)
            if "alias" in extras and "routing" not in extras:
                kept = [alias_tensor(y)]
            graph.replay()
            del graph, y
            counts[seed] += 1
    del kept
    stream.synchronize()


def _bcg_work(iterations: int, seed: int, counts: list[int]) -> None:
    from bcg_core import (
        BreakableCUDAGraph,
        BreakableCUDAGraphCapture,
        eager_on_graph,
        enable_breakable_cuda_graph,
    )

    @eager_on_graph
    def host(h: torch.Tensor) -> torch.Tensor:
        return h + 1

    x = torch.full((256,), float(seed), device="cuda")
    for i in range(iterations):
        graph = BreakableCUDAGraph()
        with (
            enable_breakable_cuda_graph(),
            BreakableCUDAGraphCapture(graph, capture_error_mode="thread_local"),
        ):
            out = host(x * 2) * 3
        x.fill_(float(seed + i % 7))
        graph.replay()
        expected = (x * 2 + 1) * 3
        if not torch.equal(out, expected):
            raise AssertionError(f"thread {seed}, iteration {i}: replay differs from eager")
        if i % 2:
            graph.reset()
        del graph, out  # the other half is dropped without a reset
        counts[seed] += 1
    # This thread's stream only: a device-wide sync while the other thread captures is
    # refused by CUDA (operation not permitted when stream is capturing).
    torch.cuda.current_stream().synchronize()


def _switch_off(parts: list[str]) -> None:
    from bcg_core._backends import cuda_pool  # noqa: PLC2701
    from bcg_core._backends.cudart import RUNTIME  # noqa: PLC2701
    from bcg_core._capture import bridges, capture  # noqa: PLC2701

    for part in parts:
        if part == "nodecount":
            RUNTIME.capture_node_count = lambda stream: None  # type: ignore[method-assign]
        elif part == "bindings":
            RUNTIME._module, RUNTIME._loaded, RUNTIME._warned = None, True, True
        elif part == "routing":
            cuda_pool._routing_api = lambda: None  # type: ignore[assignment]
        elif part == "outalias":
            bridges.alias_tensor = lambda t: t  # type: ignore[attr-defined]
        elif part == "inalias":
            capture.alias_tree = lambda obj, device_types: obj  # type: ignore[attr-defined]
        elif part == "gcpause":
            capture.gc_paused = contextlib.nullcontext  # type: ignore[attr-defined,assignment]
        elif part:
            raise SystemExit(f"unknown part {part!r}")


def child(mode: str, iterations: int, threads: int, without: list[str]) -> int:
    _switch_off(without)
    if mode.startswith("torch"):
        work: Any = functools.partial(_torch_work, extras=mode.partition("+")[2])
    else:
        work = _bcg_work
    counts = [0, 0]
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            work(iterations, seed, counts)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(s,)) for s in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    print(f"captured {sum(counts)} graphs", flush=True)
    if errors:
        raise errors[0]
    return 0


def run_variant(
    mode: str, iterations: int, threads: int, without: str, debug: bool, logs: str | None
) -> tuple[int, str]:
    """Run one variant in a child process: its exit status, what it printed last, and the
    first frames of a crash (all of its output goes to a file in ``logs``)."""
    command = [sys.executable, "-X", "faulthandler"]
    if debug:  # Python's debug allocator, with where each block was allocated
        command += ["-X", "tracemalloc=25"]
    command += [__file__, "--child", mode, "--iterations", str(iterations)]
    command += ["--threads", str(threads), "--without", without]
    env = dict(os.environ, PYTHONMALLOC="debug") if debug else None
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=False, env=env
        )
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    if logs:
        name = f"{mode}-t{threads}-{without or 'all'}{'-debug' if debug else ''}.log"
        Path(logs, name.replace(",", "_")).write_text(proc.stdout + proc.stderr)
    out = proc.stdout.strip().splitlines()
    crash = [ln for ln in proc.stderr.splitlines() if ln.startswith(("  File", "Fatal", "Current"))]
    return proc.returncode, " | ".join(out[-1:] + crash[:6])


_VARIANTS = [
    # (mode, threads, parts switched off, debug allocator)
    ("torch", 2, "", False),
    ("torch+newpool", 1, "", False),
    ("torch+newpool+snapshot", 1, "", False),
    ("torch+newpool+routing+snapshot", 1, "", False),
    ("bcg", 1, "", False),
    ("bcg", 2, "", False),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--child")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--without", default="", help="comma-separated parts to switch off")
    parser.add_argument("--logs", help="a folder for each variant's full output")
    args = parser.parse_args()
    if args.child:
        sys.exit(child(args.child, args.iterations, args.threads, args.without.split(",")))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for mode, threads, without, debug in _VARIANTS:
        rc, what = run_variant(mode, args.iterations, threads, without, debug, args.logs)
        label = f"{mode} threads={threads} without={without or '-'}{' debug' if debug else ''}"
        print(f"[{label}] exit {rc}: {what}", flush=True)


if __name__ == "__main__":
    main()
