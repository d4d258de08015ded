"""Operations on the task table for people and scripts: the command line's backend.

None of these needs the application's task functions: they work on rows.
Each runs in short transactions of its own; ``purge`` deletes in batches so
that clearing millions of finished rows never holds a long lock.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    Connection,
    CursorResult,
    Engine,
    Select,
    Table,
    delete,
    func,
    insert,
    select,
    type_coerce,
    update,
)
from sqlalchemy.orm import Session

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core import validation
from sa_taskqueue.core.dependency_table import dependency_table_of
from sa_taskqueue.core.exceptions import translate_database_errors
from sa_taskqueue.core.finished import notify_finished
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.model import FINISHED_STATUSES, Task, TaskMixin, TaskStatus, has_status
from sa_taskqueue.core.notify import notify_enqueued
from sa_taskqueue.core.types import LongText, utcnow
from sa_taskqueue.features import unique
from sa_taskqueue.features.workflows import batches, dependencies
from sa_taskqueue.features.workflows.bookkeeping import cancelled_now


@dataclass(frozen=True)
class UnregisteredTasks:
    """Queued tasks under one name that the application asking has not registered.

    During a rolling deploy these are a newer release's tasks: workers of the
    older release leave them queued for the workers that know them.
    """

    name: str
    queued: int
    oldest_age: timedelta  # since the oldest of them was enqueued


@dataclass
class StatusReport:
    """What ``sa-taskqueue status`` shows."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # queue -> status -> count
    oldest_due_age: timedelta | None = None
    expired_leases: list[int] = field(default_factory=list)
    #: Queued tasks by name not in the registered names given, oldest first;
    #: None when no registered names were given.
    unregistered: list[UnregisteredTasks] | None = None


