"""Signatures: the key under which a runner stores one captured graph.

A signature describes a call completely enough that a graph captured for one call replays
correctly for another with the same signature: tensor shapes, dtypes and devices; constants
(None, bool, int, float, str, bytes, enums) by value; the structure of lists, tuples and dicts;
every other object by identity (the runner keeps such objects alive while their entry exists, so
an id cannot be recycled under it).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

Signature = tuple[Any, ...]

_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype)


def signature_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """The hashable signature of a call."""
    return signature_and_tensors(args, kwargs)[0]


def signature_and_tensors(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Signature, list[torch.Tensor]]:
    """The signature and, in one pass (a replay's hot path), the call's tensors in the order
    ``map_tree`` visits ``(args, kwargs sorted by name)``."""
    tensors: list[torch.Tensor] = []
    sig = (
        _sig(args, tensors),
        tuple((k, _sig(v, tensors)) for k, v in sorted(kwargs.items())),
    )
    return sig, tensors


def _sig(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device)
    if isinstance(obj, _CONSTANTS):
        return ("const", type(obj).__name__, obj)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_sig(x, tensors) for x in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, _sig(v, tensors)) for k, v in obj.items()))
    return ("object", type(obj).__qualname__, id(obj))


def identity_objects(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The objects a signature refers to by identity (to be kept alive with their entry)."""
    out: list[Any] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, (torch.Tensor, *_CONSTANTS)):
            return
        if isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x)
        else:
            out.append(obj)

    walk(args)
    walk(kwargs)
    return out


def _fields(sig: Any, path: str, out: dict[str, Any]) -> None:
    kind = sig[0]
    if kind in ("tensor", "const", "object"):
        out[path] = sig
    elif kind == "dict":
        out[path] = ("dict", tuple(k for k, _ in sig[1]))
        for k, v in sig[1]:
            _fields(v, f"{path}[{k!r}]", out)
    else:
        out[path] = (kind, len(sig[1]))
        for i, v in enumerate(sig[1]):
            _fields(v, f"{path}[{i}]", out)


def flatten_signature(sig: Signature) -> dict[str, Any]:
    """Signature as ``{path: leaf description}`` (``args[0]``, ``kwargs['t']`` ...)."""
    out: dict[str, Any] = {}
    _fields(sig[0], "args", out)
    for k, v in sig[1]:
        _fields(v, f"kwargs[{k!r}]", out)
    return out


def _describe(leaf: Any) -> str:
    if leaf is None:
        return "absent"
    kind = leaf[0]
    if kind == "tensor":
        return f"tensor{list(leaf[1])} {leaf[2]} on {leaf[3]}"
    if kind == "const":
        return repr(leaf[2])
    if kind == "object":
        return f"{leaf[1]} object #{leaf[2]:x}"
    if kind == "dict":
        return f"dict with keys {list(leaf[1])}"
    return f"{kind} of length {leaf[1]}"


def describe_difference(sig: Signature, others: list[Signature]) -> str:
    """Which fields of ``sig`` differ from the closest of ``others``, in words."""
    if not others:
        return "no signature has been captured yet"
    mine = flatten_signature(sig)
    best: list[str] | None = None
    for other in others:
        theirs = flatten_signature(other)
        diffs = [
            f"{path}: {_describe(mine.get(path))} (captured: {_describe(theirs.get(path))})"
            for path in sorted(set(mine) | set(theirs))
            if mine.get(path) != theirs.get(path)
        ]
        if best is None or len(diffs) < len(best):
            best = diffs
    assert best is not None
    return "; ".join(best)
