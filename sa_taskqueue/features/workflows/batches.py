"""Batches: many tasks, one set of callbacks, enqueued exactly once when the last member finishes.

A batch is a row of ``<task table>_batches`` (`sa_taskqueue.core.batch_table`):
its counts by outcome, ``closed_at`` (no member may join once set) and
``finished_at`` (set once, when every member of a closed batch has finished).
Members name it in their ``batch_id``.

The bookkeeping is exact because it happens where each member's outcome is
written, in the same transaction (`members_finished`, called by
`sa_taskqueue.features.workflows.bookkeeping` from every final transition):

1. ``UPDATE batches SET succeeded = succeeded + :s, failed = failed + :f,
   cancelled = cancelled + :c WHERE id = :b``: the member is counted with its
   fenced final write, so it is counted if and only if that write commits.
   A worker killed before the commit leaves neither; the task is claimed
   again and counted when it finishes.
2. ``UPDATE batches SET finished_at = :now WHERE id = :b AND closed_at IS NOT
   NULL AND finished_at IS NULL AND succeeded + failed + cancelled = total``:
   the conditional UPDATE that finishes the batch.  Both statements hold the
   batch row's lock until the commit, so of the transactions that could
   finish a batch (its last members' completions, its close) exactly one
   matches, and only that one inserts the callback tasks, in the same
   transaction: they exist once, or not at all if it rolls back.

`close` runs the same conditional UPDATE, since every member may have
finished before the batch was closed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

from sqlalchemy import Connection, Row, Table, Update, func, insert, literal, select, update

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.batch_table import batch_table_of
from sa_taskqueue.core.exceptions import BatchNotFound
from sa_taskqueue.core.model import TaskStatus
from sa_taskqueue.core.notify import channel_name
from sa_taskqueue.core.param_types import register_type

#: When a callback runs: every member completed; some member failed or was cancelled; either way.
Outcome = Literal["success", "failure", "complete"]
OUTCOMES: tuple[Outcome, ...] = ("success", "failure", "complete")

#: The param each callback is given: the batch's id, name and counts (a `BatchSummary`).
BATCH_PARAM = "batch"

#: Where a member's final status is counted.
_COUNTED = {
    TaskStatus.COMPLETED: "succeeded",
    TaskStatus.FAILED: "failed",
    TaskStatus.CANCELLED: "cancelled",
}


@dataclass(frozen=True)
class BatchSummary:
    """What a batch's callback is given as its ``batch`` param: the batch's id, name and final counts.

    Stored in the callback's params as a JSON object with these keys; a
    callback that annotates its param ``batch: BatchSummary`` gets this
    object, one that does not gets the dict.
    """

    id: int
    name: str | None
    total: int
    succeeded: int
    failed: int
    cancelled: int

    @property
    def all_succeeded(self) -> bool:
        """Every member completed (true of an empty batch)."""
        return self.succeeded == self.total

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "total": self.total,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
        }

    @classmethod
    def from_json(cls, value: Any) -> BatchSummary:
        if not isinstance(value, Mapping):
            raise ValueError(f"a batch summary is a JSON object, got {type(value).__name__}")
        try:
            return cls(
                id=int(value["id"]),
                name=value.get("name"),
                total=int(value["total"]),
                succeeded=int(value["succeeded"]),
                failed=int(value["failed"]),
                cancelled=int(value["cancelled"]),
            )
        except KeyError as missing:
            raise ValueError(f"a batch summary needs {missing.args[0]!r}") from None


register_type(BatchSummary, encode=BatchSummary.as_json, decode=BatchSummary.from_json)


@dataclass(frozen=True)
class CallbackSpec:
    """One callback as the batch row stores it: its task row but the ``batch`` param, checked at creation."""

    on: Outcome
    name: str
    queue: str
    priority: int
    max_attempts: int
    params: dict[str, Any]
    #: Seconds after the batch finishes that the callback is due (``task.using(delay=...)``).
    delay: float | None = None
    concurrency_key: str | None = None
    headers: dict[str, str] | None = None

    def as_json(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "on": self.on,
            "name": self.name,
            "queue": self.queue,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "params": self.params,
        }
        if self.delay is not None:
            spec["delay"] = self.delay
        if self.concurrency_key is not None:
            spec["concurrency_key"] = self.concurrency_key
        if self.headers:
            spec["headers"] = self.headers
        return spec

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> CallbackSpec:
        return cls(
            on=value["on"],
            name=value["name"],
            queue=value["queue"],
            priority=int(value["priority"]),
            max_attempts=int(value["max_attempts"]),
            params=dict(value.get("params") or {}),
            delay=value.get("delay"),
            concurrency_key=value.get("concurrency_key"),
            headers=value.get("headers"),
        )


@dataclass(frozen=True)
class BatchState:
    """A batch as its row says now: counts, when it was closed and finished, and its callbacks."""

    id: int
    name: str | None
    created_at: datetime
    closed_at: datetime | None
    finished_at: datetime | None
    total: int
    succeeded: int
    failed: int
    cancelled: int
    callbacks: list[CallbackSpec] = field(default_factory=list)

    @property
    def pending(self) -> int:
        """Members not finished yet: waiting, queued or running (retries included)."""
        return self.total - self.succeeded - self.failed - self.cancelled

    @property
    def status(self) -> Literal["open", "closed", "finished"]:
        """``open`` (takes members), ``closed`` (members pending) or ``finished`` (callbacks enqueued)."""
        if self.finished_at is not None:
            return "finished"
        return "open" if self.closed_at is None else "closed"

    @property
    def outcome(self) -> Literal["succeeded", "failed"] | None:
        """Once finished: ``succeeded`` if every member completed, else ``failed``; None before."""
        if self.finished_at is None:
            return None
        return "succeeded" if self.succeeded == self.total else "failed"

    def summary(self) -> BatchSummary:
        """The id, name and counts, as a callback is given them."""
        return BatchSummary(self.id, self.name, self.total, self.succeeded, self.failed, self.cancelled)

    def as_json(self) -> dict[str, Any]:
        """Every field (times in ISO 8601), with ``pending``, ``status`` and ``outcome``: for scripts."""

        def iso(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()

        return {
            "id": self.id,
            "name": self.name,
            "status": self.status,
            "outcome": self.outcome,
            "total": self.total,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "pending": self.pending,
            "created_at": iso(self.created_at),
            "closed_at": iso(self.closed_at),
            "finished_at": iso(self.finished_at),
            "callbacks": [spec.as_json() for spec in self.callbacks],
        }


class FinishedMember(Protocol):
    """A task that just reached its final status, as the bookkeeping passes it."""

    @property
    def batch_id(self) -> int | None: ...

    @property
    def status(self) -> TaskStatus: ...


@dataclass(frozen=True)
class Member:
    """A member and its status, for `members_finished` and `members_reopened` where no richer record is."""

    batch_id: int | None
    status: TaskStatus


# Writes -------------------------------------------------------------------------------------------


def create(
    conn: Connection, table: Table, name: str | None, callbacks: Sequence[CallbackSpec], now: datetime
) -> int:
    """A new open batch in ``conn``'s transaction; its id."""
    batches = batch_table_of(table)
    result = conn.execute(
        insert(batches).values(
            name=name,
            created_at=now,
            total=0,
            succeeded=0,
            failed=0,
            cancelled=0,
            callbacks=[spec.as_json() for spec in callbacks] or None,
        )
    )
    batch_id = result.inserted_primary_key[0] if result.inserted_primary_key else None
    if batch_id is None:  # pragma: no cover - every supported dialect returns it
        raise RuntimeError("the database did not return the new batch's id")
    return int(batch_id)


