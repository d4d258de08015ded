"""Cancelling tasks, running ones included, and the progress running tasks report: their state and SQL.

A queued task is cancelled at once.  A running one cannot be stopped from
here: its worker can.  So the request is recorded on its row
(``cancel_requested_at``, ``cancelled_by``), announced on PostgreSQL's
cancel channel, and the worker holding the task reads it back with its next
lease renewal (`requested_cancels`).  The worker then stops the task and
writes CANCELLED through the same fenced UPDATE as every other outcome: a
cancel racing the task's own completion leaves exactly the one outcome that
write lets through.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Select, Table, Update, func, literal, select, update

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core import validation
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.events import EventKind, EventStream, TaskEvent
from sa_taskqueue.core.finished import notify_finished
from sa_taskqueue.core.model import CANCELLED_BY_LENGTH, FINISHED_STATUSES, TaskStatus, has_status
from sa_taskqueue.core.notify import cancel_channel_name
from sa_taskqueue.features.ports import QueueContext
from sa_taskqueue.features.workflows import final_writes
from sa_taskqueue.features.workflows.bookkeeping import cancelled_now
from sa_taskqueue.strategies.base import ClaimStrategy

#: Who cancelled a task when the caller does not say.
DEFAULT_CANCELLED_BY = "api"


class CancelState(enum.StrEnum):
    """What a cancel found the task doing."""

    QUEUED = "queued"  #: cancelled at once (queued, or waiting for its parents): it never runs
    RUNNING = "running"  #: the request is recorded: its worker stops it within one heartbeat
    FINISHED = "finished"  #: completed, failed or cancelled already: nothing cancelled
    MISSING = "missing"  #: no such task


@dataclass(frozen=True)
class CancelResult:
    """What `TaskQueue.cancel_task` did, and the status the task had (None for a missing one)."""

    task_id: int
    state: CancelState
    status: TaskStatus | None = None

    @property
    def cancelled(self) -> bool:
        """True when the task was cancelled at once or its cancel was requested (`TaskQueue.cancel`)."""
        return self.state in (CancelState.QUEUED, CancelState.RUNNING)

    @property
    def message(self) -> str:
        """One line for people: ``task 43 is running: cancel requested; ...``."""
        task = f"task {self.task_id}"
        if self.state is CancelState.QUEUED:
            if self.status is TaskStatus.WAITING:
                return f"cancelled {task}: it was waiting for its parents and will never run"
            return f"cancelled {task}: it was queued and will never run"
        if self.state is CancelState.RUNNING:
            return f"{task} is running: cancel requested; its worker stops it within one heartbeat"
        if self.state is CancelState.FINISHED:
            status = self.status.value if self.status is not None else "finished"
            return f"{task} already {status}: nothing cancelled"
        return f"{task} does not exist"

    def __bool__(self) -> bool:
        return self.cancelled


def check_cancelled_by(by: str) -> str:
    if not isinstance(by, str) or not by.strip():
        raise ValueError(f"cancelled_by must be a non-empty string, got {by!r}")
    return by[:CANCELLED_BY_LENGTH]


def cancel_on(conn: Connection, table: Table, task_id: int, by: str, now: datetime) -> CancelResult:
    """In ``conn``'s open transaction: cancel a queued task, or record the cancel of a running one.

    Guarded UPDATEs, tried in turn (queued, waiting on its parents, then
    running), so that a task claimed between them is still found running;
    then, only when none wrote, one SELECT tells a finished task from a
    missing one (or from one that moved between the statements, tried again).
    A cancelled task's dependents are cancelled with it, and its batch
    counted, in the same transaction (`cancelled_now`).
    """
    for not_started in (TaskStatus.QUEUED, TaskStatus.WAITING):
        cancelled = conn.execute(cancel_queued_statement(table, task_id, by, now, not_started))
        if cancelled.rowcount == 1:
            notify_finished(conn, table, [task_id])
            # Its dependents cancelled, its batch counted, in this transaction.
            cancelled_now(conn, table, [task_id], now)
            return CancelResult(task_id, CancelState.QUEUED, not_started)
    # The first request is kept: a second cancel does not move who or when.
    running = conn.execute(request_cancel_statement(table, task_id, by, now))
    if running.rowcount == 1:
        announce_cancel(conn, table, task_id)
        return CancelResult(task_id, CancelState.RUNNING, TaskStatus.RUNNING)
    status = conn.execute(select(table.c.status).where(table.c.id == task_id)).scalar()
    if status is None:
        return CancelResult(task_id, CancelState.MISSING)
    found = TaskStatus(status)
    if found is TaskStatus.RUNNING:
        return CancelResult(task_id, CancelState.RUNNING, found)  # requested before
    if found in FINISHED_STATUSES:
        return CancelResult(task_id, CancelState.FINISHED, found)
    # Queued again (a retry), or released, between the statements: cancelled like any queued task.
    return cancel_on(conn, table, task_id, by, now)


def cancel_queued_statement(
    table: Table, task_id: int, by: str, now: datetime, status: TaskStatus = TaskStatus.QUEUED
) -> Update:
    """CANCELLED at once, who and when recorded, if the task is still queued (or, given, waiting)."""
    return (
        update(table)
        .where(table.c.id == task_id, has_status(table, status))
        .values(status=TaskStatus.CANCELLED, finished_at=now, cancel_requested_at=now, cancelled_by=by)
    )


def request_cancel_statement(table: Table, task_id: int, by: str, now: datetime) -> Update:
    """Record who cancelled a running task and when; the first request is kept (a second does not move it)."""
    return (
        update(table)
        .where(
            table.c.id == task_id,
            has_status(table, TaskStatus.RUNNING),
            table.c.cancel_requested_at.is_(None),
        )
        .values(cancel_requested_at=now, cancelled_by=by)
    )


def requested_cancels_statement(table: Table, task_ids: Collection[int]) -> Select[tuple[int]]:
    """The ids among ``task_ids`` whose cancel was requested: by primary key, no index of its own needed."""
    return select(table.c.id).where(
        table.c.id.in_(sorted(task_ids)), table.c.cancel_requested_at.is_not(None)
    )


def announce_cancel(conn: Connection, table: Table, task_id: int) -> None:
    """PostgreSQL: tell the listening workers at commit, so the holder stops the task without a heartbeat."""
    if backend_for(conn.dialect).notify:
        conn.execute(select(func.pg_notify(literal(cancel_channel_name(table)), str(task_id))))


def cancel(context: QueueContext, events: EventStream, task_id: int, by: str) -> CancelResult:
    """`TaskQueue.cancel_task`: `cancel_on` in a transaction of its own; CANCELLED once a queued one is."""
    validation.check_task_id(task_id)
    by = check_cancelled_by(by)
    strategy = context.strategy
    now = context.clock()

    def run() -> tuple[CancelResult, TaskEvent | None]:
        with strategy.transaction(context.engine) as conn:
            result = cancel_on(conn, context.table, task_id, by, now)
            event = None
            if result.state is CancelState.QUEUED and events.wants(EventKind.CANCELLED):
                name, queue, attempts = conn.execute(
                    select(context.table.c.name, context.table.c.queue, context.table.c.attempts).where(
                        context.table.c.id == task_id
                    )
                ).one()
                event = TaskEvent(EventKind.CANCELLED, task_id, name, queue, attempts, now)
            return result, event

    with context.database_errors():
        result, event = context.call(run)
    if event is not None:
        events.emit(event)
    return result


def requested_cancels(engine: Engine, table: Table, task_ids: Collection[int]) -> set[int]:
    """Which of ``task_ids`` (tasks a worker holds) someone asked to cancel: one SELECT by primary key."""
    if not task_ids:
        return set()
    with engine.connect() as conn:
        return set(conn.scalars(requested_cancels_statement(table, task_ids)))


def write_cancelled(
    strategy: ClaimStrategy, engine: Engine, table: Table, task: ClaimedTask, now: datetime
) -> bool:
    """The worker's fenced write of a stopped task's outcome: CANCELLED, never retried; True if it wrote.

    The same lease-fenced UPDATE as a completion or a failure: whichever of
    them comes first is the task's one outcome, the others find the task no
    longer held.
    """
    values = {"status": TaskStatus.CANCELLED, "finished_at": now}
    return final_writes.finish(strategy, engine, table, task, values, now)


# Progress ----------------------------------------------------------------------


@dataclass(frozen=True)
class TaskProgress:
    """The last progress a task reported: a fraction from 0 to 1, its note (JSON), and when it was written."""

    progress: float
    note: Any
    at: datetime | None


def write_progress(
    strategy: ClaimStrategy,
    engine: Engine,
    table: Table,
    task: ClaimedTask,
    progress: float,
    note: Any,
    now: datetime,
) -> bool:
    """Write a running task's progress if its claim still holds it (same claim, lease not over).

    A worker that lost the task's lease matches no row: its report is dropped.
    """
    values = {"progress": progress, "progress_note": note, "progress_at": now}
    return strategy.finish(engine, table, task, values, now)


def read_progress(context: QueueContext, task_id: int) -> TaskProgress | None:
    """`TaskQueue.progress`: the task's last progress, None if it reported none; `TaskNotFound`-free."""
    validation.check_task_id(task_id)
    t = context.table

    def run() -> TaskProgress | None:
        with context.engine.connect() as conn:
            row = conn.execute(
                select(t.c.progress, t.c.progress_note, t.c.progress_at).where(t.c.id == task_id)
            ).first()
        if row is None or row[0] is None:
            return None
        return TaskProgress(float(row[0]), row[1], row[2])

    with context.database_errors():
        return context.call(run)


__all__ = [
    "DEFAULT_CANCELLED_BY",
    "CancelResult",
    "CancelState",
    "TaskProgress",
    "announce_cancel",
    "cancel",
    "cancel_on",
    "cancel_queued_statement",
    "read_progress",
    "request_cancel_statement",
    "requested_cancels",
    "requested_cancels_statement",
    "write_cancelled",
    "write_progress",
]
