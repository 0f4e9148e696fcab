"""What the training thread hands the writer thread: one dataclass per kind of message, in queue order.

The writer thread dispatches on the message's type (WriterThread._loop); a hand-over is one
:class:`Batch` of them (the outbox of a step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..device.host_copy import DeferredBlock, HostCopy


@dataclass(frozen=True)
class Update:
    """An update's block on its way to the host: its aggregates, rows and histograms."""

    step: int
    update: int
    copy: HostCopy | DeferredBlock


@dataclass(frozen=True)
class Scalars:
    """Recorded scalars for a step row (``update``) or every row of a step (None). ``values``: name ->
    float, or (floats, names, HostCopy of device scalars [k] float64) with device scalars on their way."""

    step: int
    update: int | None
    values: dict[str, Any] | tuple


@dataclass(frozen=True)
class Rewards:
    step: int
    total: float
    count: int


@dataclass(frozen=True)
class Sequences:
    """One sequences file of a step (its ``part``)."""

    step: int
    part: int
    arrays: dict


@dataclass(frozen=True)
class Probes:
    step: int
    update: int
    rows: list


@dataclass(frozen=True)
class Close:
    """Write the token files, then the steps files, of every step <= upto (all when None)."""

    upto: int | None


@dataclass(frozen=True)
class Summary:
    """A question about a step's aggregates, answered through ``reply`` once every earlier message is handled."""

    step: int
    reply: Reply
    names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Heartbeat:
    """Rewrite run.json (and this rank's status file)."""


@dataclass(frozen=True)
class Batch:
    """One hand-over: the messages of an outbox, in order."""

    messages: list


STOP = object()  # the last message: the thread ends


class Reply:
    """A one-shot answer from the writer thread."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.value: Any = None

    def set(self, value: Any) -> None:
        self.value = value
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait_for(self, alive: Callable[[], bool], while_waiting: Callable[[], None], every: float) -> Any:
        """The value, once set (None if ``alive()`` turns false); ``while_waiting()`` every ``every`` s."""
        while not self._done.wait(every):
            if not alive():
                return None
            while_waiting()
        return self.value
