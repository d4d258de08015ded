"""Live workers: who is working, where, on what; and the due tasks no live worker serves.

Each worker keeps a row of its own in the live-worker table beside the task
table (`sa_taskqueue.core.worker_table`): written when it starts, with the
id it writes into ``locked_by`` of the tasks it claims, its host and pid,
the queues it claims from (``["*"]``: every queue), the task names it
registered, its concurrency and the sa_taskqueue version it runs.  Every
heartbeat moves ``heartbeat_at`` and ``expires_at`` on; a clean exit deletes
the row.  A worker that dies without deleting it (SIGKILL, a lost machine)
stops moving ``expires_at``, and every listing leaves it out once that has
passed: within `EXPIRES_AFTER_HEARTBEATS` heartbeats of its last one.  The
next worker to prune deletes rows expired more than `PRUNE_AFTER` ago.

The heartbeat is the worker's lease heartbeat (a third of the time before
its watchdog would act), at most `MAX_HEARTBEAT`: under the default
five-minute lease a dead worker drops out within a minute and a half.
Times come from the queue's clock, as its leases do: the workers and the
reader should agree on the time, as they must for leases anyway.

`unserved_tasks` answers "does anything wait in silence?": the due queued
tasks whose queue no live worker claims from, or whose name no live worker
claiming from that queue has registered.  Such a task waits for ever with
nothing said; the worker logs them at start and every
`UNSERVED_LOG_INTERVAL` while there are any, and ``sa-taskqueue status``
names them.

The SQL is small: one row per worker process, read whole; the running
tasks of the live workers in one read through the lease index; the due
queued tasks grouped by queue and name in one read.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from importlib import metadata as package_metadata
from typing import Any

from sqlalchemy import Connection, Engine, Table, delete, exc, func, insert, select, update

from sa_taskqueue.core.exceptions import DatabaseUnavailable, SchemaMissing, translate_database_errors
from sa_taskqueue.core.model import TaskStatus, has_status
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.core.worker_table import HOST_LENGTH, VERSION_LENGTH, worker_table_of
from sa_taskqueue.features.ports import QueueContext

logger = logging.getLogger("sa_taskqueue")

#: What a worker claiming from every queue stores as its queues, as its start line prints it.
EVERY_QUEUE = "*"
#: A worker counts as live until this many of its heartbeats have passed without one.
EXPIRES_AFTER_HEARTBEATS = 3
#: The longest interval between two heartbeats, whatever the lease (so a dead worker drops out soon).
MAX_HEARTBEAT = timedelta(seconds=30)
#: Rows expired longer ago than this are deleted by the next worker that prunes.
PRUNE_AFTER = timedelta(hours=1)
#: How often, at most, a worker logs the due tasks no live worker serves.
UNSERVED_LOG_INTERVAL = timedelta(minutes=5)
#: How many (queue, name) groups one log line or status line names before "and N more".
NAMED_AT_MOST = 10


@dataclass(frozen=True)
class RunningTask:
    """A task a live worker holds: RUNNING, ``locked_by`` the worker's id."""

    id: int
    name: str
    queue: str
    #: When the claim that holds it began.
    started_at: datetime | None
    #: When its lease ends unless the worker renews it.
    locked_until: datetime | None


@dataclass(frozen=True)
class LiveWorker:
    """A worker whose last heartbeat has not expired, and what it runs now.

    ``queues`` is ``["*"]`` for a worker claiming from every queue
    (`EVERY_QUEUE`); ``task_names`` are the names it registered, the only
    ones it claims.
    """

    id: str
    host: str
    pid: int
    queues: list[str]
    task_names: list[str]
    concurrency: int
    version: str
    started_at: datetime
    heartbeat_at: datetime
    expires_at: datetime
    running: list[RunningTask] = field(default_factory=list)

    def serves(self, queue: str, name: str) -> bool:
        """Whether it would claim a task ``name`` of ``queue``: it claims the queue and knows the name."""
        return (EVERY_QUEUE in self.queues or queue in self.queues) and name in self.task_names


@dataclass(frozen=True)
class UnservedTasks:
    """Due queued tasks of one queue and name that no live worker serves: they wait in silence."""

    queue: str
    name: str
    count: int
    #: How long the one due first has been due.
    oldest_age: timedelta


# The SQL -----------------------------------------------------------------------------


