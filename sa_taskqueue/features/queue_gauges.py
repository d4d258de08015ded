"""What metrics read from the tables: queue depth, the oldest due task's age, the live workers.

Counters and histograms come from the event stream, in the process where
each fact happens; these gauges are facts about the whole table, so they
are read from it.  One grouped count of the active rows (queued and
running, found through the claim and lease indexes) gives every queue's
depth by status and its oldest due task; one count of the live-worker table
(``<task table>_workers``, rows whose ``expires_at`` is ahead) gives the
workers alive.  Finished rows are not counted: they are history, as many as
retention keeps, and the finished-task counters say how many there were.

N workers each serving metrics must not all scan the table, so a reading
is taken by one process at a time: it holds a lease, the row ``("metrics",
<task table>)`` of the control table, taken and renewed by a conditional
UPDATE as retention's is.  The other processes report no table gauges (a
dashboard takes ``max`` over its targets); when the holder stops, its
lease runs out and another process takes the reading over.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from sqlalchemy import Engine, Table, case, func, select
from sqlalchemy.exc import SQLAlchemyError

from sa_taskqueue.core import control, control_rows
from sa_taskqueue.core.control_rows import ensure_row
from sa_taskqueue.core.error_text import error_message
from sa_taskqueue.core.exceptions import TaskQueueError
from sa_taskqueue.core.model import TaskStatus
from sa_taskqueue.core.worker_table import worker_table_of

T = TypeVar("T")

logger = logging.getLogger("sa_taskqueue")

#: The statuses whose rows a reading counts: what is waiting and what is running.
COUNTED_STATUSES = (TaskStatus.QUEUED, TaskStatus.RUNNING)
#: How often a process reads the tables at most; a scrape in between is given the last reading.
DEFAULT_INTERVAL = timedelta(seconds=15)

#: ``"lease"``: read only while this process holds the metrics lease (a worker);
#: ``"always"``: read whenever asked (one process serving the whole table, such as a dashboard);
#: ``"never"``: no table gauges at all.
GaugeMode = Literal["lease", "always", "never"]
GAUGE_MODES: tuple[GaugeMode, ...] = ("lease", "always", "never")


@dataclass(frozen=True)
class QueueGauges:
    """One reading of the tables, at ``at``."""

    at: datetime
    #: Tasks by ``(queue, status)``, for the `COUNTED_STATUSES`.
    depth: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Seconds since the oldest due queued task of each queue that has one became due.
    oldest_due_age: dict[str, float] = field(default_factory=dict)
    #: Workers whose registry row has not expired; None when the live-worker table cannot be read.
    live_workers: int | None = None


def read_gauges(engine: Engine, table: Table, now: datetime) -> QueueGauges:
    """Read the table's gauges: one grouped count of the active rows, one count of the live workers."""
    due_run_at = case((table.c.run_at <= now, table.c.run_at), else_=None)
    statuses = [status.value for status in COUNTED_STATUSES]
    grouped = (
        select(table.c.queue, table.c.status, func.count(), func.min(due_run_at))
        .where(table.c.status.in_(statuses))
        .group_by(table.c.queue, table.c.status)
    )
    workers = worker_table_of(table)
    live = select(func.count()).select_from(workers).where(workers.c.expires_at > now)
    depth: dict[tuple[str, str], int] = {}
    oldest: dict[str, float] = {}
    with engine.connect() as conn:
        for queue, status, count, oldest_due in conn.execute(grouped):
            depth[(queue, status)] = int(count)
            if status == TaskStatus.QUEUED and oldest_due is not None:
                oldest[queue] = max(0.0, (now - _aware(oldest_due, now)).total_seconds())
        try:
            live_workers: int | None = int(conn.scalar(live) or 0)
        except SQLAlchemyError:
            # A table not migrated to the live-worker registry: the other gauges still count.
            conn.rollback()
            live_workers = None
    return QueueGauges(now, depth, oldest, live_workers)


