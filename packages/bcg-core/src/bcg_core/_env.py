"""bcg's environment variables, read one way: ``BCG_DISABLE``, ``BCG_PROFILE``, ``BCG_DEBUG``.

Values are compared stripped and lower-cased; the words below are the only booleans accepted.
Read at each call that needs them (never cached), so a variable set after import takes effect.
"""

from __future__ import annotations

import os

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})


def env_word(name: str) -> str:
    """The variable's value stripped and lower-cased ("" when unset)."""
    return os.environ.get(name, "").strip().lower()


def env_flag(name: str) -> bool:
    """True when the variable is set to a true word (1, true, yes, on)."""
    return env_word(name) in TRUE_WORDS