def package_version() -> str:
    """The sa_taskqueue version installed, as a worker registers it."""
    try:
        return package_metadata.version("sa_taskqueue")[:VERSION_LENGTH]
    except package_metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker registers about itself: everything in its row but the times."""

    id: str
    queues: list[str]
    task_names: list[str]
    concurrency: int
    host: str = field(default_factory=lambda: socket.gethostname()[:HOST_LENGTH])
    pid: int = field(default_factory=os.getpid)
    version: str = field(default_factory=package_version)

    @classmethod
    def of(
        cls, worker_id: str, queues: Sequence[str] | None, task_names: Sequence[str], concurrency: int
    ) -> WorkerRecord:
        """The record of a worker claiming ``queues`` (None: every queue) for ``task_names``."""
        return cls(
            id=worker_id,
            queues=[EVERY_QUEUE] if queues is None else sorted(set(queues)),
            task_names=sorted(set(task_names)),
            concurrency=concurrency,
        )


def heartbeat_worker(
    engine: Engine, task_table: Table, record: WorkerRecord, now: datetime, expires_at: datetime
) -> bool:
    """Move the worker's ``heartbeat_at`` to ``now`` and ``expires_at`` on; register it if its row is gone.

    True if the row was written anew (the first heartbeat of a run, or a
    row pruned while the worker could not reach the database).  Two workers
    of one process sharing an id share one row: the last to write it
    describes it.
    """
    table = worker_table_of(task_table)
    with _errors(engine, table), _written_by_a_twin(), engine.begin() as conn:
        # (MySQL and MariaDB count the rows matched, not changed: SQLAlchemy asks for FOUND_ROWS.)
        moved = conn.execute(
            update(table).where(table.c.id == record.id).values(heartbeat_at=now, expires_at=expires_at)
        ).rowcount
        if moved:
            return False
        _write_row(conn, table, record, now, expires_at)
        return True
    return False


def register_worker(
    engine: Engine, task_table: Table, record: WorkerRecord, now: datetime, expires_at: datetime
) -> None:
    """Write the worker's row as it starts (``started_at`` = ``now``), replacing one under its id."""
    table = worker_table_of(task_table)
    with _errors(engine, table), _written_by_a_twin(), engine.begin() as conn:
        conn.execute(delete(table).where(table.c.id == record.id))
        _write_row(conn, table, record, now, expires_at)


@contextmanager
def _written_by_a_twin() -> Iterator[None]:
    """Nothing to do when the worker's INSERT finds its id taken, as it does beside a twin.

    Two `Worker` objects of one process share the process's default id, so
    both may write the row at once: the one whose INSERT comes second finds
    the key taken by the other's.  The row the id needs is there (the last
    to write it describes it); the transaction has rolled back, and its next
    heartbeat moves the row on.
    """
    with suppress(exc.IntegrityError):
        yield


def _write_row(
    conn: Connection, table: Table, record: WorkerRecord, now: datetime, expires_at: datetime
) -> None:
    conn.execute(
        insert(table).values(
            id=record.id,
            host=record.host,
            pid=record.pid,
            queues=record.queues,
            task_names=record.task_names,
            concurrency=record.concurrency,
            version=record.version,
            started_at=now,
            heartbeat_at=now,
            expires_at=expires_at,
        )
    )


def deregister_worker(engine: Engine, task_table: Table, worker_id: str) -> None:
    """Delete the worker's row: it stopped, and drops out of every listing at once."""
    table = worker_table_of(task_table)
    with _errors(engine, table), engine.begin() as conn:
        conn.execute(delete(table).where(table.c.id == worker_id))


def prune_workers(
    engine: Engine, task_table: Table, *, now: datetime, older_than: timedelta = PRUNE_AFTER
) -> int:
    """Delete the rows of workers expired more than ``older_than`` before ``now``; how many.

    The rows are found by a plain read and deleted by their ids, the
    condition checked again: a DELETE scanning the table (it has no index
    but its key) would lock every row it reads on InnoDB, and hold up the
    heartbeats of the live workers meanwhile.
    """
    table = worker_table_of(task_table)
    cutoff = now - older_than
    with _errors(engine, table), engine.connect() as conn:
        ids = list(conn.scalars(select(table.c.id).where(table.c.expires_at < cutoff)))
        if not ids:
            return 0
        deleted = conn.execute(delete(table).where(table.c.id.in_(ids), table.c.expires_at < cutoff)).rowcount
        conn.commit()
        return int(deleted)


