"""bcg's environment variables, read one way: ``BCG_DISABLE``, ``BCG_PROFILE``, ``BCG_DEBUG``.

Values are compared stripped and lower-cased; the words below are the only booleans accepted
(another value counts as off, with a warning once per value; ``BCG_DEBUG`` also takes
``warn`` and ``strict``).
Read at each call that needs them (never cached), so a variable set after import takes effect.
"""

from __future__ import annotations

import os
import warnings

from bcg_core._once import first_time

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})


# os.environ's own store (bytes keys on POSIX), kept in step by os.environ's setters: an unset
# variable is told in ~0.1 us instead of ~1.3 us through the Mapping methods, which matters
# for BCG_DISABLE, read at every runner call.
_POSIX_STORE: dict[bytes, bytes] | None = (
    getattr(os.environ, "_data", None) if os.name == "posix" else None
)


def env_word(name: str) -> str:
    """The variable's value stripped and lower-cased ("" when unset)."""
    if _POSIX_STORE is not None and name.encode() not in _POSIX_STORE:
        return ""
    return os.environ.get(name, "").strip().lower()


class EnvFlag:
    """A boolean variable: calling it says whether it is set to a true word (1, true, yes,
    on). Read at every call like every variable here; an unset one (the usual case, and
    ``BCG_DISABLE`` is read before every runner call) is told by one lookup of its key,
    encoded once, in os.environ's store."""

    __slots__ = ("_key", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._key = name.encode()

    def __call__(self) -> bool:
        if _POSIX_STORE is not None and self._key not in _POSIX_STORE:
            return False
        word = env_word(self.name)
        if word in TRUE_WORDS:
            return True
        if word not in FALSE_WORDS:
            warn_unknown(self.name, word)
        return False


def warn_unknown(name: str, word: str, on: str = "1 (or true, yes, on) to turn it on") -> None:
    """Say once per value that a variable holds a word bcg does not read (it counts as off):
    ``BCG_DISABLE=2`` silently left breakable graphs on. ``on`` says which values turn it on."""
    if not first_time(("env", name, word)):
        return
    warnings.warn(
        f"bcg: {name}={word!r} is not a value bcg reads, so it counts as off; set {name}={on}, "
        "or 0 (false, no, off, or unset it) for off",
        RuntimeWarning,
        stacklevel=3,
    )
