"""GPU probe: what a failed capture leaves reserved, and which way of giving it back is safe.

A capture that a host sync invalidates makes torch's ``capture_end`` raise before it stops
routing allocations to the pool (device and pinned-host allocators) and before it drops the
reference its ``capture_begin`` took on the pool. bcg ended the device routing and moved the
pool to a fresh id, keeping the old id anchored for the process (``_backends/cuda_pool.py``
until 2026-12-04): its reserved memory was never returned; bcg now does ``release``.
Each variant runs in a child process (a crash is an exit status) and does ``--iterations``
failed captures into fresh pool ids, then pinned-host copies and a clean capture, and prints
what the device allocator holds after ``empty_cache``::

    python benchmarks/probe_failed_capture_memory.py [--iterations 300]

Variants: ``keep`` (bcg before: old anchor kept), ``release`` (also give back the failed
capture's device reference, keep the failed graph object alive, reset the old anchor),
``release-drop`` (the same, and drop the failed graph object), ``anchor`` (reset the old anchor
only, the failed reference kept).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import subprocess
import sys
import warnings

import torch

_VARIANTS = ("keep", "release", "release-drop", "anchor")


def _anchor(pid: tuple[int, int], side: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        graph.capture_begin(pid, "relaxed")
        graph.capture_end()
    return graph


def _child(variant: str, iterations: int) -> None:
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream()
    x = torch.randn(1 << 20, device="cuda")
    kept_anchors: list[torch.cuda.CUDAGraph] = []
    kept_failed: list[torch.cuda.CUDAGraph] = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    for _ in range(iterations):
        pid = torch.cuda.graph_pool_handle()
        anchor = _anchor(pid, side)
        failed = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            failed.capture_begin(pid)
            y = [x * 2 for _ in range(4)]  # 16 MiB in the pool before the failure
            with contextlib.suppress(RuntimeError):
                y[0].sum().item()  # invalidates the capture
            with contextlib.suppress(RuntimeError):
                failed.capture_end()
        del y
        with contextlib.suppress(RuntimeError):
            torch._C._cuda_endAllocateToPool(dev, pid)
        # take the generators out of capture mode (what bcg's _end_generator_capture does)
        clean = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), warnings.catch_warnings(), contextlib.suppress(RuntimeError):
            warnings.filterwarnings("ignore")
            clean.capture_begin(None, "relaxed")
            clean.capture_end()
        clean.reset()
        if variant in ("release", "release-drop"):
            torch._C._cuda_releasePool(dev, pid)
        if variant == "keep":
            kept_anchors.append(anchor)
        else:
            anchor.reset()
            del anchor
        if variant != "release-drop":
            kept_failed.append(failed)
        del failed
        gc.collect()
        torch.cuda.empty_cache()
    after_loop = torch.cuda.memory_reserved()
    # pinned-host traffic and a clean capture after the failures
    for _ in range(200):
        host = torch.empty(1 << 16, pin_memory=True).fill_(1.0)
        dev_copy = host.to("cuda", non_blocking=True)
        back = dev_copy.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        assert back.sum().item() == 1 << 16
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(torch.cuda.graph_pool_handle())
        z = x * 3
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, x * 3)
    print(
        f"{variant}: {iterations} failed captures; reserved {base / 2**20:.0f} -> "
        f"{after_loop / 2**20:.0f} MiB after empty_cache; pinned copies and a capture after: ok",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--child", choices=_VARIANTS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.iterations)
        return
    for variant in _VARIANTS:
        cmd = [sys.executable, "-X", "faulthandler", __file__, "--child", variant]
        done = subprocess.run(
            [*cmd, "--iterations", str(args.iterations)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        lines = (done.stdout + done.stderr).strip().splitlines()
        print(f"[{variant}] rc={done.returncode}: " + " | ".join(lines[-6:]), flush=True)


if __name__ == "__main__":
    main()
