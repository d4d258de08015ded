"""Dependencies: a task enqueued with ``depends_on`` waits until every parent has finished.

At enqueue, in the caller's transaction (`decide`, then `link`):

1. ``has_dependents`` is set on the parents not yet finished, by one
   UPDATE that also locks them; the parents are then read with a locking
   read, in id order.  (The UPDATE comes first so that on SQLite, where a
   read before the first write runs outside the write transaction, the
   read sees what the write lock keeps; on MySQL and MariaDB a locking read
   reads the latest row whatever the isolation level.)  A parent that does
   not exist is `ParentNotFound`, raised before the task is written.
2. The task's status follows: WAITING, with ``parents_pending`` counting the
   unfinished parents, while any is unfinished; else QUEUED when all
   completed (or the policy is ``"run"``); else CANCELLED, its
   ``last_error`` naming the parent that failed or was cancelled.  A parent
   already failed or cancelled cancels a task with the ``"cancel"`` policy
   at once, whatever its other parents.
3. One edge per parent goes into ``<task table>_dependencies``.

A running parent's completion cannot miss the new dependent: the flag is
set under the parent's row lock, and the parent's plain final write is
guarded by ``has_dependents IS NULL`` (`sa_taskqueue.strategies.lease`), so
it is written through the workflow path, which releases the dependent.  A
parent that finished before the flag was set is read finished, and counted so.

Cycles cannot happen: a task's parents exist before it does, and its edges
never change afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Table, event, func, insert, inspect, select, update
from sqlalchemy.orm import Session, UOWTransaction

from sa_taskqueue.core.bulk_insert import insert_rows
from sa_taskqueue.core.dependency_table import dependency_table_of
from sa_taskqueue.core.exceptions import ParentNotFound
from sa_taskqueue.core.model import FINISHED_STATUSES, PARENTS_KEY, TaskMixin, TaskStatus
from sa_taskqueue.core.task_rows import TaskRows
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features.workflows.bookkeeping import CANCEL, POLICIES, RUN, parent_failed_error

#: Where it keeps, between ``before_flush`` and ``after_flush``, what its edges need.
LINK_KEY = "_sa_taskqueue_depends_link"


def check_policy(on_parent_failure: Any) -> str | None:
    """``on_parent_failure`` checked: None (the default, ``"cancel"``), ``"cancel"`` or ``"run"``."""
    if on_parent_failure is None or on_parent_failure in POLICIES:
        return on_parent_failure  # type: ignore[no-any-return]
    raise ValueError(
        f"on_parent_failure must be 'cancel' (the default: a parent that fails or is cancelled cancels "
        f"the task) or 'run' (the task runs once its parents have finished, however), "
        f"got {on_parent_failure!r}"
    )


@dataclass(frozen=True)
class Decision:
    """What a new dependent's row holds, decided under its parents' locks; and its edges' parents."""

    status: TaskStatus
    parents_pending: int | None
    last_error: str | None
    finished_at: datetime | None

    def values(self) -> dict[str, Any]:
        """The columns to write into the new row."""
        values: dict[str, Any] = {"status": self.status, "parents_pending": self.parents_pending}
        if self.status is TaskStatus.CANCELLED:
            values.update(last_error=self.last_error, finished_at=self.finished_at)
        return values


def decide(
    conn: Connection,
    table: Table,
    parent_ids: Sequence[int],
    new_parents: int,
    policy: str | None,
    now: datetime,
) -> Decision:
    """Lock the existing parents ``parent_ids`` and decide a new dependent's status (see the module).

    ``new_parents`` counts parents created in the same flush (unfinished by
    nature; their flag is set on their own new rows).
    """
    ids = sorted(set(parent_ids))
    found: dict[int, TaskStatus] = {}
    if ids:
        conn.execute(
            update(table)
            .where(
                table.c.id.in_(ids),
                table.c.status.not_in([status.value for status in FINISHED_STATUSES]),
                table.c.has_dependents.is_(None),
            )
            .values(has_dependents=True)
        )
        rows = conn.execute(
            select(table.c.id, table.c.status)
            .where(table.c.id.in_(ids))
            .order_by(table.c.id)
            .with_for_update()
        ).all()
        found = {row[0]: TaskStatus(row[1]) for row in rows}
        missing = [parent_id for parent_id in ids if parent_id not in found]
        if missing:
            _unflag(conn, table, sorted(found))
            raise ParentNotFound(missing[0])
    failed = [
        (parent_id, status)
        for parent_id, status in found.items()
        if status in (TaskStatus.FAILED, TaskStatus.CANCELLED)
    ]
    if failed and (policy or CANCEL) != RUN:
        parent_id, status = failed[0]
        return Decision(TaskStatus.CANCELLED, None, parent_failed_error(parent_id, status), now)
    pending = new_parents + sum(1 for status in found.values() if status not in FINISHED_STATUSES)
    if pending:
        return Decision(TaskStatus.WAITING, pending, None, None)
    return Decision(TaskStatus.QUEUED, None, None, None)


