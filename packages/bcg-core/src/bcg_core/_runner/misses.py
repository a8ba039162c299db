"""The runner's log of calls it had no graph for: bounded, each line saying why."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from bcg_core._signature import Signature, describe_difference

logger = logging.getLogger("bcg_core")

MISS_LOG_LIMIT = 8
"""Distinct missed signatures a runner logs; later misses are only counted in its stats."""


class MissLog:
    """Logs the first :data:`MISS_LOG_LIMIT` distinct missed signatures of one runner, each
    with why it missed (its capture failed earlier, or the fields that differ from the nearest
    captured signature), then one line saying that further misses are not logged. It holds
    at most ``MISS_LOG_LIMIT + 1`` signatures: a serving loop missing every call (a Python
    number left in the signature) keeps neither its log nor its memory growing."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._logged: set[Signature] = set()
        self._refusals: set[str] = set()

    def __len__(self) -> int:
        return len(self._logged)

    def note(
        self, sig: Signature, blocked: dict[Signature, str], captured: Iterable[Signature]
    ) -> None:
        """Log the miss of ``sig`` unless it was logged already or the limit is reached."""
        logged = self._logged
        if sig in logged or len(logged) > MISS_LOG_LIMIT:
            return
        logged.add(sig)
        if len(logged) > MISS_LOG_LIMIT:
            logger.warning(
                "bcg: %s: further misses are not logged; stats.misses counts them", self._owner
            )
            return
        if sig in blocked:
            why = f"its capture failed earlier ({blocked[sig]})"
        else:
            why = describe_difference(sig, list(captured))
        logger.warning(
            "bcg: %s has no graph for this call and runs it eagerly (captures happen only in "
            "capture() or a warmup() window): %s",
            self._owner,
            why,
        )

    def refused(self, reason: str, message: str) -> None:
        """Log, once per ``reason``, a call the runner runs eagerly although it has (or may
        capture) a graph for its signature."""
        if reason not in self._refusals:
            self._refusals.add(reason)
            logger.warning("bcg: %s: %s", self._owner, message)

    def clear(self) -> None:
        """Forget the logged signatures and refusals (a reset runner logs them anew)."""
        self._logged.clear()
        self._refusals.clear()
