"""The contract of a background service: what a worker runs beside its claim loop.

Retention, the LISTEN listener and the schedule ticker are services; a
feature adds one by writing a class with a ``name``, a ``run`` and an
``interrupt``.  The worker's service runner starts each in a thread of its
own, restarts one that raises, and stops them all with the worker.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class Service(Protocol):
    """A loop that runs beside a worker's claim loop until told to stop.

    What the runner guarantees a service: ``run`` is called in a thread of
    the service's own (named ``sa_taskqueue-<name>``), never twice at once;
    ``stopping`` is set when the worker stops, and then ``interrupt`` is
    called once, from another thread.  If ``run`` raises, the error is
    logged and emitted as a SERVICE_ERROR event, and ``run`` is called again
    after a backoff (doubling from half a second up to 30 seconds) unless
    the worker is stopping: a failing service never stops the worker.

    What a service guarantees the runner: ``run`` returns soon after
    ``stopping`` is set (waiting on it, not sleeping); a return before then
    means the service has nothing more to do, and it is not called again.
    """

    #: A short name for logs, events and its thread: "retention", "listen", "schedules".
    name: str

    def run(self, stopping: threading.Event) -> None:
        """Do the service's work until ``stopping`` is set."""

    def interrupt(self) -> None:
        """End a wait that would not see ``stopping`` at once (a socket's); may do nothing."""


__all__ = ["Service"]
