"""The bookkeeping every final transition of a workflow task goes through, in the transaction of its write.

`after_final` is called with the tasks whose final status (completed,
failed, cancelled) the caller's transaction has just written, under their
claim's fence or as a cancel: a worker's completion or failure (alone or
batched, sync or async, with the next claim or not), a transactional task's
completion (in the task's own transaction), lease recovery that ends in
FAILED, a cancel.  In that same transaction it:

- releases the dependents of each completed task: one UPDATE of the children
  still waiting, taking one from ``parents_pending`` per finished parent and
  moving to QUEUED those with none left;
- for each failed or cancelled task, cancels its waiting dependents whose
  policy is ``"cancel"`` (the default), naming the parent in their
  ``last_error``, and releases those whose policy is ``"run"`` as above;
  the cancelled ones go round the loop in turn (their own dependents, their
  batches), until no task is left to settle;
- counts every finished member of a batch into it (`batches.members_finished`).

The decrement of a child serialises on the child row's lock: two parents
finishing at once in two transactions both count, and exactly the second
one releases the child.  A task whose transaction rolls back releases and
counts nothing, as its final write is undone with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, case, func, literal_column, or_, select, update

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.dependency_table import dependency_table_of
from sa_taskqueue.core.finished import FinishedTask, notify_finished
from sa_taskqueue.core.model import FINISHED_STATUSES, TaskStatus, has_status
from sa_taskqueue.core.notify import channel_name
from sa_taskqueue.features.workflows import batches

#: The most parents one statement names (a cascade can settle many at once).
CHUNK = 500
#: The ``on_parent_failure`` policy that runs a task whatever its parents' outcome.
RUN = "run"
#: The default policy: a failed or cancelled parent cancels the task.
CANCEL = "cancel"
POLICIES = (CANCEL, RUN)


def after_final(conn: Connection, table: Table, finished: Sequence[FinishedTask], now: datetime) -> None:
    """Release or cancel the dependents of ``finished``, count the batch members: in ``conn``'s transaction.

    ``finished``: tasks whose final status this transaction wrote, each once
    (`FinishedTask`: id, status, batch_id, has_dependents, where
    has_dependents None means "not known": the children are looked for).
    """
    worklist = [task for task in finished if task.status in FINISHED_STATUSES]
    members: list[FinishedTask] = []
    while worklist:
        members.extend(task for task in worklist if task.batch_id is not None)
        parents = [task for task in worklist if task.has_dependents is not False]
        worklist = []
        for start in range(0, len(parents), CHUNK):
            worklist.extend(_settle_children(conn, table, parents[start : start + CHUNK], now))
    if members:
        batches.members_finished(conn, table, members, now)


def _settle_children(
    conn: Connection, table: Table, parents: Sequence[FinishedTask], now: datetime
) -> list[FinishedTask]:
    """The children of ``parents``: cancelled or released; the ones cancelled now, to settle in turn."""
    failed = [parent for parent in parents if parent.status != TaskStatus.COMPLETED]
    cancelled = _cancel_children(conn, table, failed, now) if failed else []
    # What is still waiting among the children is released by every parent:
    # by a completed one always, by a failed one only where the policy is
    # "run" (the others were cancelled just now).
    release(conn, table, [parent.id for parent in parents])
    return cancelled


def release(conn: Connection, table: Table, parent_ids: Sequence[int]) -> None:
    """Take each finished parent in ``parent_ids`` off its waiting children's count; queue those at none.

    One UPDATE; a child with two parents among them loses two.
    """
    deps = dependency_table_of(table)
    edges = (
        select(func.count())
        .select_from(deps)
        .where(deps.c.child_id == table.c.id, deps.c.parent_id.in_(parent_ids))
        .scalar_subquery()
    )
    statement = (
        update(table)
        .where(
            table.c.id.in_(select(deps.c.child_id).where(deps.c.parent_id.in_(parent_ids))),
            has_status(table, TaskStatus.WAITING),
        )
        # The status first, computed from parents_pending as it was: MySQL and
        # MariaDB evaluate a single-table UPDATE's assignments left to right,
        # each seeing the values assigned before it; the others all see the
        # row as it was.  Ordered, both read the old count.
        .ordered_values(
            (
                table.c.status,
                case(
                    (table.c.parents_pending <= edges, literal_column(f"'{TaskStatus.QUEUED.value}'")),
                    else_=table.c.status,
                ),
            ),
            (table.c.parents_pending, table.c.parents_pending - edges),
        )
    )
    backend = backend_for(conn.dialect)
    if not backend.notify:
        conn.execute(statement)
        return
    # PostgreSQL: wake the workers of the queues that got tasks, at commit, as an enqueue does.
    rows = conn.execute(statement.returning(table.c.queue, table.c.status)).all()
    queues = sorted({row[0] for row in rows if TaskStatus(row[1]) is TaskStatus.QUEUED})
    for queue in queues:
        conn.execute(select(func.pg_notify(channel_name(table), queue)))


def _cancel_children(
    conn: Connection, table: Table, failed: Sequence[FinishedTask], now: datetime
) -> list[FinishedTask]:
    """Cancel the waiting children of ``failed`` whose policy is not "run"; those cancelled."""
    deps = dependency_table_of(table)
    parent_ids = [parent.id for parent in failed]
    rows = conn.execute(
        select(table.c.id, table.c.on_parent_failure, table.c.batch_id, table.c.has_dependents)
        .select_from(table.join(deps, deps.c.child_id == table.c.id))
        .where(deps.c.parent_id.in_(parent_ids), has_status(table, TaskStatus.WAITING))
        .order_by(table.c.id)
        # Locked, in id order: a child another parent's transaction cancels or
        # releases meanwhile is read as that one leaves it.  The edges are
        # joined, not read in a subquery, so that the locking read covers them
        # too: MySQL's and MariaDB's locking read reads the latest rows whatever
        # the isolation level, where a subquery would read REPEATABLE READ's
        # snapshot and miss an edge to a grandchild enqueued since.
        .with_for_update()
    ).all()
    # (A child of two of these parents comes once per edge; FOR UPDATE allows no DISTINCT.)
    children = list({row[0]: row for row in rows}.values())
    doomed = [row for row in children if (row[1] or CANCEL) != RUN]
    if not doomed:
        return []
    doomed_ids = [row[0] for row in doomed]
    # Which failed parent each is cancelled for (the lowest id, if several).
    blamed: dict[int, int] = dict(
        conn.execute(
            select(deps.c.child_id, func.min(deps.c.parent_id))
            .where(deps.c.parent_id.in_(parent_ids), deps.c.child_id.in_(doomed_ids))
            .group_by(deps.c.child_id)
        ).all()
    )
    outcome = {parent.id: TaskStatus(parent.status) for parent in failed}
    by_parent: dict[int, list[int]] = {}
    for child_id in doomed_ids:
        by_parent.setdefault(blamed[child_id], []).append(child_id)
    for parent_id, child_ids in sorted(by_parent.items()):
        conn.execute(
            update(table)
            .where(table.c.id.in_(child_ids), has_status(table, TaskStatus.WAITING))
            .values(
                status=TaskStatus.CANCELLED,
                finished_at=now,
                last_error=parent_failed_error(parent_id, outcome[parent_id]),
            )
        )
    notify_finished(conn, table, doomed_ids)
    return [FinishedTask(row[0], TaskStatus.CANCELLED, row[2], bool(row[3])) for row in doomed]


def cancelled_now(conn: Connection, table: Table, task_ids: Sequence[int], now: datetime) -> None:
    """Tasks ``conn``'s transaction has just cancelled before they ran: `after_final` for the workflow ones.

    One SELECT of their batch and dependents flag (the rows are locked by the
    cancel's UPDATE); nothing more for a plain task.
    """
    rows = conn.execute(
        select(table.c.id, table.c.status, table.c.batch_id, table.c.has_dependents).where(
            table.c.id.in_(sorted(task_ids)),
            or_(table.c.batch_id.is_not(None), table.c.has_dependents.is_not(None)),
        )
    ).all()
    if rows:
        after_final(conn, table, finished_rows(rows), now)


def parent_failed_error(parent_id: int, status: TaskStatus) -> str:
    """The ``last_error`` of a task cancelled because a parent did not complete."""
    ended = "failed" if status is TaskStatus.FAILED else "was cancelled"
    return (
        f"cancelled: parent task {parent_id} {ended} "
        f"(on_parent_failure='cancel'; enqueue with on_parent_failure='run' to run it anyway)"
    )


def finished_rows(rows: Sequence[Any]) -> list[FinishedTask]:
    """(id, status, batch_id, has_dependents) rows read under the rows' locks, as `FinishedTask`s."""
    return [FinishedTask(row[0], TaskStatus(row[1]), row[2], bool(row[3])) for row in rows]


__all__ = [
    "CANCEL",
    "POLICIES",
    "RUN",
    "after_final",
    "cancelled_now",
    "finished_rows",
    "parent_failed_error",
    "release",
]
