"""The divergence check's report: where a replay first differs from eager, and the usual cause."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "diverged", "nondeterministic", "stateful"]

Cause = Literal[
    "baked_in_segment",
    "frozen_break_argument",
    "frozen_break_output",
    "break_sequence",
    "break_itself",
    "step_attribute",
    "private_generator",
]

_CAUSES: dict[str, tuple[str, str]] = {
    "baked_in_segment": (
        "a value read on the host was baked into this segment at capture: a Python number "
        "from .item()/float()/int() taken before the segment, a Python list turned into a "
        "tensor (torch.tensor(lengths)), a slice or mask built from Python ints, or host "
        "metadata (sequence lengths, block ids, an adapter index) that no break received",
        "move the code that uses the host value into an @eager_on_graph break (it runs "
        "eagerly at every replay), or pass the value as a tensor input whose contents change",
    ),
    "frozen_break_argument": (
        "a break received a non-tensor argument (a Python number or list, or an attribute of "
        "an object argument) that differs from capture: at replay a break is re-run with the "
        "arguments it was captured with",
        "pass the value as a tensor (updated in place), or keep it in an object that is the "
        "same object at every step and updated in place",
    ),
    "frozen_break_output": (
        "a break returned a non-tensor value (a Python number from .item(), a list) that "
        "differs from capture: code after a break keeps the capture-time value",
        "return a tensor instead (it is copied into the next segment at every replay), or move "
        "the code that uses the value into the break",
    ),
    "break_sequence": (
        "eager called other breaks than the captured graph runs: Python control flow chose "
        "another path (an if/for on a host value) before this point",
        "capture one graph per path (e.g. a BreakableGraphRunner keyed on the value), or move "
        "the branch into an @eager_on_graph break",
    ),
    "break_itself": (
        "a break returned different tensors from identical inputs: it reads state that is not "
        "among its arguments, or it is nondeterministic",
        "pass that state to the break as an argument",
    ),
    "step_attribute": (
        "the step changes a Python attribute of a module it calls (a counter such as "
        "self.step += 1): a graph replays the value it saw at capture and never changes it",
        "keep the value in a tensor updated in place (a buffer: self.step.add_(1)), or pass it "
        "to the step as an argument (a tensor, or the runner's as_tensor= for a Python number)",
    ),
    "private_generator": (
        "the step draws from a private torch.Generator: torch.manual_seed does not reseed it, so "
        "every run draws other numbers, and a CUDA graph replays only the generators it was "
        "told about",
        "draw from the default generator (seeded by torch.manual_seed), or reseed the private "
        "generator at the start of the step from a seed the caller controls",
    ),
}

_SHOWN = 8


@dataclass(frozen=True)
class TensorDiff:
    """One value that differs between the eager run and the replay.

    Attributes:
        path: where the value is (``args[0]``, ``kwargs['mask']``, ``output['h']``,
            ``output[1]``).
        shape: the eager tensor's shape; None for a non-tensor value.
        max_abs_diff: the largest ``|eager - replay|`` (``inf`` where only one side is NaN);
            None when the types, shapes or dtypes differ, or for non-tensors.
        detail: what differs, in words.
    """

    path: str
    shape: tuple[int, ...] | None
    max_abs_diff: float | None
    detail: str


@dataclass(frozen=True)
class DivergenceReport:
    """The outcome of :func:`bcg_core.check_divergence` (and of the runner's check_divergence).

    ``str()`` of a report is a readable summary with the likely cause and its fix. The fields
    after ``breaks`` are set only when ``status`` is not ``"ok"`` (else None or empty).

    Attributes:
        status: ``"ok"`` (replay equals eager for every input set, break by break),
            ``"diverged"`` (the first difference is described by the fields below),
            ``"nondeterministic"`` (two eager runs from the same seed already differ there, so
            no divergence can be judged) or ``"stateful"`` (one eager run changed state the step
            keeps in itself: ``diffs`` name each Python attribute or private generator,
            ``cause`` says which kind). ``ok`` is ``status == "ok"``.
        backend: the graph backend the check ran on, ``"cuda"`` or ``"cpu"``.
        input_sets: how many input sets were given.
        segments: graph segments of the captured graph.
        breaks: break calls of the captured graph.
        input_set: the index (into the given inputs) of the set that exposed the difference.
        observed_at: where it was seen: the inputs or outputs of a break call, or the output.
        segment: the graph segment blamed, numbered from 1 as in capture errors (segment ``k``
            runs after the ``k-1``-th break call and before the ``k``-th); None when a break
            itself is blamed.
        break_before: the name of the break call before it (None at the start).
        break_after: the name of the break call after it (None at the output).
        cause: the kind of mistake that usually produces it (``"baked_in_segment"``,
            ``"frozen_break_argument"``, ``"frozen_break_output"``, ``"break_sequence"``,
            ``"break_itself"``).
        diffs: the values that differ.
        source_lines: the user source lines of the blamed segment's operations (CPU backend
            only, else empty).
    """

    status: Status
    backend: str
    input_sets: int
    segments: int
    breaks: int
    input_set: int | None = None
    observed_at: str | None = None
    segment: int | None = None
    break_before: str | None = None
    break_after: str | None = None
    cause: Cause | None = None
    diffs: tuple[TensorDiff, ...] = ()
    source_lines: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """``status == "ok"``: replay equals eager everywhere."""
        return self.status == "ok"

    def __str__(self) -> str:
        head = (
            f"bcg divergence check ({self.backend} backend, {self.input_sets} input sets, "
            f"{self.segments} graph segments, {self.breaks} break calls)"
        )
        if self.status == "ok":
            return f"{head}: ok, replay equals eager at every break and at the output"
        lines = [f"{head}: {_VERDICT[self.status]}"]
        if self.status == "stateful":
            lines.append(f"  input set {self.input_set}: one eager run changed {self.observed_at}")
        else:
            lines.append(
                f"  input set {self.input_set} (set 0 was captured), at {self.observed_at}"
            )
        if self.status == "diverged":
            lines.append(f"  {self._where()}")
        lines.append(f"  {_HEADING[self.status]}:" if self.diffs else "")
        for d in self.diffs[:_SHOWN]:
            shape = "" if d.shape is None else f" shape {tuple(d.shape)}"
            lines.append(f"    {d.path}{shape}: {d.detail}")
        if len(self.diffs) > _SHOWN:
            lines.append(f"    ... and {len(self.diffs) - _SHOWN} more")
        if self.source_lines:
            lines.append(f"  source lines of segment {self.segment} (CPU recorder):")
            lines += [f"    {loc}" for loc in self.source_lines[: _SHOWN * 2]]
            if len(self.source_lines) > _SHOWN * 2:
                lines.append(f"    ... and {len(self.source_lines) - _SHOWN * 2} more")
        if self.status == "nondeterministic":
            lines.append(
                "  two eager runs of the same inputs from the same seed differ here, so replay "
                "cannot be judged. Either the step is nondeterministic (atomics, other "
                "randomness: pass atol/rtol, or enable torch.use_deterministic_algorithms(True)), "
                "or it advances tensor state that it reads (a cache position, a counter kept in "
                "a tensor): give each input set to check_divergence as a zero-argument callable "
                "that puts that state back before every run (a runner's check_divergence cannot)"
            )
        elif self.cause is not None:
            why, fix = _CAUSES[self.cause]
            lines.append(f"  likely cause: {why}")
            lines.append(f"  fix: {fix}")
        return "\n".join(line for line in lines if line)

    def _where(self) -> str:
        if self.segment is None:
            return f"blamed: the break {self.break_after!r} itself, not a graph segment"
        before = (
            f"after break {self.break_before!r} (call {self.segment - 1})"
            if self.break_before is not None
            else "from the start of the step"
        )
        after = (
            f"before break {self.break_after!r} (call {self.segment})"
            if self.break_after is not None
            else "to the step's output"
        )
        return f"diverging graph segment {self.segment}: {before}, {after}"


_VERDICT = {
    "diverged": "REPLAY DIFFERS FROM EAGER",
    "nondeterministic": "EAGER IS NOT REPRODUCIBLE",
    "stateful": "THE STEP CHANGES ITS OWN STATE",
}
_HEADING = {
    "diverged": "values that differ (eager vs replay)",
    "nondeterministic": "values that differ (eager run 1 vs eager run 2)",
    "stateful": "state changed by the step (before and after one eager run)",
}