def close(conn: Connection, table: Table, batch_id: int, now: datetime) -> bool:
    """Close the batch (no more members), then finish it if every member has finished.

    In ``conn``'s transaction.  Closing a closed batch changes nothing.
    Returns True when this call finished the batch (its callbacks are then
    enqueued in this transaction).  `BatchNotFound` for a missing batch.
    """
    batches = batch_table_of(table)
    closed = conn.execute(
        update(batches).where(batches.c.id == batch_id, batches.c.closed_at.is_(None)).values(closed_at=now)
    )
    if (
        closed.rowcount != 1
        and conn.execute(select(batches.c.id).where(batches.c.id == batch_id)).first() is None
    ):
        raise BatchNotFound(batch_id)
    return finish_if_done(conn, table, batch_id, now)


def members_finished(
    conn: Connection, table: Table, members: Iterable[FinishedMember], now: datetime
) -> None:
    """Count members that reached their final status into their batches, and finish the batches now done.

    Called in the transaction of the members' fenced final writes, by the
    workflow bookkeeping, for every final transition of a task with a
    ``batch_id`` (others are skipped here).  Per batch, in id order (so two
    transactions lock batch rows in one order): one UPDATE of the counts,
    then the conditional UPDATE of `finish_if_done`; that is two statements
    per batch touched, whatever the number of its members in the call.
    """
    per_batch: dict[int, Counter[str]] = {}
    for member in members:
        if member.batch_id is None:
            continue
        column = _COUNTED.get(TaskStatus(member.status))
        if column is None:
            raise ValueError(f"task status {member.status!r} is not final; a batch counts final ones only")
        per_batch.setdefault(int(member.batch_id), Counter())[column] += 1
    if not per_batch:
        return
    batches = batch_table_of(table)
    for batch_id in sorted(per_batch):
        conn.execute(count_statement(batches, batch_id, per_batch[batch_id]))
        finish_if_done(conn, table, batch_id, now)


