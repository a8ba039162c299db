"""What a runner call costs over replaying the same breakable graph by hand, at real scale.

``python3 benchmarks/bench_call_cost.py --out DIR`` (both packages' ``src`` on ``PYTHONPATH``)
(``--workloads hf-llama,decoder-8b,flux``; ``--smoke`` for tiny models, also on CPU;
``--profile`` adds ``DIR/profile-call-<workload>.txt``, cProfile of 200 runner calls and of
200 hand replays)

Workloads (bf16 on CUDA, random weights): ``hf-llama`` (the ``hf-llama`` bench model, batch 1,
a decode step over a StaticCache rewound each step, no call arguments), ``decoder-8b`` (the toy
decoder at Llama-3-8B dimensions, ``capture-scale``'s model, batch 1; tokens and positions
passed each call, so the runner copies them) and ``flux`` (the ``flux`` bench model through
``DiTRunner``, no call arguments; skipped without diffusers). Variants, all but one on the one
graph the runner captured (two captures of one step differ on the device by tens of us at 8B
dims, more than the target, so only the same graph measures the runner's calls):

- ``hand``: the runner's graph replayed by hand (``copy_`` of the call's inputs into its static
  buffers, then ``graph.replay()``);
- ``hand (own capture)``: the same step captured apart and replayed by hand: how far another
  capture of the step lands (not part of the target);
- ``hand+flag``: ``hand`` with the runtime flag on (as the runner replays);
- ``hand+protocol``: the same inside what the runner adds around the replay: its pool turn
  (lock; an event wait only when the last use was on another stream), the runtime flag on
  (clone where it clones);
- ``runner_views``: the runner with ``return_views=True``;
- ``runner``: the runner, output cloned (``return_views=False``).

Three modes: ``sync`` (the device synchronised after every call: call-to-result latency, as a
``generate()`` loop that samples on the host sees it), ``pipelined`` (one synchronisation per
``--steps`` calls: what a call costs in a loop that never waits; nothing when the device is the
bottleneck) and ``host`` (the call's own host time, the device idle at its start and
synchronised outside the timed span: the bookkeeping alone, free of the device's
step-to-step variation, which at 8 ms a step is larger than the target). Samples are taken
interleaved, the variants' order rotated every round (``sync`` and ``host``: one call per
variant and round, ``--repeats`` x ``--steps`` rounds; ``pipelined``: one block of ``--steps``
calls per variant and round, ``--repeats`` rounds), and ``overhead`` is the median of the paired
differences ``runner - hand`` of one round (target: <= 25 us in sync and pipelined mode):
neighbouring samples share the host's and the device's drift, which moved whole runs of one
variant by tens of us when variants ran one after another. The
gap between ``hand+protocol`` and ``runner`` is the runner's host bookkeeping (lock, signature
walk, dictionary lookups); the gap between ``hand`` and ``hand+protocol`` is the turn and the
flag. Writes ``DIR/bench_call_cost-<device>.json`` and prints one line per workload.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    enable_breakable_cuda_graph,
)
from bcg_core._capture.flag import flag_on, flag_reset  # noqa: PLC2701
from bcg_core._runner.pool import PoolTurn  # noqa: PLC2701
from bcg_core.bench import (
    ToyDecoder,
    _hf_llama,  # noqa: PLC2701
    environment,
    tiny_config,
)
from bcg_core.bench._scale_workload import scale_config  # noqa: PLC2701

TARGET_US = 25.0
OWN_CAPTURE = "hand (own capture)"
MODES = ("sync", "pipelined", "host")
WORKLOADS = ("hf-llama", "decoder-8b", "flux")


@dataclasses.dataclass
class Case:
    """One workload: the step, its call arguments, and a runner made for it."""

    step: Callable[..., torch.Tensor]
    args: tuple[torch.Tensor, ...]
    make_runner: Callable[[bool], BreakableGraphRunner]
    close: Callable[[], None] = lambda: None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_case(device: torch.device, smoke: bool) -> Case | str:
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    model, context, _ = _hf_llama._llama(transformers, device, smoke)
    step = _hf_llama._decode_step(transformers, model, 1, context)
    return Case(
        step, (), lambda views: BreakableGraphRunner(step, device=device, return_views=views)
    )


def _decoder_case(device: torch.device, smoke: bool) -> Case:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = tiny_config(dtype) if smoke else scale_config(dtype)
    model = ToyDecoder(cfg, seed=0, device=device, draw_on_device=True)
    model.allocate_cache(1)
    tokens = torch.zeros(1, dtype=torch.long, device=device)
    positions = torch.full((1,), cfg.max_context - 1, device=device)

    def step(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(t, p)
        return out

    return Case(
        step,
        (tokens, positions),
        lambda views: BreakableGraphRunner(step, device=device, return_views=views),
    )


def _flux_case(device: torch.device, smoke: bool) -> Case | str:
    try:
        import diffusers
    except ImportError:
        return "diffusers is not installed"
    from bcg_diffusion import DiTRunner, make_attention_ops_breakable

    cuda = device.type == "cuda"
    if smoke:
        heads, head_dim, rope, layers, single = 2, 16, (4, 6, 6), 1, 1
        channels, joint, pooled_dim, grid, text_len = 4, 32, 32, 4, 8
    else:  # the flux bench workload's model
        heads, head_dim, rope, layers, single = 4, 128, (16, 56, 56), 4, 8
        channels, joint, pooled_dim, grid, text_len = 64, 4096, 768, 32, 64
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    flux: Any = diffusers.FluxTransformer2DModel
    model = flux(
        patch_size=1, in_channels=channels, num_layers=layers, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=joint,
        pooled_projection_dim=pooled_dim, axes_dims_rope=rope, guidance_embeds=False,
    ).to(device, dtype).eval()  # fmt: skip
    latents = torch.randn(1, grid * grid, channels).to(device, dtype)
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    kw = {
        "encoder_hidden_states": torch.randn(1, text_len, joint).to(device, dtype),
        "pooled_projections": torch.randn(1, pooled_dim).to(device, dtype),
        "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], -1)
        .reshape(-1, 3)
        .float()
        .to(device),
        "txt_ids": torch.zeros(text_len, 3, device=device),
    }
    t = torch.full((1,), 0.5, device=device)

    def step() -> torch.Tensor:
        v: torch.Tensor = model(hidden_states=latents, timestep=t, return_dict=False, **kw)[0]
        return latents - v / 20

    patches = make_attention_ops_breakable(model)  # the case's own, for the hand captures
    runners: list[Any] = []

    def make(views: bool) -> BreakableGraphRunner:
        # Each runner owns its handle (it removes it on close()); the patch is shared.
        runner = DiTRunner(
            step,
            breakable_attention=make_attention_ops_breakable(model),
            device=device,
            return_views=views,
        )
        runners.append(runner)
        return runner

    def close() -> None:
        for r in runners:
            r.close()
        patches.remove()

    return Case(step, (), make, close)


def _variants(case: Case, device: torch.device) -> dict[str, Callable[[], object]]:
    """The ways of running the case (see the module text): every variant but ``hand (own
    capture)`` replays the runner's own graph, so their differences are the runner's calls and
    not one capture's device time against another's."""
    runner = case.make_runner(False)
    with torch.no_grad():
        runner.capture(*case.args)
    (entry,) = runner._entries.values()
    statics = entry.statics
    out = entry.output

    def load(into: Sequence[torch.Tensor] = statics) -> None:
        for s, a in zip(into, case.args, strict=True):
            s.copy_(a)

    def hand() -> torch.Tensor:
        load()
        entry.graph.replay()
        return out  # type: ignore[no-any-return]

    # The same step captured apart: how far two captures of one step differ on the device.
    own_statics = tuple(a.clone() for a in case.args)
    own = BreakableCUDAGraph(backend=device.type)
    with torch.no_grad(), enable_breakable_cuda_graph():
        for _ in range(2):
            case.step(*own_statics)
        _sync(device)
        with BreakableCUDAGraphCapture(own):
            own_out = case.step(*own_statics)

    def own_capture() -> torch.Tensor:
        load(own_statics)
        own.replay()
        return own_out

    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    turn = PoolTurn(entry.graph._backend_impl)

    def hand_protocol(clone: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with turn.lock:  # the runner's order of uses (an event only across streams)
                turn.wait(stream)
                token = flag_on()
                try:
                    load()
                    entry.graph.replay()
                    result = out.clone() if clone else out
                finally:
                    flag_reset(token)
                    turn.record(stream)
            return result  # type: ignore[no-any-return]

        return run

    def hand_flag() -> torch.Tensor:
        with enable_breakable_cuda_graph():
            load()
            entry.graph.replay()
        return out  # type: ignore[no-any-return]

    def call(views: bool) -> Callable[[], object]:
        def run() -> object:
            runner.return_views = views
            return runner(*case.args)

        return run

    variants: dict[str, Callable[[], object]] = {
        "hand": hand,
        OWN_CAPTURE: own_capture,
        "hand+flag": hand_flag,
        "hand+protocol": hand_protocol(False),
        "runner_views": call(True),
        "hand+protocol+clone": hand_protocol(True),
        "runner": call(False),
    }
    variants["_keep"] = lambda: {"runner": runner, "own": own}  # not timed
    return variants


def decoder_probe(smoke: bool) -> tuple[torch.device, Case, dict[str, Callable[[], object]]]:
    """Where the call-cost probes start: the device (CUDA when there is one), grad mode off,
    the decoder-8b case (the tiny decoder with ``smoke``) and its variants."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_grad_enabled(False)
    case = _decoder_case(device, smoke)
    return device, case, _variants(case, device)