class Admin:
    """Row-level operations on one task table."""

    def __init__(self, engine: Engine, model: type[TaskMixin] | Table = Task) -> None:
        """``model`` is the mapped task class, or its table (what a queue's command line has)."""
        self.engine = engine
        self.model = model
        # The connection settings a queue's engine gets (SQLite's busy
        # timeout): a command run beside a writing application waits for it.
        backend_for(engine.dialect).configure_engine(engine)
        table = model if isinstance(model, Table) else getattr(model, "__table__", None)
        if not isinstance(table, Table):
            raise TypeError(f"model must be a mapped TaskMixin class or its table, got {model!r}")
        self.table: Table = table

    def enqueue(
        self,
        name: str,
        params: dict[str, Any],
        *,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 3,
        delay: timedelta | None = None,
        run_at: datetime | None = None,
    ) -> int:
        """Insert one task by name (no registration is checked here: workers check it)."""
        values = self.task_values(
            name,
            params,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            delay=delay,
            run_at=run_at,
        )
        with translate_database_errors(self.engine, self.table), Session(self.engine) as session:
            # A Core insert: the table is all a command line that loaded no
            # mapped class has.
            inserted = cast("CursorResult[Any]", session.execute(insert(self.table).values(values)))
            key = inserted.inserted_primary_key
            assert key is not None, "an INSERT of one row returns its primary key"
            task_id = key[0]
            notify_enqueued(session, self.table, [queue])
            session.commit()
            return int(task_id)

    def enqueue_unique(
        self,
        name: str,
        params: dict[str, Any],
        unique_key: str,
        *,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 3,
        delay: timedelta | None = None,
        run_at: datetime | None = None,
    ) -> tuple[int, bool]:
        """`enqueue` with a unique key: the new task's id and True, or the holding task's id and False."""
        values = self.task_values(
            name,
            params,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            delay=delay,
            run_at=run_at,
        )
        validation.check_text("unique_key", unique_key, ColumnLimits.of(self.table).unique_key_length)
        values["unique_key"] = unique_key
        with translate_database_errors(self.engine, self.table), Session(self.engine) as session:
            task_id, inserted = unique.insert_unique(session, self.table, values)
            if inserted:
                notify_enqueued(session, self.table, [queue])
            session.commit()
            return task_id, inserted

    def task_values(
        self,
        name: str,
        params: dict[str, Any],
        *,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 3,
        delay: timedelta | None = None,
        run_at: datetime | None = None,
    ) -> dict[str, Any]:
        """The checked column values of the task `enqueue` inserts; nothing touches the database.

        It runs no sooner than ``run_at`` (an aware datetime) or ``delay`` from now; not both.
        """
        now = utcnow()
        if delay is not None and run_at is not None:
            raise ValueError("give a delay or a run_at, not both")
        if delay:
            run_at = validation.run_at_after(now, delay)
        return validation.task_values(
            name,
            params,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            run_at=run_at,
            now=now,
            limits=ColumnLimits.of(self.table),
        )

    def status(self, registered: Collection[str] | None = None) -> StatusReport:
        """The table at a glance; given an application's ``registered`` names, what it leaves queued."""
        t = self.table
        now = utcnow()
        report = StatusReport()
        with translate_database_errors(self.engine, self.table), self.engine.connect() as conn:
            counts: dict[str, dict[str, int]] = defaultdict(dict)
            for queue, status, count in conn.execute(
                select(t.c.queue, t.c.status, func.count()).group_by(t.c.queue, t.c.status)
            ):
                counts[queue][TaskStatus(status).value] = count
            report.counts = dict(counts)
            oldest = conn.scalar(
                select(func.min(t.c.run_at)).where(has_status(t, TaskStatus.QUEUED), t.c.run_at <= now)
            )
            if oldest is not None:
                report.oldest_due_age = now - oldest
            report.expired_leases = list(
                conn.scalars(
                    select(t.c.id)
                    .where(has_status(t, TaskStatus.RUNNING), t.c.locked_until < now)
                    .order_by(t.c.id)
                    .limit(1000)
                )
            )
            if registered is not None:
                report.unregistered = self._unregistered(conn, set(registered), now)
        return report

    def _unregistered(self, conn: Connection, registered: set[str], now: datetime) -> list[UnregisteredTasks]:
        # Grouped by name in the database and compared here: a table holds
        # few distinct names, an application may register many.
        t = self.table
        rows = conn.execute(
            select(t.c.name, func.count(), func.min(t.c.created_at))
            .where(has_status(t, TaskStatus.QUEUED))
            .group_by(t.c.name)
        )
        found = [
            UnregisteredTasks(name=name, queued=count, oldest_age=max(now - oldest, timedelta(0)))
            for name, count, oldest in rows
            if name not in registered
        ]
        return sorted(found, key=lambda group: (-group.oldest_age, group.name))

    def retry(self, task_id: int | None) -> int:
        """Queue a failed or cancelled task (or, with None, every failed task) to run now, afresh.

        A task with a unique key is queued again only while no other task of
        its name holds that key (queued or running): the unique index would
        refuse it, so it is left as it is and not counted.  Of several failed
        tasks sharing a key, the first retried takes it.
        """
        if task_id is not None:
            validation.check_task_id(task_id)
        t = self.table
        condition = (
            t.c.status.in_([TaskStatus.FAILED, TaskStatus.CANCELLED])
            if task_id is not None
            else (t.c.status == TaskStatus.FAILED)
        )
        if task_id is not None:
            condition = condition & (t.c.id == task_id)
        again = {
            "status": TaskStatus.QUEUED,
            "run_at": utcnow(),
            "attempts": 0,
            "finished_at": None,
            "locked_by": None,
            "locked_until": None,
            # A cancelled task run again is no longer cancelled: its new run must not be stopped.
            "cancel_requested_at": None,
            "cancelled_by": None,
            "progress": None,
            "progress_note": None,
            "progress_at": None,
        }
        with translate_database_errors(self.engine, self.table), self.engine.begin() as conn:
            # Batch members leave their batch's counts as they are queued again, and are counted
            # when they finish again: each member counted once (`batches.members_reopened`).
            members = conn.execute(
                select(t.c.batch_id, t.c.status)
                .where(condition, t.c.unique_key.is_(None), t.c.batch_id.is_not(None))
                .with_for_update()
            ).all()
            unkeyed = list(
                conn.scalars(select(t.c.id).where(condition, t.c.unique_key.is_(None)).with_for_update())
            )
            retried = conn.execute(
                update(t).where(condition, t.c.unique_key.is_(None)).values(**again)
            ).rowcount
            reopened_ids = list(unkeyed)
            batches.members_reopened(
                conn, t, [batches.Member(batch_id, TaskStatus(status)) for batch_id, status in members]
            )
            keyed = conn.execute(
                select(t.c.id, t.c.name, t.c.unique_key)
                .where(condition, t.c.unique_key.is_not(None))
                .order_by(t.c.id)
            ).all()
            taken: set[tuple[str, str]] = set()
            for keyed_id, name, key in keyed:
                if (name, key) in taken or self._key_held(conn, name, key):
                    continue
                taken.add((name, key))
                written = conn.execute(
                    update(t).where(condition, t.c.id == keyed_id).values(**again)
                ).rowcount
                retried += written
                if written:
                    reopened_ids.append(keyed_id)
            # Their dependents count their next end, and those with parents wait for them again.
            dependencies.reopened(conn, t, reopened_ids)
        return retried

    def _key_held(self, conn: Connection, name: str, key: str) -> bool:
        """Whether a queued or running task of ``name`` holds the unique ``key``."""
        t = self.table
        held = select(t.c.id).where(
            t.c.name == name, t.c.unique_key == key, t.c.status.in_([TaskStatus.QUEUED, TaskStatus.RUNNING])
        )
        return conn.execute(held.limit(1)).first() is not None

    def cancel(self, task_id: int) -> bool:
        """Cancel a queued task so that it never runs; False if it is not queued."""
        validation.check_task_id(task_id)
        with translate_database_errors(self.engine, self.table), self.engine.begin() as conn:
            return cancel_queued(conn, self.table, task_id, utcnow())

    def delete(self, task_id: int) -> bool:
        """Delete one finished task (completed, failed or cancelled); False if it is not finished.

        A queued task is cancelled first, and a running one is left to
        finish: deleting it under its worker would lose the outcome.
        """
        validation.check_task_id(task_id)
        t = self.table
        with translate_database_errors(self.engine, self.table), self.engine.begin() as conn:
            deleted = conn.execute(
                delete(t).where(t.c.id == task_id, t.c.status.in_(FINISHED_STATUSES))
            ).rowcount
        return deleted == 1

    def purge(self, statuses: list[str], older_than: timedelta, batch_size: int = 1000) -> int:
        """Delete finished tasks older than ``older_than``, ``batch_size`` rows per transaction."""
        t = self.table
        cutoff = utcnow() - older_than
        wanted = [TaskStatus(status) for status in statuses]
        deleted = 0
        with translate_database_errors(self.engine, self.table):
            while True:
                with self.engine.begin() as conn:
                    ids = list(
                        conn.scalars(
                            select(t.c.id)
                            .where(t.c.status.in_(wanted), t.c.finished_at < cutoff)
                            .order_by(t.c.id)
                            .limit(batch_size)
                        )
                    )
                    if not ids:
                        return deleted
                    deleted += conn.execute(delete(t).where(t.c.id.in_(ids))).rowcount
                    # Their edges to their parents matter no more (`retention.orphan_edges_delete`).
                    edges = dependency_table_of(t)
                    conn.execute(delete(edges).where(edges.c.child_id.in_(ids)))


