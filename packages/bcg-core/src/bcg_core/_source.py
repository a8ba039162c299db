"""Where in the user's code something happened: the innermost frame outside torch and bcg."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

_SKIPPED_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    "<frozen ",
)


def user_location() -> str | None:
    """``file:line`` of the innermost frame outside torch and bcg_core, or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_DIRS):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None