def settle(fns: Iterable[Callable[[], object]], device: torch.device, warmups: int = 3) -> None:
    """Before a probe's timed rounds: call each of ``fns`` ``warmups`` times, wait for the
    device, collect garbage and pause the collector (the probe re-enables it)."""
    for fn in fns:
        for _ in range(warmups):
            fn()
    _sync(device)
    gc.collect()
    gc.disable()


def _one_call(fn: Callable[[], object], device: torch.device, mode: str) -> float:
    """One call's time in us: to its result (``sync``) or its host part alone (``host``)."""
    _sync(device)
    start = time.perf_counter()
    fn()
    if mode == "sync":
        _sync(device)
    elapsed = time.perf_counter() - start
    _sync(device)
    return elapsed * 1e6


def _block(fn: Callable[[], object], steps: int, device: torch.device) -> float:
    """us per call over ``steps`` calls with one synchronisation at the end (``pipelined``)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e6 / steps


def _samples(
    timed: dict[str, Callable[[], object]],
    repeats: int,
    steps: int,
    device: torch.device,
    mode: str,
) -> dict[str, list[float]]:
    """Per-variant samples taken interleaved, the variants' order rotated at every round: the
    i-th samples of two variants are neighbours in time, so their difference is free of the
    host's and the device's drift (which moved whole runs by tens of us)."""
    names = list(timed)
    out: dict[str, list[float]] = {k: [] for k in names}
    rounds = repeats * steps if mode != "pipelined" else repeats
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = timed[name]
            value = (
                _block(fn, steps, device) if mode == "pipelined" else _one_call(fn, device, mode)
            )
            out[name].append(value)
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_case(
    case: Case, device: torch.device, repeats: int, steps: int, profile: Path | None = None
) -> dict[str, Any]:
    variants = _variants(case, device)
    timed = {k: v for k, v in variants.items() if not k.startswith("_")}
    result: dict[str, Any] = {}
    with torch.no_grad():
        expected = timed["hand"]()
        assert isinstance(expected, torch.Tensor)
        expected = expected.clone()
        same = all(torch.equal(fn(), expected) for fn in timed.values())  # type: ignore[arg-type]
        for mode in MODES:
            for fn in timed.values():
                for _ in range(3):
                    fn()
            gc.collect()
            gc.disable()
            try:
                times = _samples(timed, repeats, steps, device, mode)
            finally:
                gc.enable()
            hand = times["hand"]
            result[mode] = {
                "us_per_call": {k: _summary(v) for k, v in times.items()},
                "overhead_us": {
                    k: _summary([a - b for a, b in zip(v, hand, strict=True)])
                    for k, v in times.items()
                    if k != "hand"
                },
            }
        if profile is not None:  # where the host time goes, device idle at each call
            text = io.StringIO()
            for variant in ("runner", "hand"):
                profiler = cProfile.Profile()
                for _ in range(200):
                    _sync(device)
                    profiler.enable()
                    timed[variant]()
                    profiler.disable()
                text.write(f"=== {variant}: 200 calls, the device idle at each call's start\n")
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            profile.write_text(text.getvalue())
    result["same_output"] = same
    result["meets_target"] = all(
        result[m]["overhead_us"][r]["median"] <= TARGET_US
        for m in ("sync", "pipelined")
        for r in ("runner", "runner_views")
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON file")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--smoke", action="store_true", help="tiny models (any device)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--profile", action="store_true", help="also write a cProfile of 200 runner calls"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    makers: dict[str, Callable[[torch.device, bool], Case | str]] = {
        "hf-llama": _hf_case,
        "decoder-8b": _decoder_case,
        "flux": _flux_case,
    }
    report: dict[str, Any] = {"environment": environment(), "target_us": TARGET_US}
    ok = True
    for name in args.workloads.split(","):
        case = makers[name](device, args.smoke)
        if isinstance(case, str):
            report[name] = {"skipped": case}
            print(f"bench_call_cost {name}: skipped ({case})")
            continue
        try:
            profile = args.out / f"profile-call-{name}.txt" if args.profile else None
            args.out.mkdir(parents=True, exist_ok=True)
            result = bench_case(case, device, args.repeats, args.steps, profile)
        finally:
            case.close()
        report[name] = result
        ok = ok and result["same_output"]
        line = ", ".join(
            f"{mode}: hand {result[mode]['us_per_call']['hand']['median']:.1f} us, own capture "
            f"{result[mode]['overhead_us'][OWN_CAPTURE]['median']:+.1f}, runner "
            f"{result[mode]['overhead_us']['runner']['median']:+.1f}, views "
            f"{result[mode]['overhead_us']['runner_views']['median']:+.1f}, protocol "
            f"{result[mode]['overhead_us']['hand+protocol']['median']:+.1f}"
            for mode in MODES
        )
        print(f"bench_call_cost {name} ({device.type}): {line}; same: {result['same_output']}")
        del case
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_call_cost-{device.type}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
