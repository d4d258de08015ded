"""Retention: finished tasks older than an age per status are deleted by the workers.

``TaskQueue(retention={"completed": timedelta(days=1)})`` says how long a
finished task of each status is kept after its ``finished_at``.  Workers
delete what is older in a thread of their own, beside the claim loop, every
retention interval (by default a tenth of the shortest age, between one
second and a minute).  One worker at a time: it holds a lease, the row
``("retention", <task table>)`` of the control table, taken and renewed by a
conditional UPDATE; a worker that dies holding it leaves it to run out.

A worker deletes in the queues it serves, and only there: one task table
may hold the queues of several applications, each with retention of its
own (or none), and a worker's settings are its application's.  A worker
serving every queue deletes in every queue of the table.

Each batch is one DELETE of at most ``batch_size`` rows (500 by default),
committed on its own, found through the index ``ix_<table>_finished``
(status, finished_at): no long transaction, no lock held across batches,
and claims, which read only queued rows, never wait for it for long.

A pass that deleted tasks then deletes the dependency edges
(``<task table>_dependencies``) whose child is gone: an edge matters while
its child waits, and for the parent results the child may read, never once
the child itself is deleted.  One DELETE, walking the edges (as many as the
tasks that have parents still in the table), each checked by primary key.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from threading import Event
from typing import Any

from sqlalchemy import ColumnElement, Delete, Engine, Table, bindparam, delete, exists, select
from sqlalchemy.engine import Dialect

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core import control, control_rows, validation
from sa_taskqueue.core.control_rows import ensure_row
from sa_taskqueue.core.dependency_table import dependency_table_of
from sa_taskqueue.core.exceptions import DatabaseUnavailable
from sa_taskqueue.core.model import FINISHED_STATUSES, TaskStatus, has_status
from sa_taskqueue.features.ports import QueueContext

logger = logging.getLogger("sa_taskqueue")

#: Rows per DELETE: small enough to hold its locks for milliseconds.
DEFAULT_BATCH_SIZE = 500
#: How long the lease holds unrenewed; the holder renews it before each batch.
LEASE = timedelta(minutes=1)
#: Bounds of the default interval between two runs of a worker.
MIN_INTERVAL = timedelta(seconds=1)
MAX_INTERVAL = timedelta(minutes=1)

CUTOFF = "retention_cutoff"

Ages = dict[TaskStatus, timedelta]


def check_retention(retention: Any) -> Ages:
    """``retention`` as finished status -> age, or a clear error naming what is wrong."""
    if not isinstance(retention, Mapping):
        raise TypeError(f"retention must be a mapping of finished statuses to timedeltas, got {retention!r}")
    known = {status.value: status for status in FINISHED_STATUSES}
    ages: Ages = {}
    for key, age in retention.items():
        status = known.get(key.value if isinstance(key, TaskStatus) else key)
        if status is None:
            raise ValueError(
                f"retention keys must be finished statuses ({', '.join(sorted(known))}), got {key!r}"
            )
        if not isinstance(age, timedelta):
            raise TypeError(f"retention[{status.value!r}] must be a timedelta, got {age!r}")
        if age <= timedelta(0):
            raise ValueError(f"retention[{status.value!r}] must be a positive timedelta, got {age!r}")
        ages[status] = age
    return ages


def default_interval(ages: Ages) -> timedelta:
    """A tenth of the shortest age (rows then outlive their age by a tenth at most), within bounds."""
    return max(MIN_INTERVAL, min(MAX_INTERVAL, min(ages.values()) / 10))


def check_queues(queues: Any) -> list[str] | None:
    """``queues`` as a list of queue names (None: every queue), or a clear error."""
    if queues is None:
        return None
    if isinstance(queues, str) or not isinstance(queues, Sequence):
        raise TypeError(f"queues must be a sequence of queue names, not {queues!r}")
    names = list(queues)
    for name in names:
        validation.check_queue_name(name)
    if not names:
        raise ValueError("queues must name at least one queue (None: every queue)")
    return names


def check_interval(interval: Any) -> timedelta:
    if not isinstance(interval, timedelta) or interval <= timedelta(0):
        raise ValueError(f"retention_interval must be a positive timedelta, got {interval!r}")
    return interval


def batch_delete(
    dialect: Dialect, table: Table, status: TaskStatus, batch_size: int, queues: Sequence[str] | None = None
) -> Delete:
    """One batch: at most ``batch_size`` rows of ``status`` finished before the bound cutoff.

    Only rows of ``queues``, when given (None: every queue).
    """
    old: tuple[ColumnElement[bool], ...] = (
        has_status(table, status),  # a literal, so that the partial index serves it
        table.c.finished_at < bindparam(CUTOFF, type_=table.c.finished_at.type),
    )
    if queues is not None:
        # Read from the rows the index finds: the queue is not in it.
        old = (*old, table.c.queue.in_(list(queues)))
    if backend_for(dialect).delete_with_limit:
        # MySQL, MariaDB: DELETE ... LIMIT n (the IN subquery may not be limited).
        return backend_for(dialect).limit_delete(delete(table).where(*old), batch_size)
    # PostgreSQL, SQLite: LIMIT n in the subquery; Oracle: FETCH FIRST n ROWS ONLY.  The
    # conditions stand in the outer WHERE too: a row the subquery picked that
    # another transaction changes meanwhile (a retry puts it back in the queue)
    # is tested again as it is once that commits, and kept.
    return delete(table).where(*old, table.c.id.in_(select(table.c.id).where(*old).limit(batch_size)))


def orphan_edges_delete(table: Table) -> Delete:
    """The DELETE of the dependency edges of ``table`` whose child task no longer exists.

    An edge and its child are written in one transaction, so an edge whose
    child is not there (as this statement's snapshot sees it) is one whose
    child was deleted, never one whose child is still being enqueued.
    """
    edges = dependency_table_of(table)
    return delete(edges).where(~exists().where(table.c.id == edges.c.child_id))


def take_lease(engine: Engine, task_table: Table, holder: str, now: datetime, *, create: bool = True) -> bool:
    """Take or renew the retention lease of ``task_table`` for ``holder`` until ``now + LEASE``.

    True if ``holder`` holds it now: it was free, had run out, or was
    already ``holder``'s.  Two processes asking at once cannot both get it:
    the UPDATE's condition is checked against the row as it is at the write.
    ``create=False`` (a renewal) skips making sure the row exists.
    """
    table = control.control_table_of(task_table)
    if create:
        ensure_row(engine, table, control.RETENTION, task_table.name, now)
    return control_rows.take_lease(engine, table, control.RETENTION, task_table.name, holder, now, LEASE)


def release_lease(engine: Engine, task_table: Table, holder: str, now: datetime) -> None:
    """Give the lease up if ``holder`` still holds it, so that another worker may take it at once."""
    table = control.control_table_of(task_table)
    control_rows.release_lease(engine, table, control.RETENTION, task_table.name, holder, now)


def delete_expired(
    engine: Engine,
    table: Table,
    ages: Ages,
    *,
    holder: str,
    clock: Callable[[], datetime],
    batch_size: int = DEFAULT_BATCH_SIZE,
    stop: Event | None = None,
    on_batch: Callable[[int], None] | None = None,
    queues: Sequence[str] | None = None,
) -> int:
    """Delete the rows older than their status's age, batch after batch, under the lease; how many.

    Only rows of ``queues``, when given (None: every queue of ``table``).
    0 at once when another holder has the lease.  Stops when nothing old is
    left, when the lease is lost, or when ``stop`` is set; the lease is
    given up at the end.  ``on_batch`` is told each batch's count.
    """
    if not ages or not take_lease(engine, table, holder, clock()):
        return 0
    deleted = 0
    try:
        for status, age in ages.items():
            statement = batch_delete(engine.dialect, table, status, batch_size, queues)
            while stop is None or not stop.is_set():
                now = clock()
                if not take_lease(engine, table, holder, now, create=False):
                    return deleted  # it ran out meanwhile and someone else took it
                with engine.begin() as conn:
                    count = conn.execute(statement, {CUTOFF: now - age}).rowcount
                deleted += count
                if on_batch is not None:
                    on_batch(count)
                if count < batch_size:
                    break
        if deleted:
            with engine.begin() as conn:
                conn.execute(orphan_edges_delete(table))
    finally:
        release_lease(engine, table, holder, clock())
    return deleted


class Retention:
    """How long one queue keeps its finished tasks, and the batched deletion its workers run.

    ``ages`` is empty when nothing expires; ``interval`` is how often a
    worker deletes (by default a tenth of the shortest age), None then.
    """

    def __init__(
        self,
        context: QueueContext,
        ages: Mapping[str | TaskStatus, timedelta] | None,
        interval: timedelta | None,
    ) -> None:
        self._context = context
        self.ages = check_retention({} if ages is None else ages)
        self.interval: timedelta | None = None
        if interval is not None:
            self.interval = check_interval(interval)
        elif self.ages:
            self.interval = default_interval(self.ages)

    def delete_expired(
        self, *, batch_size: int, holder: str | None, stop: Event | None, queues: Sequence[str] | None = None
    ) -> int:
        """`delete_expired` of this queue's table (of ``queues`` in it, if given), under a lease
        held in a name of this run's own."""
        validation.check_positive_int("batch_size", batch_size)
        only = check_queues(queues)
        if not self.ages:
            return 0
        context = self._context
        # Each run holds the lease under a name of its own: two workers of one
        # process (or a worker and a direct call) share a worker id, and a
        # lease its holder may renew would let both delete at once.
        who = f"{(holder or context.default_worker_id())[:240]}:{secrets.token_hex(4)}"
        with context.database_errors():
            return context.call(
                lambda: delete_expired(
                    context.engine,
                    context.table,
                    self.ages,
                    holder=who,
                    clock=context.clock,
                    batch_size=batch_size,
                    stop=stop,
                    queues=only,
                )
            )


class RetentionService:
    """A worker's retention `Service`: deletes expired finished tasks every interval, beside the claim loop.

    ``delete_expired`` is the queue's (`TaskQueue.delete_expired`), run under
    ``holder`` on the worker's ``queues`` (None: every queue); it stops with
    the claims (``stop_claiming``), not with the last writes, so a shutdown
    deletes nothing more.  ``unavailable`` is told
    of an outage (the worker says so once), any other error is logged and
    tried again at the next interval.
    """

    name = "retention"

    def __init__(
        self,
        delete_expired: Callable[..., int],
        interval: timedelta,
        holder: str,
        stop_claiming: Event,
        unavailable: Callable[[DatabaseUnavailable, float, str], None],
        queues: Sequence[str] | None = None,
    ) -> None:
        self._delete_expired = delete_expired
        self._queues = None if queues is None else list(queues)
        self._interval = interval
        self._holder = holder
        self._stop = stop_claiming
        self._unavailable = unavailable

    def run(self, stopping: Event) -> None:
        interval = self._interval.total_seconds()
        stop = self._stop
        while not stop.is_set() and not stopping.is_set():
            try:
                deleted = self._delete_expired(holder=self._holder, stop=stop, queues=self._queues)
            except DatabaseUnavailable as error:
                self._unavailable(error, interval, self.name)
            except Exception:
                logger.exception("deleting expired tasks failed; trying again in %s", self._interval)
            else:
                if deleted:
                    logger.info("deleted %d expired task(s)", deleted)
            stop.wait(interval)

    def interrupt(self) -> None:
        """Nothing to interrupt: its waits watch the stop."""


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "LEASE",
    "Retention",
    "RetentionService",
    "batch_delete",
    "check_interval",
    "check_queues",
    "check_retention",
    "default_interval",
    "delete_expired",
    "release_lease",
    "take_lease",
]