def _unflag(conn: Connection, table: Table, parent_ids: Sequence[int]) -> None:
    """Take back the flag of refused parents that no edge names: nothing of a refused enqueue stays.

    The parents are locked by this transaction, so another enqueue that
    flagged one has committed its edges by now, and keeps its flag.
    """
    if not parent_ids:
        return
    deps = dependency_table_of(table)
    conn.execute(
        update(table)
        .where(
            table.c.id.in_(parent_ids),
            table.c.has_dependents.is_not(None),
            ~select(deps.c.parent_id).where(deps.c.parent_id == table.c.id).exists(),
        )
        .values(has_dependents=None)
    )


def reopened(conn: Connection, table: Table, task_ids: Sequence[int]) -> None:
    """Finished tasks ``task_ids`` that ``conn``'s transaction queues again (a retry): undo their end.

    Their end took each one off the count of its waiting children (`bookkeeping.release`),
    which will count its next end again: each such child gets one back per edge, so the two
    ends count once between them.  (Children its end cancelled, or released to run, stay as
    they are.)  And a retried task that has parents of its own waits again for those not
    finished, read under their locks as `decide` reads them, rather than run before them.
    """
    ids = sorted(set(task_ids))
    # (A retry of every failed task can name many: a few hundred ids a statement.)
    for start in range(0, len(ids), REOPENED_CHUNK):
        _reopened(conn, table, ids[start : start + REOPENED_CHUNK])


#: The most retried tasks `reopened` names in one statement.
REOPENED_CHUNK = 500


def _reopened(conn: Connection, table: Table, ids: Sequence[int]) -> None:
    deps = dependency_table_of(table)
    edges_back = (
        select(func.count())
        .select_from(deps)
        .where(deps.c.child_id == table.c.id, deps.c.parent_id.in_(ids))
        .scalar_subquery()
    )
    conn.execute(
        update(table)
        .where(
            table.c.id.in_(select(deps.c.child_id).where(deps.c.parent_id.in_(ids))),
            table.c.status == TaskStatus.WAITING.value,
        )
        .values(parents_pending=table.c.parents_pending + edges_back)
    )
    edges = conn.execute(select(deps.c.child_id, deps.c.parent_id).where(deps.c.child_id.in_(ids))).all()
    if not edges:
        return
    parent_ids = sorted({parent_id for _child, parent_id in edges})
    statuses = dict(
        conn.execute(
            select(table.c.id, table.c.status)
            .where(table.c.id.in_(parent_ids))
            .order_by(table.c.id)
            .with_for_update()
        ).all()
    )
    pending: dict[int, int] = {}
    for child_id, parent_id in edges:
        status = statuses.get(parent_id)
        if status is not None and TaskStatus(status) not in FINISHED_STATUSES:
            pending[child_id] = pending.get(child_id, 0) + 1
    for child_id, count in sorted(pending.items()):
        conn.execute(
            update(table)
            .where(table.c.id == child_id, table.c.status == TaskStatus.QUEUED.value)
            .values(status=TaskStatus.WAITING, parents_pending=count)
        )


def link(conn: Connection, table: Table, edges: Sequence[tuple[int, int]]) -> None:
    """Insert the edges (parent id, child id) of new dependents."""
    if edges:
        deps = dependency_table_of(table)
        conn.execute(
            insert(deps), [{"parent_id": parent, "child_id": child} for parent, child in sorted(set(edges))]
        )


def parent_results(engine: Engine, table: Table, task_id: int) -> dict[int, Any]:
    """The results of task ``task_id``'s parents, by parent id (None for one that stored none)."""
    deps = dependency_table_of(table)
    with engine.connect() as conn:
        rows = conn.execute(
            select(table.c.id, table.c.result)
            .select_from(table.join(deps, deps.c.parent_id == table.c.id))
            .where(deps.c.child_id == task_id)
            .order_by(table.c.id)
        ).all()
    return {row[0]: row[1] for row in rows}


def parent_ids_of(session: Session, parents: Sequence[TaskMixin | int]) -> list[int]:
    """The ids of ``parents``, flushing ``session`` first if some task row among them has none yet."""
    if any(isinstance(parent, TaskMixin) and inspect(parent).identity is None for parent in parents):
        for parent in parents:
            if isinstance(parent, TaskMixin) and parent not in session:
                raise ValueError(
                    f"depends_on holds a task row that is not in this session ({parent!r}): "
                    "add it to the session (or enqueue it) first, or pass its id"
                )
        session.flush()
    ids: list[int] = []
    for parent in parents:
        if isinstance(parent, TaskMixin):
            identity = inspect(parent).identity
            assert identity is not None  # (flushed above)
            ids.append(identity[0])
        else:
            ids.append(parent)
    return ids


