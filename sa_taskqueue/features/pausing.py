"""Paused queues: stored in the control table, honoured by every claim.

A pause is a row ``("queue", <queue>)`` of the control table with
``paused_at`` set; a resume clears it.  Both commit at once in a short
transaction of their own, and on PostgreSQL send a notification on the
table's control channel (`sa_taskqueue.core.notify.control_channel_name`) at
commit, so that listening workers re-read the paused queues at once rather
than at their next poll.

Workers do not read the control table on every claim: each queue object
keeps the set it read last (`PausedQueues`).  A worker keeps it fresh off
the claim path, with a `PauseWatch` service that reads it once a second and
at once when a notification says it changed, so that no claim waits for
that read; a queue object claimed from without a worker reads it before a
claim when it is older than a second.  A claim then leaves the paused
queues out, in the SQL only when there are any: with no queue paused the
claim's statement is the one it always was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import Engine, Table, func, select, update

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core import control, validation
from sa_taskqueue.core.control_rows import ensure_row
from sa_taskqueue.core.exceptions import DatabaseUnavailable
from sa_taskqueue.core.notify import control_channel_name
from sa_taskqueue.features.ports import QueueContext

logger = logging.getLogger("sa_taskqueue")

#: How old the kept set of paused queues may be before a claim reads it again
#: (seconds); a worker's `PauseWatch` reads it this often, off the claim path.
DEFAULT_MAX_AGE = 1.0
#: While a watch keeps the set fresh, how many of its intervals a claim trusts
#: the kept set before it reads the set itself (the watch is stuck: an outage).
WATCH_GRACE = 5.0


def set_paused(engine: Engine, task_table: Table, queue: str, paused: bool, now: datetime) -> None:
    """Pause (``paused``) or resume ``queue`` and commit; doing it twice is the same as once.

    A pause keeps the time of the first one: pausing a paused queue changes
    nothing.  Safe when several processes pause or resume at once: the row
    is created race-free first (`ensure_row`), then one UPDATE sets it.
    """
    table = control.control_table_of(task_table)
    if paused:
        ensure_row(engine, table, control.QUEUE, queue, now)
    # (A resume of a queue never paused finds no row, and has nothing to do.)
    value = func.coalesce(table.c.paused_at, now) if paused else None
    with engine.begin() as conn:
        conn.execute(
            update(table)
            .where(table.c.kind == control.QUEUE, table.c.name == queue)
            .values(paused_at=value, updated_at=now)
        )
        if backend_for(engine.dialect).notify:
            # Transactional like the UPDATE: listeners hear of it at commit.
            conn.execute(select(func.pg_notify(control_channel_name(task_table), queue)))


def read_paused(engine: Engine, task_table: Table) -> frozenset[str]:
    """The queues paused now: a read of the control table's primary key range for queues."""
    table = control.control_table_of(task_table)
    with engine.connect() as conn:
        return frozenset(
            conn.scalars(
                select(table.c.name).where(table.c.kind == control.QUEUE, table.c.paused_at.is_not(None))
            )
        )


class PausedQueues:
    """The paused queues a queue object read last, read again when too old or when told they changed.

    Where a `PauseWatch` keeps it fresh (a worker's), a claim takes the kept
    set as it is, unless the watch has fallen behind by `WATCH_GRACE`
    intervals; elsewhere a claim reads it again once it is older than
    ``max_age``.  After a notification that it changed, the next claim reads
    it either way.
    """

    def __init__(
        self, max_age: float = DEFAULT_MAX_AGE, read: Callable[[], frozenset[str]] | None = None
    ) -> None:
        self.max_age = max_age
        #: How the set is read (`QueuePauses` gives its own read); what `refresh` calls.
        self.read = read
        self._paused: frozenset[str] = frozenset()
        self._read_at: float | None = None  # monotonic; None: read before the next claim
        self._invalidated_at = 0.0  # monotonic: when a notification last said the state changed
        self._watches = 0  # `PauseWatch` services keeping the set fresh now
        self._lock = threading.Lock()
        #: Set when the state changed: a watch reads again at once rather than at its next interval.
        self.changed = threading.Event()

    def current(self, read: Callable[[], frozenset[str]]) -> frozenset[str]:
        """The paused queues, from ``read()`` if what is kept is older than ``max_age`` (or stale)."""
        with self._lock:
            read_at = self._read_at
            if read_at is not None:
                trusted = self.max_age * WATCH_GRACE if self._watches else self.max_age
                if time.monotonic() - read_at < trusted:
                    return self._paused
        started = time.monotonic()
        paused = read()
        self.store(paused, started)
        return paused

    @property
    def queues(self) -> frozenset[str]:
        """The paused queues as kept now, without reading them."""
        with self._lock:
            return self._paused

    def refresh(self) -> frozenset[str]:
        """Read the set now (with `read`) and keep it: what a watch does once each interval."""
        if self.read is None:
            raise RuntimeError("this set of paused queues has no read to refresh it with")
        started = time.monotonic()
        paused = self.read()
        self.store(paused, started)
        return paused

    def store(self, paused: frozenset[str], read_at: float | None = None) -> None:
        """Keep ``paused``, read at ``read_at`` (monotonic; now if omitted)."""
        with self._lock:
            stamp = time.monotonic() if read_at is None else read_at
            # A change announced after our read started leaves the set stale.
            if read_at is not None and self._invalidated_at > read_at:
                return
            self._paused = paused
            self._read_at = stamp

    def invalidate(self) -> None:
        """The pause state changed (a notification said so): read it again before the next claim."""
        with self._lock:
            self._read_at = None
            self._invalidated_at = time.monotonic()
        self.changed.set()

    def watched(self, watching: bool) -> None:
        """A watch starts (``watching``) or stops keeping this set fresh."""
        with self._lock:
            self._watches += 1 if watching else -1