def list_live_workers(engine: Engine, task_table: Table, *, now: datetime | None = None) -> list[LiveWorker]:
    """The workers of ``task_table`` live at ``now`` (default: the current time), oldest first.

    Each with what it runs: the RUNNING rows whose ``locked_by`` is its id.
    Two reads: the live-worker table, then the running rows of those ids
    through the lease index.
    """
    moment = utcnow() if now is None else now
    table = worker_table_of(task_table)
    with _errors(engine, table), engine.connect() as conn:
        rows = conn.execute(
            select(table).where(table.c.expires_at > moment).order_by(table.c.started_at, table.c.id)
        ).all()
    if not rows:
        return []
    running = _running_by_worker(engine, task_table, [row.id for row in rows])
    return [
        LiveWorker(
            id=row.id,
            host=row.host,
            pid=row.pid,
            queues=_strings(row.queues),
            task_names=_strings(row.task_names),
            concurrency=row.concurrency,
            version=row.version,
            started_at=row.started_at,
            heartbeat_at=row.heartbeat_at,
            expires_at=row.expires_at,
            running=running.get(row.id, []),
        )
        for row in rows
    ]


def _running_by_worker(
    engine: Engine, task_table: Table, worker_ids: list[str]
) -> dict[str, list[RunningTask]]:
    t = task_table
    found: dict[str, list[RunningTask]] = {}
    with translate_database_errors(engine, t), engine.connect() as conn:
        rows = conn.execute(
            select(t.c.id, t.c.name, t.c.queue, t.c.started_at, t.c.locked_until, t.c.locked_by)
            .where(has_status(t, TaskStatus.RUNNING), t.c.locked_by.in_(worker_ids))
            .order_by(t.c.started_at, t.c.id)
        )
        for row in rows:
            found.setdefault(row.locked_by, []).append(
                RunningTask(
                    id=row.id,
                    name=row.name,
                    queue=row.queue,
                    started_at=row.started_at,
                    locked_until=row.locked_until,
                )
            )
    return found


def unserved_tasks(engine: Engine, task_table: Table, *, now: datetime | None = None) -> list[UnservedTasks]:
    """The due queued tasks no worker live at ``now`` serves, by queue and name, the longest waiting first.

    A worker serves a task when it claims from the task's queue and has
    registered its name.  Two reads: the due queued rows grouped by queue
    and name, and the live-worker table; the comparison is made here (a
    table holds few distinct names, and few workers).
    """
    moment = utcnow() if now is None else now
    t = task_table
    with translate_database_errors(engine, t), engine.connect() as conn:
        groups = conn.execute(
            select(t.c.queue, t.c.name, func.count(), func.min(t.c.run_at))
            .where(has_status(t, TaskStatus.QUEUED), t.c.run_at <= moment)
            .group_by(t.c.queue, t.c.name)
        ).all()
    if not groups:
        return []
    served = _served(engine, task_table, moment)
    found = [
        UnservedTasks(queue=queue, name=name, count=count, oldest_age=max(moment - oldest, timedelta(0)))
        for queue, name, count, oldest in groups
        if not served(queue, name)
    ]
    return sorted(found, key=lambda group: (-group.oldest_age, group.queue, group.name))


def _served(engine: Engine, task_table: Table, now: datetime) -> Callable[[str, str], bool]:
    """Whether some worker live at ``now`` serves a (queue, name): from one read of the live-worker table."""
    table = worker_table_of(task_table)
    with _errors(engine, table), engine.connect() as conn:
        rows = conn.execute(select(table.c.queues, table.c.task_names).where(table.c.expires_at > now)).all()
    every_queue: set[str] = set()  # names served on every queue
    by_queue: dict[str, set[str]] = {}
    for queues, names in rows:
        for queue in _strings(queues):
            target = every_queue if queue == EVERY_QUEUE else by_queue.setdefault(queue, set())
            target.update(_strings(names))
    return lambda queue, name: name in every_queue or name in by_queue.get(queue, ())


def _strings(value: Any) -> list[str]:
    """A JSON list of strings as stored; anything else (a row written by hand) as no strings."""
    return [str(item) for item in value] if isinstance(value, list) else []


