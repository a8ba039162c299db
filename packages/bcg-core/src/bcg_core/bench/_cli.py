"""The ``bcg`` command: ``bcg demo``, ``bcg bench`` and ``bcg check``."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import inspect
import sys
import tempfile
import traceback
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bcg_core import CaptureError, check_capture, check_divergence
from bcg_core._diagnostics.check import failed_check
from bcg_core._diagnostics.divergence import RAISED_IN
from bcg_core.bench._harness import EAGER, BenchContext, Contender, Measurement
from bcg_core.bench._report import (
    print_table,
    progress,
    speedup_over_eager,
    write_json,
    write_plot,
)
from bcg_core.bench._toy_decoder import ToyDecoder, tiny_config
from bcg_core.bench._workloads import (
    bcg_contender,
    cli_decoder_config,
    decode_step,
    discover,
    full_graph_contender,
)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def demo(args: argparse.Namespace) -> int:
    """Capture the toy decoder with attention as the break, check replay against eager, and
    time eager / full graph / bcg. Without CUDA, the same on the CPU graph backend."""
    device = _device()
    if device.type == "cuda":
        cfg = cli_decoder_config()
        name = f"toy decoder ({cfg.layers} layers, hidden {cfg.hidden}, bf16), decode batch 1"
    else:
        print(
            "bcg demo: no CUDA device here; showing capture and replay on the CPU graph backend "
            "(CUDA capture rules, CPU speed)."
        )
        cfg = tiny_config(torch.float32)
        name = f"toy decoder ({cfg.layers} layers, hidden {cfg.hidden}, fp32, CPU), batch 1"
    ctx = BenchContext(device, smoke=True, repeats=args.repeats, steps=args.steps)
    with torch.no_grad():
        model = ToyDecoder(cfg, seed=0, device=device)
        step = decode_step(model, batch=1)
        reference = step().clone()
        contenders = [
            Contender(EAGER, step),
            full_graph_contender(ctx, step, reference),
            bcg_contender(ctx, step, reference),
        ]
        with progress("demo") as update:
            ctx.progress = update
            results = ctx.compare("demo", "batch=1", contenders)
    print_table(f"bcg demo — {name}", results)
    bcg = next(m for m in results if m.contender == "bcg")
    speedup = speedup_over_eager(bcg)
    if speedup is not None:
        print(
            f"replay equals eager: {'yes' if bcg.correct else 'NO'}; bcg speed-up over eager "
            f"{speedup:.2f}x with {bcg.segments} graph segments"
        )
    return 0 if bcg.correct else 1


def bench(args: argparse.Namespace) -> int:
    """Run the workloads (all, or those named) and report every contender side by side."""
    workloads = discover()
    names = args.workload or list(workloads)
    unknown = [n for n in names if n not in workloads]
    if unknown:
        print(
            f"bcg bench: unknown workload(s) {unknown}; installed: {sorted(workloads)}",
            file=sys.stderr,
        )
        return 2
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        problem = None if path is None else _unwritable(path)
        if problem is not None:  # said now, not after the whole run (whose figures it loses)
            print(f"bcg bench: {option} {path}: {problem}", file=sys.stderr)
            return 2
    if (
        args.json is not None
        and args.plot is not None
        and args.json.resolve() == args.plot.resolve()
    ):
        # The PNG was written over the JSON just written: both said "wrote", the figures lost.
        print(f"bcg bench: --plot {args.plot} is the --json file; give another", file=sys.stderr)
        return 2
    device = _device()
    repeats = args.repeats if args.repeats is not None else (3 if args.smoke else 10)
    steps = args.steps if args.steps is not None else (3 if args.smoke else 20)
    ctx = BenchContext(
        device, smoke=args.smoke, repeats=repeats, steps=steps, skip=frozenset(args.skip)
    )
    results: list[Measurement] = []
    raised = []
    with progress("bench") as update:
        ctx.progress = update
        for name in names:
            try:
                results += workloads[name](ctx)
            except Exception as exc:
                # A traceback here lost the table, --json and every figure taken so far: the
                # workload is a row saying why (its traceback on stderr), and the run exits 1.
                traceback.print_exc()
                why = f"raised {type(exc).__name__}: {exc}"
                results.append(Measurement(name, "-", "-", None, skipped=why))
                raised.append(name)
    title = f"bcg bench{' --smoke' if args.smoke else ''} on {device.type}"
    print_table(title, results)
    if args.json:
        settings = {
            "device": str(device),
            "smoke": args.smoke,
            "repeats": repeats,
            "steps": steps,
            "skip": sorted(set(args.skip)),
            "workloads": names,
        }
        write_json(args.json, results, settings)
        print(f"wrote {args.json}")
    if args.plot:
        if write_plot(args.plot, results):
            print(f"wrote {args.plot}")
        else:
            print("--plot needs matplotlib: pip install 'bcg-core[bench]'")
    # A misspelt --skip, or one naming a contender that is always timed (eager), left it in
    # silently: say which names left nothing out.
    left_out = {m.contender for m in results if m.skipped is not None}
    unmatched = [name for name in dict.fromkeys(args.skip) if name not in left_out]
    if unmatched:
        timed = sorted({m.contender for m in results if m.skipped is None})
        print(
            f"bcg bench: --skip {', '.join(unmatched)} left out no contender of these "
            f"workloads (timed: {', '.join(timed)})",
            file=sys.stderr,
        )
    wrong = [m for m in results if m.correct is False]
    for m in wrong:
        print(f"WRONG RESULT: {m.workload} {m.case} {m.contender} differs from eager")
    for name in raised:
        print(f"bcg bench: workload {name} raised (traceback above)", file=sys.stderr)
    return 1 if wrong or raised else 0


def _unwritable(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (its missing folders are made then), or None."""
    if path.is_dir():
        return "is a folder; give a file name"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    # Tried, not asked of os.access: it reads permission bits, and says yes to root in a folder
    # that refuses new files (/proc, a read-only mount), where the run then lost its figures.
    try:
        if path.exists():
            with path.open("ab"):  # appends nothing: the file is kept as it is
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as exc:
        return f"cannot write {path if path.exists() else f'in {folder}'} ({exc.strerror})"
    return None


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number >= 1 (0 repeats or steps leave nothing to time)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _tolerance(text: str) -> float:
    """An argparse type: a number >= 0 (not NaN)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


class _TargetError(Exception):
    """A ``bcg check`` target (or ``--backend``) that cannot be used: one line for the user,
    exit code 2."""


def _load(target: str) -> Callable[[], Any]:
    """The zero-argument callable ``FILE.py:NAME`` or ``MODULE:NAME`` names. A file is loaded
    by its path under a module name of its own, never imported by its stem (a file called
    ``random.py`` must not resolve to the standard library's ``random``)."""
    # At the last colon: a name has none, a path may ("run:3/model.py", a Windows drive).
    source, _, attr = target.rpartition(":")
    if not source or not attr:
        raise _TargetError(f"expected FILE.py:FUNCTION or MODULE:FUNCTION, got {target!r}")
    if source.endswith(".py"):
        module = _load_file(Path(source))
    else:
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (source + ".").startswith(exc.name + "."):
                raise _TargetError(_import_failure(source, exc)) from exc  # a dependency
            raise _TargetError(f"no module {source!r} ({exc}); for a file, give FILE.py") from exc
        except Exception as exc:
            raise _TargetError(_import_failure(source, exc)) from exc
    if not hasattr(module, attr):
        raise _TargetError(f"{source} defines no {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise _TargetError(f"{target} is not callable (a {type(fn).__name__})")
    try:
        inspect.signature(fn).bind()
    except TypeError as exc:
        raise _TargetError(
            f"{target} must take no arguments ({exc}); wrap the call in a function that builds "
            "its inputs"
        ) from exc
    except ValueError:
        pass  # no signature to read (some builtins): let the call say
    return fn  # type: ignore[no-any-return]


def _load_file(path: Path) -> types.ModuleType:
    path = path.resolve()
    if not path.is_file():
        raise _TargetError(f"no file {path}")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"_bcg_check_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _TargetError(f"cannot load {path} as Python source")
    module = importlib.util.module_from_spec(spec)
    # As when the file runs as a script: its folder first on sys.path (for its sibling
    # imports), and the module registered before it runs (dataclasses and pickling look it up).
    sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]  # as a failed import leaves no module behind
        raise _TargetError(_import_failure(str(path), exc)) from exc
    return module


def _import_failure(source: str, exc: Exception) -> str:
    """One line for a target whose import raised (a traceback, exit status 1, said "the check
    failed"; a missing dependency was "no module" naming the target)."""
    where = ""
    if not isinstance(exc, SyntaxError):  # its message names the file and line already
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            where = f" at {frames[-1].filename}:{frames[-1].lineno}"
    return f"importing {source} raised {type(exc).__name__}: {exc}{where}"


def _is_builder_result(made: Any) -> bool:
    return isinstance(made, tuple) and len(made) == 2 and callable(made[0])


def check(args: argparse.Namespace) -> int:
    """Run a zero-argument callable under CPU capture; report the first host sync or success.
    With ``--divergence`` the callable returns ``(fn, input_sets)`` instead, and the divergence
    check compares eager and replay of ``fn`` over the sets (a capture that fails is reported
    as the plain check reports it, exit code 1; sets the check refuses, such as one set or
    shapes unlike set 0's, are a target that cannot be used). A target that cannot be used,
    ``--divergence --backend cuda`` without CUDA, or a divergence option (``--backend cuda``,
    ``--atol``, ``--rtol``, ``--seed``) without ``--divergence`` gets one line on stderr and
    exit code 2."""
    try:
        return _check(args)
    except _TargetError as exc:
        print(f"bcg check: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> int:
    if args.divergence and args.backend == "cuda" and not torch.cuda.is_available():
        raise _TargetError(
            "--backend cuda needs a CUDA device, but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); use --backend cpu (the CPU graph backend)"
        )
    # Options of the divergence check, given without it, were dropped silently: a plain check
    # asked for with --backend cuda said "captures cleanly" from the CPU backend.
    ignored = [
        flag
        for flag, given in (
            ("--backend cuda", args.backend == "cuda"),
            ("--atol", args.atol != 0.0),
            ("--rtol", args.rtol != 0.0),
            ("--seed", args.seed != 0),
        )
        if given
    ]
    if ignored and not args.divergence:
        raise _TargetError(
            f"{', '.join(ignored)} apply to --divergence only; without it bcg check captures "
            "once on the CPU backend"
        )
    target = _load(args.target)
    if not args.divergence:
        made: list[Any] = []
        report = check_capture(lambda: made.append(target()))
        if made and _is_builder_result(made[0]):
            raise _TargetError(
                f"{args.target} returns (fn, input_sets), a divergence-check builder: add "
                "--divergence"
            )
        print(f"{args.target}: {report}")
        return 0 if report.ok else 1
    built = target()
    if not _is_builder_result(built):
        raise _TargetError(
            f"with --divergence, {args.target} must return (fn, input_sets), got {built!r:.80}"
        )
    fn, sets = built
    try:
        divergence = check_divergence(
            fn, sets, backend=args.backend, atol=args.atol, rtol=args.rtol, seed=args.seed
        )
    except CaptureError as exc:
        # Said as the plain check says it (a host sync's op and line), not as a traceback.
        print(f"{args.target}: {failed_check(exc)}")
        return 1
    except (TypeError, ValueError) as exc:
        if any(note.startswith(RAISED_IN) for note in getattr(exc, "__notes__", ())):
            raise  # the step's own error, in one of the check's runs: its traceback helps
        # The builder's (fn, input_sets) cannot be checked (one set, shapes that differ from
        # set 0's, nothing compared): a traceback and exit code 1, "the check failed", before.
        refused = f"{args.target}: check_divergence refused its (fn, sets): {exc}"
        raise _TargetError(refused) from exc
    print(f"{args.target}: {divergence}")
    return 0 if divergence.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """The ``bcg`` command: ``bcg demo``, ``bcg bench [WORKLOAD ...]`` and ``bcg check TARGET``.

    Args:
        argv: the command-line arguments after the program name (default None:
            ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success; 1 when a result is wrong (a replay differs from eager,
        a check fails) or a bench workload raised (the others still run and are reported); 2
        for an unknown workload, a ``--json``/``--plot`` path that cannot be written (said
        before the run), or a ``bcg check`` target that cannot be used (not found, not
        callable, raising on import, returning the wrong thing or input sets the divergence
        check refuses; or ``--backend cuda`` without CUDA, or a divergence option without
        ``--divergence``), reported in one line on stderr.

    Raises:
        SystemExit: bad command-line arguments (argparse's usage error, status 2).
        Exception: whatever a ``bcg check`` target raises when it is called (not a capture
            failure: that is reported, status 1).
    """
    parser = argparse.ArgumentParser(prog="bcg", description="Breakable CUDA graphs for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="capture the toy decoder and compare with eager")
    p_demo.add_argument("--repeats", type=_at_least_one, default=5)
    p_demo.add_argument("--steps", type=_at_least_one, default=10)
    p_demo.set_defaults(func=demo)
    p_bench = sub.add_parser("bench", help="benchmark workloads against eager, graphs and peers")
    p_bench.add_argument("workload", nargs="*", help="workloads to run (default: all installed)")
    p_bench.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (CI)")
    p_bench.add_argument("--repeats", type=_at_least_one, default=None)
    p_bench.add_argument("--steps", type=_at_least_one, default=None, help="steps per timed repeat")
    p_bench.add_argument(
        "--skip", action="append", default=[], metavar="CONTENDER",
        help="leave a contender out (repeatable), e.g. --skip torch.compile",
    )  # fmt: skip
    p_bench.add_argument("--json", type=Path, default=None, help="write every figure as JSON")
    p_bench.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart")
    p_bench.set_defaults(func=bench)
    p_check = sub.add_parser(
        "check",
        help="does a callable capture? (CPU capture, no GPU); --divergence: replay vs eager",
    )
    p_check.add_argument("target", help="MODULE:CALLABLE or FILE.py:CALLABLE, zero arguments")
    p_check.add_argument(
        "--divergence", action="store_true",
        help="the callable returns (fn, input_sets): compare eager and replay of fn over them",
    )  # fmt: skip
    p_check.add_argument(
        "--backend", choices=("cpu", "cuda"), default=None,
        help="with --divergence (default: the inputs' device)",
    )  # fmt: skip
    p_check.add_argument(
        "--atol", type=_tolerance, default=0.0, help="with --divergence (bitwise: 0)"
    )
    p_check.add_argument(
        "--rtol", type=_tolerance, default=0.0, help="with --divergence (bitwise: 0)"
    )
    p_check.add_argument("--seed", type=int, default=0, help="with --divergence")
    p_check.set_defaults(func=check)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
