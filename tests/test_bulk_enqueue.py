"""Bulk enqueue at the driver's fastest path: COPY on PostgreSQL (psycopg 3), multi-row VALUES elsewhere.

Each batch here crosses ``COPY_THRESHOLD``, so PostgreSQL takes the COPY;
the smaller batches of tests/test_enqueue.py take ``unnest``.
"""

from __future__ import annotations

import gc

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

import sa_taskqueue as tq
from sa_taskqueue.core.bulk_insert import COPY_THRESHOLD
from tests.backends import Backend
from tests.helpers import listening, received

#: Rows per batch: past the COPY threshold, and more than one chunk of CHUNK.
ROWS = max(3 * COPY_THRESHOLD, 1200)
CHUNK = 500


def stored(engine: sa.Engine) -> list[sa.Row[tuple[int, dict[str, int], str]]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(tq.Task.id, tq.Task.params, tq.Task.queue).order_by(tq.Task.id)))


def test_a_large_batch_returns_its_ids_in_input_order(default_queue: tq.TaskQueue, engine: sa.Engine) -> None:
    keys = [(n * 7919) % ROWS for n in range(ROWS)]  # not in id order, so order is what is checked
    with Session(engine) as session:
        ids = default_queue.enqueue_many(session, "record", [{"key": k} for k in keys], chunk_size=CHUNK)
        session.commit()
    rows = stored(engine)
    assert sorted(row.params["key"] for row in rows) == sorted(keys)
    if ids is None:  # MySQL cannot return ids from a multi-row INSERT
        assert engine.dialect.name == "mysql" and not engine.dialect.insert_returning
        return
    assert len(set(ids)) == ROWS
    by_id = {row.id: row.params["key"] for row in rows}
    assert [by_id[task_id] for task_id in ids] == keys
    assert ids == sorted(ids), "ids ascend with the rows, as the claim's order by id expects"


def test_a_bad_row_late_in_a_large_batch_writes_nothing_and_keeps_the_callers_transaction(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    params: list[dict[str, object]] = [{"key": n} for n in range(ROWS)]
    params[-1] = {"key": float("nan")}
    with Session(engine) as session:
        kept = default_queue.enqueue(session, "record", {"key": -1}, queue="callers").id
        with pytest.raises(ValueError, match="params"):
            default_queue.enqueue_many(session, "record", params)
        session.commit()  # the caller's own write is still there to commit
    assert [(row.id, row.queue) for row in stored(engine)] == [(kept, "callers")]


def test_a_large_batch_commits_and_rolls_back_with_the_callers_transaction(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session:
        default_queue.enqueue_many(session, "record", [{"key": n} for n in range(ROWS)], queue="gone")
        session.rollback()
        assert stored(engine) == []
        default_queue.enqueue(session, "record", {"key": -1}, queue="mine")
        default_queue.enqueue_many(session, "record", [{"key": n} for n in range(ROWS)], queue="bulk")
        assert stored(engine) == [], "nothing is visible before the caller commits"
        session.commit()
    queues = [row.queue for row in stored(engine)]
    assert queues.count("mine") == 1 and queues.count("bulk") == ROWS and "gone" not in queues


@pytest.mark.requires("notify")
def test_a_copied_batch_wakes_workers_at_commit(
    backend: Backend, default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    with listening(backend, tq.Task.__table__) as listener, Session(engine) as session:
        default_queue.enqueue_many(session, "record", [{"key": n} for n in range(ROWS)], queue="bulk")
        assert received(listener, 0.2) == [], "nothing before the commit"
        session.commit()
        assert received(listener) == ["bulk"]


def test_unique_keys_in_a_large_batch_keep_their_first_task(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    @default_queue.task(name="keyed", unique_by=("group",))
    def keyed(group: int) -> None:
        del group

    groups = [n % 60 for n in range(COPY_THRESHOLD * 2)]
    with Session(engine) as session:
        ids = default_queue.enqueue_many(session, "keyed", [{"group": g} for g in groups])
        session.commit()
    assert ids is not None and len(ids) == len(groups)
    assert ids[60:] == ids[: len(groups) - 60], "a later row whose key is held gets the holder's id"
    assert len(stored(engine)) == 60


def test_statements_other_than_the_copy_stay_visible_to_cursor_events(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    statements: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        with Session(engine) as session:
            default_queue.enqueue_many(session, "record", [{"key": n} for n in range(ROWS)])
            session.commit()
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    if engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg":
        assert any("nextval" in statement for statement in statements), statements
    else:
        assert any(statement.lstrip().upper().startswith("INSERT") for statement in statements), statements


class CheckedBase(DeclarativeBase):
    pass


class CheckedTask(tq.TaskMixin, CheckedBase):
    """A task table whose database refuses what the queue does not check: priorities of 5 and up."""

    __tablename__ = "checked_tasks"


@pytest.mark.backends("postgres", "postgres18")
def test_a_database_error_in_the_copy_is_sqlalchemys_error_and_rolls_back_cleanly(engine: sa.Engine) -> None:
    CheckedBase.metadata.drop_all(engine)
    CheckedBase.metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE checked_tasks ADD CONSTRAINT low_priority CHECK (priority < 5)")
        queue = tq.TaskQueue(engine, model=CheckedTask)
        queue.task(name="noop")(lambda n: None)
        with Session(engine) as session:
            with pytest.raises(sa.exc.IntegrityError, match="low_priority"):
                queue.enqueue_many(session, "noop", [{"n": n} for n in range(ROWS)], priority=7)
            session.rollback()
            ids = queue.enqueue_many(session, "noop", [{"n": n} for n in range(ROWS)])
            session.commit()
        assert ids is not None and len(ids) == ROWS
    finally:
        CheckedBase.metadata.drop_all(engine)


def test_a_large_batch_keeps_no_object_per_row_alive_while_it_is_sent(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    """Objects alive across the insert, one per row, would set off the interpreter's full collection.

    Every container the interpreter tracks counts towards its next
    collection until it is freed; enough of them alive at once start a
    collection, and with many a full one, a pass over every object of the
    application.  Counted with a threshold far below the rows: the rows of a
    batch pass through without one.
    """
    rows = 20 * ROWS
    params = [{"key": n} for n in range(rows)]
    collections: list[int] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled(), "with the collector off nothing would be counted"
    with Session(engine) as session:
        session.connection()  # the connection's own setup is not the batch's
        thresholds = gc.get_threshold()
        gc.collect()
        gc.set_threshold(ROWS // 2, 10, 10)
        gc.callbacks.append(counted)
        try:
            default_queue.enqueue_many(session, "record", params)
        finally:
            gc.callbacks.remove(counted)
            gc.set_threshold(*thresholds)
        session.commit()
    assert len(stored(engine)) == rows
    assert len(collections) <= 2, f"{len(collections)} collections while {rows} rows were sent"