class PauseWatch:
    """A worker's service that keeps its queue's paused queues fresh, so that claims never read them.

    It reads the set once every ``max_age`` (a second by default), and at
    once when told it changed (a notification on PostgreSQL, or a pause or
    resume through the same queue object): one short read a second per
    worker, however fast it claims, where a read before a claim would cost
    that claim a round trip.  A read that fails keeps the set as it was; a
    claim reads it itself once the watch is `WATCH_GRACE` intervals behind.
    """

    name = "pauses"

    def __init__(self, paused: PausedQueues) -> None:
        self.paused = paused

    def run(self, stopping: threading.Event) -> None:
        paused = self.paused
        paused.watched(True)
        try:
            while not stopping.is_set():
                paused.changed.clear()
                try:
                    paused.refresh()
                except DatabaseUnavailable as error:  # (a claim reads the set itself if this goes on)
                    logger.debug("reading the paused queues failed (%s): kept as they were", error)
                # Woken early by a change, or by a stop (`interrupt`).
                paused.changed.wait(paused.max_age)
        finally:
            paused.watched(False)

    def interrupt(self) -> None:
        self.paused.changed.set()


class QueuePauses:
    """Pausing for one queue: written to the control table at once, read by claims through a kept copy."""

    def __init__(self, context: QueueContext) -> None:
        self._context = context
        #: The paused queues as last read: what claims leave out.
        self.kept = PausedQueues(read=self._read)

    def set(self, name: str, *, paused: bool) -> None:
        """Pause or resume queue ``name`` for every worker of the table; committed before this returns."""
        context = self._context
        validation.check_queue_name(name, context.limits)
        now = context.clock()
        with context.database_errors():
            context.call(lambda: set_paused(context.engine, context.table, name, paused, now))
        self.kept.invalidate()

    def read(self) -> list[str]:
        """The queues paused now, read from the database (and kept for the next claims)."""
        started = time.monotonic()
        paused = self._read()
        self.kept.store(paused, started)  # (unless a change was announced meanwhile)
        return sorted(paused)

    def current(self) -> frozenset[str]:
        """The paused queues as kept, read again when older than their maximum age."""
        return self.kept.current(self._read)

    def narrow(
        self, queues: tuple[str, ...] | None
    ) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None] | None:
        """What a claim of ``queues`` (None: every queue) asks for with the pauses applied.

        The queues left to claim from, and the paused ones to leave out when
        every queue was asked for; None when every queue asked for is
        paused, so that the claim sends no query at all.
        """
        paused = self.current()
        if not paused:
            return queues, None
        if queues is None:
            return None, tuple(sorted(paused))
        left = tuple(name for name in queues if name not in paused)
        return (left, None) if left else None

    def _read(self) -> frozenset[str]:
        context = self._context
        with context.database_errors():
            return context.call(lambda: read_paused(context.engine, context.table))


__all__ = [
    "DEFAULT_MAX_AGE",
    "WATCH_GRACE",
    "PauseWatch",
    "PausedQueues",
    "QueuePauses",
    "read_paused",
    "set_paused",
]
