"""Reference-counted patches (``bcg_core.patch_attribute``), shared by the integrations: the
continuous-batching one patches entries of transformers' attention table (a dict), the
diffusers one methods of attention classes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from bcg_core import PatchHandle, patch_attribute


def _loud(original: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *a: f"loud {original(*a)}"


def _twice(original: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *a: f"{original(*a)} {original(*a)}"


def test_a_dict_entry_is_patched_counted_and_restored() -> None:
    def hello() -> str:
        return "hello"

    table: dict[str, Any] = {"greet": hello}
    first = patch_attribute(table, "greet", _loud)
    second = patch_attribute(table, "greet", _loud)  # the same wrap shares the patch
    assert table["greet"]() == "loud hello" and PatchHandle.count(table, "greet") == 2
    both = PatchHandle.patch_all([(table, "greet", _twice), (table, "greet", _loud)])
    assert table["greet"]() == "loud hello loud hello"  # stacked in first-install order
    assert PatchHandle.count(table, "greet") == 4 and both.active
    both.remove()
    first.remove()
    assert table["greet"]() == "loud hello" and PatchHandle.count(table, "greet") == 1
    with second:
        pass  # leaving the block removes it
    assert table["greet"] is hello and PatchHandle.count(table, "greet") == 0
    with pytest.raises(KeyError):  # all or none: the first patch is released again
        PatchHandle.patch_all([(table, "greet", _loud), (table, "missing", _loud)])
    assert table["greet"] is hello and "missing" not in table


def test_an_entry_other_code_replaced_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    table: dict[str, Any] = {"greet": lambda: "hello"}
    handle = patch_attribute(table, "greet", _loud)

    def theirs() -> str:
        return "theirs"

    table["greet"] = theirs
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        handle.remove()
    assert table["greet"] is theirs and "replaced by other code" in caplog.text