def insert_dependents(
    session: Session,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    parents: Sequence[TaskMixin | int],
    policy: str | None,
    now: datetime,
    chunk_size: int,
) -> tuple[list[int], TaskStatus]:
    """``enqueue_many``'s rows, all depending on ``parents``: their ids, and the status they got.

    One decision for all (the parents' locks are taken once).  Where a
    multi-row INSERT cannot return its ids (MySQL), one INSERT per row: the
    edges need them.
    """
    parent_ids = parent_ids_of(session, parents)
    conn = session.connection(bind_arguments={"clause": table})
    decision = decide(conn, table, parent_ids, 0, policy, now)
    extra = {**decision.values(), "on_parent_failure": policy}
    if isinstance(rows, TaskRows):
        rows = TaskRows({**rows.shared, **extra}, rows.varying)
    else:
        rows = [{**row, **extra} for row in rows]
    ids = insert_rows(conn, table, rows, chunk_size=chunk_size)
    if ids is None:
        ids = [_insert_one(conn, table, row) for row in rows]
    link(conn, table, [(parent, child) for child in ids for parent in parent_ids])
    return ids, decision.status


def _insert_one(conn: Connection, table: Table, row: Mapping[str, Any]) -> int:
    key = conn.execute(insert(table), dict(row)).inserted_primary_key
    assert key is not None  # (an INSERT of one row knows its id)
    return int(key[0])


# Task rows added to a session with depends_on ---------------------------------------


def _before_flush(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    """Decide each new dependent's status under its parents' locks, before any row is inserted."""
    children = [
        instance
        for instance in session.new
        if isinstance(instance, TaskMixin) and instance.__dict__.get(PARENTS_KEY)
    ]
    for child in children:
        table: Table = type(child).__table__  # type: ignore[attr-defined]
        state = inspect(child)
        if state.dict.get("unique_key") is not None:
            raise ValueError(
                "a task with a unique_key cannot have depends_on: its key is held only while it is queued "
                "or running, and a waiting task released later could clash with another holding it"
            )
        existing: list[int] = []
        new: list[TaskMixin] = []
        for parent in child.__dict__[PARENTS_KEY]:
            if not isinstance(parent, TaskMixin):
                existing.append(parent)
                continue
            parent_state = inspect(parent)
            if parent_state.identity is not None:
                existing.append(parent_state.identity[0])
            elif parent in session.new:
                new.append(parent)
            else:
                raise ValueError(
                    f"depends_on holds a task row that is not in this session ({parent!r}): "
                    "add it to the session (or enqueue it) first, or pass its id"
                )
        policy = check_policy(state.dict.get("on_parent_failure"))
        conn = session.connection(bind_arguments={"clause": table})
        decision = decide(conn, table, existing, len(new), policy, utcnow())
        for name, value in decision.values().items():
            setattr(child, name, value)
        for parent in new:
            parent.has_dependents = True
        child.__dict__[LINK_KEY] = (existing, new)


def _after_flush(session: Session, flush_context: UOWTransaction) -> None:
    """Insert the edges of the dependents just inserted (their ids, and new parents', known now)."""
    per_table: dict[Table, list[tuple[int, int]]] = {}
    for instance in session.new:
        if not isinstance(instance, TaskMixin):
            continue
        link_of = instance.__dict__.pop(LINK_KEY, None)
        if link_of is None:
            continue
        existing, new = link_of
        # (The identity keys are set once the flush ends; the ids are in the rows' dicts now.)
        child_id = inspect(instance).dict["id"]
        parents = [*existing, *(inspect(parent).dict["id"] for parent in new)]
        table: Table = type(instance).__table__  # type: ignore[attr-defined]
        per_table.setdefault(table, []).extend((parent, child_id) for parent in parents)
    for table, edges in per_table.items():
        link(session.connection(bind_arguments={"clause": table}), table, edges)


def listen() -> None:
    """Register the flush listeners on the `Session` class (once: repeats are ignored)."""
    if not event.contains(Session, "before_flush", _before_flush):
        event.listen(Session, "before_flush", _before_flush)
    if not event.contains(Session, "after_flush", _after_flush):
        event.listen(Session, "after_flush", _after_flush)


listen()

__all__ = [
    "Decision",
    "check_policy",
    "decide",
    "insert_dependents",
    "link",
    "listen",
    "parent_ids_of",
    "parent_results",
]
