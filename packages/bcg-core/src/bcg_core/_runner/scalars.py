"""Python numbers that a runner copies into device scalars instead of keying graphs on them.

A timestep or a guidance scale changes at every call; as a constant of the signature it would
make every call a new signature (a miss, never a replay). The arguments named in a runner's
``as_tensor`` are lifted instead: a ``bool``, ``int`` or ``float`` found there is replaced by a
:class:`ScalarInput` marker (the signature keeps its type, not its value), the captured call
receives a 0-dim tensor on the runner's device in its place, and every later call writes the
new value into that tensor with ``fill_`` (a kernel taking the value as an argument: no
host-to-device copy, no synchronisation).
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from bcg_core._signature import ScalarInput

_MARKERS: dict[type, ScalarInput] = {kind: ScalarInput(kind) for kind in (bool, int, float)}


_INT64 = range(-(2**63), 2**63)


def _number_kind(value: Any) -> type | None:
    """``bool``, ``int`` or ``float`` for a Python number (enums excluded: they pick code
    paths), else None. An int beyond int64 is None too: it does not fit the slot (writing it
    raised at a replay, and making one failed a capture and blocked every int), so it stays a
    constant of the signature and its calls run as eager would. So is a finite float beyond
    the default float dtype's range (the slot's dtype): a capture given 1e300 computed with
    inf where eager gave finite values, and a replay given one raised torch's overflow
    error."""
    if isinstance(value, enum.Enum):
        return None
    for kind in (bool, int, float):
        if isinstance(value, kind):
            if kind is float:
                # (float16's largest value first: the usual value pays one comparison)
                if -65504.0 <= value <= 65504.0 or not math.isfinite(value):
                    return kind
                return None if abs(value) > _float_max() else kind
            return None if kind is int and value not in _INT64 else kind
    return None


def _float_max() -> float:
    """The largest finite value of the default float dtype, the dtype of a float's slot."""
    return torch.finfo(torch.get_default_dtype()).max


def parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """The parameters of ``fn`` as a call of it binds them (a module's ``forward``'s); None
    when its signature cannot be read."""
    # torch.compile's wrapper of a module declares (*args, **kwargs): read the module's own.
    fn = getattr(fn, "_orig_mod", fn)
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None


def _positions(fn: Callable[..., Any]) -> dict[str, int]:
    """The position of each parameter of ``fn`` that can be passed positionally (a module's
    ``forward``); empty when its signature cannot be read."""
    params = parameters(fn)
    if params is None:
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: i for i, p in enumerate(p for p in params if p.kind in positional)}


class ScalarSlots:
    """The top-level arguments named in a runner's ``as_tensor``: ints are positions, strings
    keyword names. A name is also found at its position when the wrapped callable (a module's
    ``forward``) declares it as a positional parameter, so ``as_tensor=("t",)`` covers both
    ``m(x, t)`` and ``m(x, t=t)``. Raises ``TypeError``/``ValueError`` on anything else."""

    def __init__(self, names: Iterable[int | str], fn: Callable[..., Any]) -> None:
        if isinstance(names, (str, int)):
            raise TypeError(
                f"as_tensor takes a collection of positions and names, e.g. as_tensor=('t', 2); "
                f"got {names!r}"
            )
        positions: set[int] = set()
        keywords: set[str] = set()
        declared = _positions(fn)
        for name in names:
            if isinstance(name, bool) or not isinstance(name, (int, str)):
                raise TypeError(
                    f"as_tensor entries are argument positions (int) or keyword names (str), "
                    f"got {name!r}"
                )
            if isinstance(name, int):
                if name < 0:
                    raise ValueError(f"as_tensor positions must be >= 0, got {name}")
                positions.add(name)
            else:
                keywords.add(name)
                if name in declared:
                    positions.add(declared[name])
        # Walk order of the signature: positions ascending, then keywords sorted by name.
        self._positions = tuple(sorted(positions))
        self._keywords = tuple(sorted(keywords))

    def __bool__(self) -> bool:
        return bool(self._positions or self._keywords)

    def lift(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], list[bool | int | float]]:
        """``(args, kwargs)`` with each number at a named slot replaced by its marker, and the
        numbers in signature walk order; the inputs are returned as they are when none is."""
        values: list[bool | int | float] = []
        new_args: list[Any] | None = None
        for pos in self._positions:
            if pos >= len(args):
                break
            kind = _number_kind(args[pos])
            if kind is not None:
                if new_args is None:
                    new_args = list(args)
                values.append(args[pos])
                new_args[pos] = _MARKERS[kind]
        new_kwargs: dict[str, Any] | None = None
        for name in self._keywords:
            if name not in kwargs:
                continue
            kind = _number_kind(kwargs[name])
            if kind is not None:
                if new_kwargs is None:
                    new_kwargs = dict(kwargs)
                values.append(kwargs[name])
                new_kwargs[name] = _MARKERS[kind]
        return (
            args if new_args is None else tuple(new_args),
            kwargs if new_kwargs is None else new_kwargs,
            values,
        )

    def place(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        values: list[bool | int | float],
        device: torch.device,
    ) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
        """Replace the markers :meth:`lift` left with new 0-dim tensors on ``device`` holding
        ``values`` (``torch.tensor(value)``'s dtype: bool, int64, the default float dtype);
        returns the call and the tensors, in the order of ``values``."""
        buffers: list[torch.Tensor] = []
        new_args = list(args)
        new_kwargs = dict(kwargs)
        found = iter(values)
        for pos in self._positions:
            if pos < len(args) and isinstance(args[pos], ScalarInput):
                new_args[pos] = torch.tensor(next(found), device=device)
                buffers.append(new_args[pos])
        for name in self._keywords:
            if isinstance(kwargs.get(name), ScalarInput):
                new_kwargs[name] = torch.tensor(next(found), device=device)
                buffers.append(new_kwargs[name])
        return tuple(new_args), new_kwargs, buffers