def _aware(moment: datetime, like: datetime) -> datetime:
    """``moment`` as an aware datetime (a ``min()`` over a column may lose its type's processing)."""
    if isinstance(moment, str):  # (SQLite returns an aggregate of a datetime column as its text)
        moment = datetime.fromisoformat(moment)
    if moment.tzinfo is None:
        return moment.replace(tzinfo=like.tzinfo)
    return moment


def take_lease(engine: Engine, task_table: Table, holder: str, now: datetime, hold: timedelta) -> bool:
    """Take or renew the metrics lease of ``task_table`` for ``holder`` until ``now + hold``: True if held."""
    table = control.control_table_of(task_table)
    ensure_row(engine, table, control.METRICS, task_table.name, now)
    return control_rows.take_lease(engine, table, control.METRICS, task_table.name, holder, now, hold)


def release_lease(engine: Engine, task_table: Table, holder: str, now: datetime) -> None:
    """Give the metrics lease up if ``holder`` holds it, so that another process takes the reading over."""
    table = control.control_table_of(task_table)
    control_rows.release_lease(engine, table, control.METRICS, task_table.name, holder, now)


class GaugeReader:
    """Readings of one queue's tables for a metrics exporter: at most one per ``interval``, under the lease.

    ``read()`` is called at each scrape or collection; it returns the last
    reading while it is fresh, else takes a new one if this process may
    (``mode``), else None.  ``call`` runs a function where the engine may be
    used (the queue's ``run_sync``, for an async engine).  A database error
    is logged and the reading is None: the scrape still answers with the
    counters and histograms, which need no database.
    """

    def __init__(
        self,
        engine: Engine,
        table: Table,
        clock: Callable[[], datetime],
        *,
        call: Callable[[Callable[[], Any]], Any] | None = None,
        mode: GaugeMode = "lease",
        interval: timedelta = DEFAULT_INTERVAL,
    ) -> None:
        if mode not in GAUGE_MODES:
            raise ValueError(f"gauges must be one of {', '.join(map(repr, GAUGE_MODES))}, got {mode!r}")
        if not isinstance(interval, timedelta) or interval <= timedelta(0):
            raise ValueError(f"gauge_interval must be a positive timedelta, got {interval!r}")
        self.engine = engine
        self.table = table
        self.clock = clock
        self.mode = mode
        self.interval = interval
        self._call: Callable[[Callable[[], Any]], Any] = call or (lambda fn: fn())
        #: The lease's holder name: this reader's own, so two readers of one process never share it.
        self.holder = f"metrics:{secrets.token_hex(8)}"
        self._lock = threading.Lock()
        self._last: QueueGauges | None = None
        self._held = False

    def read(self) -> QueueGauges | None:
        """The current reading, taken now if the last is older than the interval; None if not ours to take."""
        if self.mode == "never":
            return None
        try:
            return self._read()
        except (SQLAlchemyError, TaskQueueError) as error:
            logger.warning("queue gauges not read: %s", error_message(error))
            return None

    def _read(self) -> QueueGauges | None:
        with self._lock:
            now = self.clock()
            last = self._last
            if last is not None and now - last.at < self.interval:
                return last
            self._last = None
            if self.mode == "lease":
                # Held for three intervals: a holder scraped at every interval keeps it, a gone one drops it.
                self._held = self._in_engine(
                    lambda: take_lease(self.engine, self.table, self.holder, now, self.interval * 3)
                )
                if not self._held:
                    return None
            self._last = self._in_engine(lambda: read_gauges(self.engine, self.table, now))
            return self._last

    def close(self) -> None:
        """Let the lease go, if held, so that another process reads the gauges from its next scrape."""
        with self._lock:
            if self._held:
                self._held = False
                self._in_engine(lambda: release_lease(self.engine, self.table, self.holder, self.clock()))

    def _in_engine(self, fn: Callable[[], T]) -> T:
        result: T = self._call(fn)
        return result


__all__ = [
    "COUNTED_STATUSES",
    "DEFAULT_INTERVAL",
    "GAUGE_MODES",
    "GaugeMode",
    "GaugeReader",
    "QueueGauges",
    "read_gauges",
    "release_lease",
    "take_lease",
]
