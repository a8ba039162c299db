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
