"""Holes found by the eighth review (replay tokens, DiTRunner over diffusers transformers in
denoising loops), each pinned by a test that failed before its fix."""

from __future__ import annotations

import threading

import pytest

from bcg_diffusion import get_current_replay_token, replay_token_scope


def test_a_token_scope_entered_twice_nested_says_so_and_leaves_no_token() -> None:
    """Was contextvars' raw "Token has already been used once" at the outer exit, and the
    inner token stayed set after the block (eager code then saw a replay's token)."""
    scope = replay_token_scope()
    with scope as token:
        with pytest.raises(RuntimeError, match="entered already"), scope:
            pass
        assert get_current_replay_token() == token
    assert get_current_replay_token() is None
    with scope as again:  # entered once at a time, it can be reused
        assert get_current_replay_token() == again > token
    assert get_current_replay_token() is None


def test_a_token_scope_shared_by_two_threads_leaves_neither_a_token() -> None:
    """Was: the second thread's enter overwrote the first's reset token, the first thread's
    exit raised and its token stayed set for the rest of the thread."""
    scope = replay_token_scope()
    entered, second_done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def first() -> None:
        try:
            with scope:
                entered.set()
                second_done.wait(10)
        except Exception as exc:
            seen["first_error"] = exc
        seen["first_after"] = get_current_replay_token()

    def second() -> None:
        entered.wait(10)
        try:
            with scope:
                pass
        except RuntimeError as exc:
            seen["second_error"] = exc
        finally:
            second_done.set()
        seen["second_after"] = get_current_replay_token()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert "first_error" not in seen
    assert "entered already" in str(seen["second_error"])
    assert seen["first_after"] is None and seen["second_after"] is None