@contextmanager
def _errors(engine: Engine, worker_table: Table) -> Iterator[None]:
    """The database's errors translated, a missing live-worker table named for what it is."""
    try:
        with translate_database_errors(engine, worker_table):
            yield
    except SchemaMissing as missing:
        raise SchemaMissing(
            f"the live-worker table {worker_table.name!r} does not exist: "
            "run `sa-taskqueue migrate` (or `alembic upgrade head`)"
        ) from missing.__cause__


# Words -------------------------------------------------------------------------------


def short_age(age: timedelta) -> str:
    """``12.0s``, ``3.5m``, ``2.0h``, ``4.1d``: how long, at a glance."""
    seconds = age.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(seconds, 0.0):.1f}s"


def describe_unserved(groups: Sequence[UnservedTasks]) -> str:
    """The groups in one line: ``app.hello on queue default (3 due, oldest 5.0m); ...``."""
    named = [
        f"{group.name} on queue {group.queue} ({group.count} due, oldest {short_age(group.oldest_age)})"
        for group in groups[:NAMED_AT_MOST]
    ]
    more = len(groups) - NAMED_AT_MOST
    if more > 0:
        named.append(f"and {more} more")
    return "; ".join(named)


def unserved_line(engine: Engine, task_table: Table, /, *, now: datetime | None = None) -> str:
    """``sa-taskqueue status``'s line on the due tasks no live worker serves, by queue and name."""
    try:
        groups = unserved_tasks(engine, task_table, now=now)
    except SchemaMissing as missing:
        # A database not migrated since the live-worker table came: the rest of status still holds.
        return f"no live worker serves: unknown ({missing})"
    if not groups:
        return "no live worker serves: none (a live worker serves every due task's queue and name)"
    return f"no live worker serves: {describe_unserved(groups)}"


# The queue's part and the worker's service ---------------------------------------------


def heartbeat_of(lease_heartbeat: float) -> timedelta:
    """A worker's live-worker heartbeat: its lease heartbeat (seconds), at most `MAX_HEARTBEAT`."""
    return min(timedelta(seconds=lease_heartbeat), MAX_HEARTBEAT)


class LiveWorkers:
    """Live workers for one queue: its listing (``queue.workers()``) and its workers' service."""

    def __init__(self, context: QueueContext) -> None:
        self._context = context

    def live(self) -> list[LiveWorker]:
        """The workers live now (by the queue's clock), with what each runs."""
        context = self._context
        now = context.clock()
        return context.call(lambda: list_live_workers(context.engine, context.table, now=now))

    def unserved(self) -> list[UnservedTasks]:
        """The due queued tasks no live worker serves now (by the queue's clock)."""
        context = self._context
        now = context.clock()
        return context.call(lambda: unserved_tasks(context.engine, context.table, now=now))

    def service(
        self,
        worker_id: str,
        *,
        queues: Sequence[str] | None,
        task_names: Sequence[str],
        concurrency: int,
        heartbeat: timedelta,
        unavailable: Callable[[DatabaseUnavailable, float, str], None] | None = None,
    ) -> LiveWorkerService:
        """The service a worker runs to be listed (`LiveWorkerService`), and to say what no worker serves."""
        return LiveWorkerService(
            self._context,
            WorkerRecord.of(worker_id, queues, task_names, concurrency),
            heartbeat,
            unavailable=unavailable,
        )


class UnservedWarnings:
    """When a worker logs the due tasks no live worker serves: at start, then at most every ``every``.

    It checks (one grouped read) only when a line may be logged, and logs
    only when there are any.  ``clock`` is the queue's: a test moves it.
    """

    def __init__(
        self,
        find: Callable[[datetime], list[UnservedTasks]],
        clock: Callable[[], datetime],
        every: timedelta = UNSERVED_LOG_INTERVAL,
    ) -> None:
        self._find = find
        self._clock = clock
        self._every = every
        self._checked_at: datetime | None = None

    def check(self) -> list[UnservedTasks]:
        """Look, and log, if the last look was ``every`` ago or more; what was found (empty if not looked)."""
        now = self._clock()
        if self._checked_at is not None and now - self._checked_at < self._every:
            return []
        found = self._find(now)  # (a failed look is tried again at the next heartbeat)
        self._checked_at = now
        if found:
            logger.warning(
                "due tasks no live worker serves (no worker claims their queue with their name "
                "registered; they wait until one does): %s",
                describe_unserved(found),
            )
        return found


