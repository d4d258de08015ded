"""How a worker speaks of database outages: one clear line when the database goes, one when it is back."""

from __future__ import annotations

import logging
import threading
from typing import Any

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.events import EventKind
from sa_taskqueue.worker.lifecycle import Emitter

logger = logging.getLogger("sa_taskqueue")


class Outages:
    """Whether the database is down, as the worker's last statements found it; logs and emits the changes."""

    def __init__(self, dialect: Any, emit: Emitter) -> None:
        self._dialect = dialect
        self._emit = emit
        self._lock = threading.Lock()
        self.down = False

    def trouble(self, error: BaseException, retry_in: float, service: str = "claim") -> None:
        """One clear line when the database goes away; quiet while it stays away.

        A transaction the server rolled back to end a deadlock is contention
        between workers, not an outage: it is logged for what it is, and
        the database is not taken for gone.  Each trouble is a SERVICE_ERROR
        event of ``service``.
        """
        message = getattr(error, "orig", None) or error
        if self.certification_conflict(error):
            # Expected, and frequent, wherever workers on two nodes reach for
            # one row: the write is simply tried again.
            logger.debug(
                "another node's transaction on the same rows won at commit, trying again: %s", message
            )
            return
        if self._lost_lock_race(error):
            logger.info("lost a lock race with another connection, trying again: %s", str(message).strip())
            return
        with self._lock:
            first = not self.down
            self.down = True
        if first:
            logger.error("database unavailable, retrying every few seconds: %s", str(message).strip())
        else:
            logger.debug("database still unavailable (next try in %.1fs): %s", retry_in, message)
        self._emit.worker(EventKind.SERVICE_ERROR, service=service, error=error)

    def certification_conflict(self, error: BaseException) -> bool:
        """Whether a Galera cluster failed this statement's transaction for another node's on the same rows.

        Galera certifies at commit: of two nodes' transactions that wrote
        one row, the later fails, though each held its row lock on its own
        node.  Nothing is wrong with the database or the task.
        """
        driver_error = _driver_error(error)
        return driver_error is not None and backend_for(self._dialect).certification_conflict(driver_error)

    def _lost_lock_race(self, error: BaseException) -> bool:
        """Whether the server ended this statement's transaction as a deadlock's victim.

        (A lock wait that ran out is not: a lock held that long, by a
        migration or a stuck transaction, is trouble to be seen.)
        """
        driver_error = _driver_error(error)
        if driver_error is None:
            return False
        return backend_for(self._dialect).lost_lock_race(driver_error)

    def back(self) -> None:
        with self._lock:
            was_down = self.down
            self.down = False
        if was_down:
            logger.info("database is back")


def _driver_error(error: BaseException) -> BaseException | None:
    """The driver's error behind one of ours (its cause, or the cause's ``orig``)."""
    cause = error.__cause__
    found: BaseException | None = getattr(cause, "orig", None) or cause
    return found


__all__ = ["Outages"]
