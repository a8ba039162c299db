"""Running test scenarios on several threads (importable from every test folder: pytest puts
this folder, where the repository-wide conftest.py is, on the path)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(targets: list[Callable[[], None]], timeout: float) -> None:
    """Run each target in a thread of its own; re-raise the first error in the calling
    thread, and fail on a thread still alive ``timeout`` seconds after its join began (a
    hang fails the test, not the suite)."""
    errors: list[BaseException] = []

    def wrap(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # reported in the calling thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock)"
    if errors:
        raise errors[0]