def cancel_queued(conn: Connection, table: Table, task_id: int, now: datetime) -> bool:
    """Cancel task ``task_id`` on ``conn`` (in a transaction) if still queued or waiting; True if it was.

    A caller waiting for its result is told when the transaction commits.
    """
    result = conn.execute(
        update(table)
        .where(table.c.id == task_id, table.c.status.in_([TaskStatus.QUEUED.value, TaskStatus.WAITING.value]))
        .values(status=TaskStatus.CANCELLED, finished_at=now)
    )
    if result.rowcount != 1:
        return False
    notify_finished(conn, table, [task_id])
    # Its dependents cancelled, its batch counted, in this transaction.
    cancelled_now(conn, table, [task_id], now)
    return True


# Reading tasks: ``sa-taskqueue list`` and ``show`` ----------------------------------

#: The most rows ``list_tasks`` returns at once.
LIST_LIMIT_MAX = 10_000
#: The columns a JSON document is stored in: read raw, then decoded here (see `_decoded`).
_JSON_COLUMNS = ("params", "result")


@dataclass(frozen=True)
class Undecodable:
    """A JSON column whose stored text is not JSON (a row written around the queue): the text as stored."""

    text: str


def list_tasks(
    engine: Engine,
    table: Table,
    /,
    *,
    status: str | None = None,
    queue: str | None = None,
    name: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """The newest tasks first (by id), filtered by status, queue and name; each row as column -> value.

    Every column of ``table`` is read, an application's own extra columns too.
    """
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= LIST_LIMIT_MAX:
        raise ValueError(f"limit must be between 1 and {LIST_LIMIT_MAX}, got {limit!r}")
    query = _rows(table)
    if status is not None:
        query = query.where(has_status(table, TaskStatus(status)))
    if queue is not None:
        query = query.where(table.c.queue == queue)
    if name is not None:
        query = query.where(table.c.name == name)
    query = query.order_by(table.c.id.desc()).limit(limit)
    with translate_database_errors(engine, table), engine.connect() as conn:
        return [_decoded(row._asdict()) for row in conn.execute(query)]


def get_task(engine: Engine, table: Table, /, task_id: int) -> dict[str, Any] | None:
    """Every column of task ``task_id`` (column -> value), or None when there is no such task."""
    validation.check_task_id(task_id)
    with translate_database_errors(engine, table), engine.connect() as conn:
        row = conn.execute(_rows(table).where(table.c.id == task_id)).one_or_none()
    return None if row is None else _decoded(row._asdict())


def _rows(table: Table) -> Select[Any]:
    # The JSON columns are read as the database returns them and decoded in
    # `_decoded`: a row whose params are not JSON (written around the queue)
    # is shown as stored instead of failing the whole read.
    return select(
        *(
            type_coerce(column, LongText()).label(column.name) if column.name in _JSON_COLUMNS else column
            for column in table.c
        )
    )


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    for column in _JSON_COLUMNS:
        value = row.get(column)
        if isinstance(value, (str, bytes)):
            try:
                row[column] = json.loads(value)
            except ValueError:
                row[column] = Undecodable(
                    value.decode(errors="replace") if isinstance(value, bytes) else value
                )
    return row
