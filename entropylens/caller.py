"""The user's line for a warning: the first stack frame outside the entropylens package."""

from __future__ import annotations

import os
import sys
from types import FrameType

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def caller_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside entropylens (a warning then names the user's line,
    whichever recorder method led to it)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level - 1 if frame is None else level
