"""Where a public docstring of bcg_core states a contract that the code broke, on the CPU
backend: each test is the documented behaviour, run."""

from __future__ import annotations

import pytest

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture


@pytest.mark.parametrize("debug", [1, 0, 2.0, ["strict"]])
def test_capture_debug_of_another_type_raises_value_error(debug: object) -> None:
    # Documented: ``ValueError: ... debug has another value``; a non-str raised AttributeError
    # ('int' object has no attribute 'strip') from inside the option parsing.
    with pytest.raises(ValueError, match="debug must be"):
        BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu"), debug=debug)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {"max_entries": 1.5},
        {"max_entries": True},
        {"max_segments": 2.0},
        {"warmup_iters": "2"},
        {"return_views": 1},
        {"replay_context": 3},
    ],
)
def test_runner_options_of_another_type_are_refused_by_name(options: dict[str, object]) -> None:
    # max_entries=1.5 and True were taken as counts, warmup_iters="2" failed a comparison with
    # a raw TypeError, return_views=1 and replay_context=3 were taken unchecked.
    from bcg_core import BreakableGraphRunner

    (name,) = options
    with pytest.raises(TypeError, match=name):
        BreakableGraphRunner(lambda t: t, device="cpu", **options)  # type: ignore[arg-type]
    BreakableGraphRunner(lambda t: t, device="cpu", max_segments=None, warmup_iters=0)