def count_statement(batches: Table, batch_id: int, counts: Mapping[str, int], sign: int = 1) -> Update:
    """``succeeded``, ``failed`` and ``cancelled`` moved by ``counts`` (times ``sign``), in one UPDATE."""
    return (
        update(batches)
        .where(batches.c.id == batch_id)
        .values(
            succeeded=batches.c.succeeded + sign * counts.get("succeeded", 0),
            failed=batches.c.failed + sign * counts.get("failed", 0),
            cancelled=batches.c.cancelled + sign * counts.get("cancelled", 0),
        )
    )


def members_reopened(conn: Connection, table: Table, members: Iterable[FinishedMember]) -> None:
    """Take finished members out of their batches' counts: they were queued to run again (a retry).

    Each is counted again when it finishes again, so every member stays
    counted once.  A batch already finished stays finished: its callbacks
    ran; its counts follow the member.
    """
    per_batch: dict[int, Counter[str]] = {}
    for member in members:
        if member.batch_id is None:
            continue
        column = _COUNTED.get(TaskStatus(member.status))
        if column is not None:
            per_batch.setdefault(int(member.batch_id), Counter())[column] += 1
    batches = batch_table_of(table)
    for batch_id in sorted(per_batch):
        conn.execute(count_statement(batches, batch_id, per_batch[batch_id], sign=-1))


def finish_if_done(conn: Connection, table: Table, batch_id: int, now: datetime) -> bool:
    """The one conditional UPDATE that finishes a closed batch whose members have all finished.

    It matches once in the batch's life (``finished_at IS NULL`` is part of
    it, and it holds the batch row until the commit); only the transaction it
    matched in enqueues the callbacks, in that same transaction.  Returns
    whether it matched.
    """
    batches = batch_table_of(table)
    finished = conn.execute(finish_statement(batches, batch_id, now))
    if finished.rowcount != 1:
        return False
    row = conn.execute(select(batches).where(batches.c.id == batch_id)).one()
    _enqueue_callbacks(conn, table, _state(row), now)
    return True


