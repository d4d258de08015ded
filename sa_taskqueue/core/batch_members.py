"""Adding members to a batch: each new member counted into its batch's ``total`` while the batch is open.

Every way a task joins a batch (``enqueue(..., batch=b)``, ``Batch.enqueue``,
``enqueue_many``, ``session.add(Task(..., batch_id=b.id))``) comes through
`count_members`, in the transaction that inserts the member::

    UPDATE <task table>_batches SET total = total + :n WHERE id = :b AND closed_at IS NULL

A closed batch matches nothing, so the member is refused (`BatchClosed`)
before its row is written.  The UPDATE holds the batch row until the
transaction ends, so a concurrent ``close`` waits for it and then sees the
member in ``total``, or goes first, and this UPDATE then finds the batch
closed: either way no member is left uncounted by the check that finishes a
batch.  (Read committed on PostgreSQL re-reads the row the UPDATE waited
for; MySQL and MariaDB's UPDATE reads the latest committed row whatever the
isolation; SQLite has one writer.)

The listener `count_flushed_members` gives rows added to a session the
same count: it runs before the flush sends any SQL, so a refused member
leaves the session's transaction as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, Table, Update, inspect, select, update
from sqlalchemy.orm import Session, UOWTransaction

from sa_taskqueue.core.batch_table import batch_table_of
from sa_taskqueue.core.exceptions import BatchClosed, BatchNotFound
from sa_taskqueue.core.model import ID_MAX, TaskMixin, TaskStatus


def check_batch_id(batch_id: object) -> int:
    """``batch_id`` as the id of a batch row: a positive int (not a bool), else `ValueError`/`TypeError`."""
    if isinstance(batch_id, bool) or not isinstance(batch_id, int):
        raise TypeError(f"batch_id must be an int (a batch's id), got {type(batch_id).__name__}")
    if not 1 <= batch_id <= ID_MAX:
        raise ValueError(f"batch_id must be between 1 and {ID_MAX}, got {batch_id}")
    return batch_id


def count_members(conn: Connection, task_table: Table, counts: Mapping[int, int]) -> None:
    """Add ``counts[batch]`` members to each batch's ``total``, in ``conn``'s transaction, batches by id.

    Raises `BatchClosed` (or `BatchNotFound`) for the first batch that is
    closed (or missing), having taken back what it added to the batches
    before it, so the transaction holds no count of this call.  In id order,
    so two transactions adding to the same batches lock them in one order.
    """
    batches = batch_table_of(task_table)
    added: list[tuple[int, int]] = []
    for batch_id, count in sorted(counts.items()):
        if count <= 0:
            continue
        written = conn.execute(add_members_statement(batches, batch_id, count))
        if written.rowcount != 1:
            for earlier, n in added:
                uncount_members(conn, task_table, earlier, n)
            raise _not_open(conn, batches, batch_id)
        added.append((batch_id, count))


def add_members_statement(batches: Table, batch_id: int, count: int) -> Update:
    """``total`` moved up by ``count`` if the batch is still open (a closed one matches no row)."""
    return (
        update(batches)
        .where(batches.c.id == batch_id, batches.c.closed_at.is_(None))
        .values(total=batches.c.total + count)
    )


def uncount_members(conn: Connection, task_table: Table, batch_id: int, count: int) -> None:
    """Take back ``count`` members that `count_members` added and whose rows were not written."""
    batches = batch_table_of(task_table)
    conn.execute(update(batches).where(batches.c.id == batch_id).values(total=batches.c.total - count))


#: Where a member that is final when inserted is counted.
_COUNTED_AT_INSERT = {
    TaskStatus.COMPLETED: "succeeded",
    TaskStatus.FAILED: "failed",
    TaskStatus.CANCELLED: "cancelled",
}


def count_finished_at_insert(
    conn: Connection, task_table: Table, batch_id: int, status: Any, count: int
) -> None:
    """Count ``count`` members inserted already final (a dependent cancelled at once for a failed parent).

    No final write of theirs will pass through the bookkeeping, so they are
    counted here, in the transaction that inserts them.  Their batch is open
    (it took them), so this cannot be what finishes it.
    """
    column = _COUNTED_AT_INSERT.get(TaskStatus(status))
    if column is None or count <= 0:
        return
    batches = batch_table_of(task_table)
    conn.execute(update(batches).where(batches.c.id == batch_id).values({column: batches.c[column] + count}))


def count_flushed_finished_members(session: Session, flush_context: UOWTransaction) -> None:
    """``after_flush``: new members a flush inserted already final are counted into their batches."""
    finished: dict[tuple[Table, int, TaskStatus], int] = {}
    for instance in session.new:
        if isinstance(instance, TaskMixin):
            values = inspect(instance).dict
            batch_id, status = values.get("batch_id"), values.get("status")
            if batch_id is not None and status is not None and TaskStatus(status) in _COUNTED_AT_INSERT:
                key = (type(instance).__table__, batch_id, TaskStatus(status))  # type: ignore[attr-defined]
                finished[key] = finished.get(key, 0) + 1
    for (table, batch_id, status), count in sorted(finished.items(), key=lambda item: item[0][1]):
        count_finished_at_insert(
            session.connection(bind_arguments={"clause": table}), table, batch_id, status, count
        )


def _not_open(conn: Connection, batches: Table, batch_id: int) -> BatchClosed | BatchNotFound:
    """Why the batch took no member: it is closed, or there is no such batch (one SELECT, on refusal only)."""
    closed_at = conn.execute(select(batches.c.closed_at).where(batches.c.id == batch_id)).first()
    if closed_at is None:
        return BatchNotFound(batch_id)
    return BatchClosed(batch_id)


def count_flushed_members(
    session: Session, flush_context: UOWTransaction, instances: Iterable[Any] | None
) -> None:
    """``before_flush``: the new task rows with a ``batch_id`` counted into their batches, before any INSERT.

    A loaded row's ``batch_id`` cannot change: a task's batch is fixed when
    it is enqueued, since its batch has counted it.
    """
    counts: dict[Table, Counter[int]] = {}
    for instance in session.new:
        if isinstance(instance, TaskMixin):
            values = inspect(instance).dict
            batch_id = values.get("batch_id")
            if batch_id is not None:
                if values.get("unique_key") is not None:
                    raise ValueError(
                        "a batch member cannot have a unique key: a held key would leave it outside the batch"
                    )
                table = type(instance).__table__  # type: ignore[attr-defined]
                counts.setdefault(table, Counter())[check_batch_id(batch_id)] += 1
    for instance in session.dirty:
        if isinstance(instance, TaskMixin):
            attribute = inspect(instance).attrs.get("batch_id")
            if attribute is not None and attribute.history.added:
                raise ValueError(
                    f"task {instance.id}: batch_id is fixed when a task is enqueued (its batch counted "
                    "it then); enqueue a new task into the batch instead"
                )
    for table, per_batch in counts.items():
        count_members(session.connection(bind_arguments={"clause": table}), table, per_batch)


__all__ = [
    "add_members_statement",
    "check_batch_id",
    "count_finished_at_insert",
    "count_flushed_finished_members",
    "count_flushed_members",
    "count_members",
    "uncount_members",
]
