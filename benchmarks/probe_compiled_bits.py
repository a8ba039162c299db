# ruff: noqa: PLC2701  (a probe builds the bench's own model and step)
"""GPU probe for issue 20: is the compiled ``hf-llama`` decode step bitwise reproducible?

The bench's bitwise checks of ``compiled_graph`` and ``bcg+compile`` against the compiled step
run without a graph failed at batch 8 in two H200 runs, one contender each time. This builds the
bench's model and step (16 layers, hidden 1024, bf16, StaticCache of 1024) at batch 8, compiles
it (default mode, ``fullgraph``) and compares, bitwise, runs of: the compiled step on the
current stream and on a side stream, one plain CUDA graph of it, and the runner over it (bcg's
breaks); then the uncompiled step (eager) the same way. Prints one line per comparison (equal,
or the max difference); never raises.

Run from the repo root with the sources on PYTHONPATH; ``--batch`` picks the batch size.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bcg_core import BreakableGraphRunner
from bcg_core.bench._hf_llama import _decode_step, _llama

Step = Callable[[], torch.Tensor]


def _runs(run: Step, count: int = 5) -> list[torch.Tensor]:
    outs = []
    for _ in range(count):
        outs.append(run().clone())
    torch.cuda.synchronize()
    return outs


def _report(label: str, outs: list[torch.Tensor], reference: torch.Tensor) -> None:
    diffs = [float((o.float() - reference.float()).abs().max()) for o in outs]
    same = all(torch.equal(o, reference) for o in outs)
    print(f"{label}: {'equal' if same else 'DIFFERS'} (max |diff| per run {diffs})", flush=True)


def _side(run: Step) -> Step:
    side = torch.cuda.Stream()

    def on_side() -> torch.Tensor:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = run()
        torch.cuda.current_stream().wait_stream(side)
        return out

    return on_side


def _graphed(run: Step) -> Step:
    _side(run)()
    _side(run)()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def probe(label: str, step: Step) -> None:
    reference = step().clone()
    torch.cuda.synchronize()
    _report(f"{label}: step again, current stream", _runs(step), reference)
    _report(f"{label}: step on a side stream", _runs(_side(step)), reference)
    _report(f"{label}: one plain CUDA graph", _runs(_graphed(step)), reference)
    runner = BreakableGraphRunner(step, return_views=True)
    runner.capture()
    _report(f"{label}: runner (bcg breaks)", _runs(runner), reference)
    _report(f"{label}: step after the captures", _runs(step), reference)
    runner.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    import transformers

    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    model, context, _ = _llama(transformers, torch.device("cuda"), smoke=False)
    with torch.no_grad():
        step = _decode_step(transformers, model, args.batch, context)
        for label, run in (
            (f"compiled batch={args.batch}", torch.compile(step, fullgraph=True)),
            (f"eager batch={args.batch}", step),
        ):
            try:
                probe(label, run)
            except Exception as exc:  # a probe reports, never stops
                print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