class LiveWorkerService:
    """A worker's `Service` that keeps its row in the live-worker table, and says what no worker serves.

    It registers the worker as it starts (`begin`, before the worker's
    first claim, or else as it runs), heartbeats every ``heartbeat``
    (moving ``expires_at`` to `EXPIRES_AFTER_HEARTBEATS` heartbeats ahead),
    prunes rows long expired, and deletes its row when the worker stops.
    After each heartbeat it lets `UnservedWarnings` log the due tasks no
    live worker serves (itself counted).  An outage is told to
    ``unavailable`` (or logged) and tried again at the next heartbeat; a
    missing live-worker table (a schema not migrated) is said once, and
    the worker runs on unlisted.
    """

    name = "live-workers"

    def __init__(
        self,
        context: QueueContext,
        record: WorkerRecord,
        heartbeat: timedelta,
        *,
        unavailable: Callable[[DatabaseUnavailable, float, str], None] | None = None,
        unserved_every: timedelta = UNSERVED_LOG_INTERVAL,
    ) -> None:
        if heartbeat <= timedelta(0):
            raise ValueError(f"heartbeat must be a positive timedelta, got {heartbeat!r}")
        self._context = context
        self.record = record
        self.heartbeat = heartbeat
        self._unavailable = unavailable
        self._registered = False
        self._begun = False
        self._missing_said = False
        self.warnings = UnservedWarnings(self._find_unserved, context.clock, unserved_every)

    def begin(self) -> None:
        """The first heartbeat (registering the worker) and look for unserved tasks, in the caller's thread.

        A worker calls it as it starts, before its first claim: it is listed
        before it runs anything, and its start-up statements are over before
        its claims begin.  `run` then waits a heartbeat before its next one.
        """
        self._step()
        self._begun = True

    def run(self, stopping: threading.Event) -> None:
        interval = self.heartbeat.total_seconds()
        try:
            if not self._begun:
                self._step()
            while not stopping.wait(interval):
                self._step()
        finally:
            self.leave()

    def _step(self) -> None:
        """One heartbeat and, when it is time, one look for unserved tasks; failures said, never raised."""
        interval = self.heartbeat.total_seconds()
        try:
            self.beat()
            self.warnings.check()
        except DatabaseUnavailable as error:
            if self._unavailable is not None:
                self._unavailable(error, interval, self.name)
            else:
                logger.debug("the live-worker heartbeat failed (%s): trying again in %.1fs", error, interval)
        except SchemaMissing as error:
            if not self._missing_said:
                logger.warning("%s; this worker is not listed among the live workers meanwhile", error)
                self._missing_said = True

    def beat(self) -> None:
        """Register (the first time) or heartbeat, then prune rows long expired."""
        context = self._context
        now = context.clock()
        expires_at = now + self.heartbeat * EXPIRES_AFTER_HEARTBEATS
        record = self.record
        if self._registered:
            context.call(lambda: heartbeat_worker(context.engine, context.table, record, now, expires_at))
        else:
            context.call(lambda: register_worker(context.engine, context.table, record, now, expires_at))
            self._registered = True
        context.call(lambda: prune_workers(context.engine, context.table, now=now))

    def leave(self) -> None:
        """Delete the worker's row, if it wrote one; a failure leaves it to expire."""
        if not self._registered:
            return
        context = self._context
        try:
            context.call(lambda: deregister_worker(context.engine, context.table, self.record.id))
        except Exception as error:  # noqa: BLE001 - stopping anyway: the row expires on its own
            logger.debug("deleting this worker's live-worker row failed (%s): it expires on its own", error)
        else:
            self._registered = False

    def _find_unserved(self, now: datetime) -> list[UnservedTasks]:
        context = self._context
        return context.call(lambda: unserved_tasks(context.engine, context.table, now=now))

    def interrupt(self) -> None:
        """Nothing to interrupt: its waits watch ``stopping``."""


__all__ = [
    "EVERY_QUEUE",
    "EXPIRES_AFTER_HEARTBEATS",
    "MAX_HEARTBEAT",
    "PRUNE_AFTER",
    "UNSERVED_LOG_INTERVAL",
    "LiveWorker",
    "LiveWorkerService",
    "LiveWorkers",
    "RunningTask",
    "UnservedTasks",
    "UnservedWarnings",
    "WorkerRecord",
    "deregister_worker",
    "describe_unserved",
    "heartbeat_of",
    "heartbeat_worker",
    "list_live_workers",
    "package_version",
    "prune_workers",
    "register_worker",
    "unserved_line",
    "unserved_tasks",
]