def finish_statement(batches: Table, batch_id: int, now: datetime) -> Update:
    """The conditional UPDATE that sets ``finished_at`` once: closed, not finished, every member counted."""
    return (
        update(batches)
        .where(
            batches.c.id == batch_id,
            batches.c.closed_at.is_not(None),
            batches.c.finished_at.is_(None),
            batches.c.succeeded + batches.c.failed + batches.c.cancelled == batches.c.total,
        )
        .values(finished_at=now)
    )


def _enqueue_callbacks(conn: Connection, table: Table, state: BatchState, now: datetime) -> None:
    """Insert the callbacks the outcome calls for, each given ``batch`` (id, name, counts)."""
    wanted = ("success", "complete") if state.succeeded == state.total else ("failure", "complete")
    specs = [spec for spec in state.callbacks if spec.on in wanted]
    if not specs:
        return
    summary = state.summary().as_json()
    for spec in specs:
        run_at = now if spec.delay is None else now + timedelta(seconds=spec.delay)
        values: dict[str, Any] = {
            "name": spec.name,
            "queue": spec.queue,
            "priority": spec.priority,
            "max_attempts": spec.max_attempts,
            "params": {**spec.params, BATCH_PARAM: summary},
            "status": TaskStatus.QUEUED,
            "attempts": 0,
            "run_at": run_at,
            "created_at": now,
        }
        if spec.concurrency_key is not None:
            values["concurrency_key"] = spec.concurrency_key
        if spec.headers:
            values["headers"] = spec.headers
        conn.execute(insert(table).values(**values))
    if backend_for(conn.dialect).notify:
        # PostgreSQL: wake the workers of the callbacks' queues at commit, as an enqueue does.
        for queue in sorted({spec.queue for spec in specs}):
            conn.execute(select(func.pg_notify(literal(channel_name(table)), literal(queue))))


# Reads --------------------------------------------------------------------------------------------


def read(conn: Connection, table: Table, batch_id: int) -> BatchState | None:
    """The batch's state now, or None if there is no such batch."""
    batches = batch_table_of(table)
    row = conn.execute(select(batches).where(batches.c.id == batch_id)).first()
    return None if row is None else _state(row)


def listing(
    conn: Connection, table: Table, *, limit: int = 50, before: int | None = None, unfinished: bool = False
) -> list[BatchState]:
    """Up to ``limit`` batches, newest first (ids below ``before``); ``unfinished``: not finished yet."""
    batches = batch_table_of(table)
    query = select(batches).order_by(batches.c.id.desc()).limit(limit)
    if before is not None:
        query = query.where(batches.c.id < before)
    if unfinished:
        query = query.where(batches.c.finished_at.is_(None))
    return [_state(row) for row in conn.execute(query)]


def member_statuses(conn: Connection, table: Table, batch_id: int) -> dict[str, int]:
    """How many members the batch has in each status now (those retention has not deleted).

    One ``GROUP BY status`` over the batch's members, which the ``batch_id``
    index finds; for people (the command line, the dashboard), not for the
    bookkeeping, which never counts rows.
    """
    rows = conn.execute(
        select(table.c.status, func.count()).where(table.c.batch_id == batch_id).group_by(table.c.status)
    )
    return {TaskStatus(status).value: int(count) for status, count in rows}


def _state(row: Row[Any]) -> BatchState:
    values = row._mapping
    return BatchState(
        id=int(values["id"]),
        name=values["name"],
        created_at=values["created_at"],
        closed_at=values["closed_at"],
        finished_at=values["finished_at"],
        total=int(values["total"]),
        succeeded=int(values["succeeded"]),
        failed=int(values["failed"]),
        cancelled=int(values["cancelled"]),
        callbacks=[CallbackSpec.from_json(spec) for spec in values["callbacks"] or ()],
    )


__all__ = [
    "BATCH_PARAM",
    "OUTCOMES",
    "BatchState",
    "BatchSummary",
    "CallbackSpec",
    "FinishedMember",
    "Member",
    "close",
    "count_statement",
    "create",
    "finish_if_done",
    "finish_statement",
    "listing",
    "member_statuses",
    "members_finished",
    "members_reopened",
    "read",
]
