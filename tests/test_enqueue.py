"""Enqueueing happens in the application's own transaction, and bad input never reaches the database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sa_taskqueue as tq


def count_tasks(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).select_from(tq.Task)) or 0


def test_a_committed_enqueue_is_a_task(queue: tq.TaskQueue, engine: sa.Engine, session: Session) -> None:
    task = queue.enqueue(session, "record", {"key": 1})
    assert task.id is not None, "enqueue flushes, so the id is known before commit"
    assert count_tasks(engine) == 0, "nothing is visible before the caller commits"
    session.commit()
    assert count_tasks(engine) == 1


def test_a_rolled_back_enqueue_leaves_no_task(
    queue: tq.TaskQueue, engine: sa.Engine, session: Session
) -> None:
    queue.enqueue(session, "record", {"key": 1})
    session.add(tq.Task(name="record", params={"key": 2}))
    session.flush()
    session.rollback()
    assert count_tasks(engine) == 0


def test_session_add_of_a_task_uses_the_documented_defaults(
    queue: tq.TaskQueue, engine: sa.Engine, session: Session
) -> None:
    before = datetime.now(UTC)
    session.add(tq.Task(name="record", params={"key": 1}))
    session.commit()
    with Session(engine) as fresh:
        task = fresh.scalars(sa.select(tq.Task)).one()
    assert task.queue == "default"
    assert task.priority == 0
    assert task.status == tq.TaskStatus.QUEUED
    assert task.attempts == 0
    assert task.max_attempts == 3
    assert task.params == {"key": 1}
    assert task.result is None
    assert task.run_at.tzinfo is not None and task.run_at.utcoffset() == timedelta(0)
    assert task.created_at.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= task.run_at <= datetime.now(UTC) + timedelta(seconds=1)


def test_decorated_function_still_runs_and_enqueues_under_its_name(
    queue: tq.TaskQueue, engine: sa.Engine, session: Session
) -> None:
    @queue.task(queue="mail", priority=5, max_attempts=7)
    def send_email(to: str) -> str:
        return f"sent to {to}"

    assert send_email("a@example.com") == "sent to a@example.com"
    assert (
        send_email.name
        == f"{__name__}.test_decorated_function_still_runs_and_enqueues_under_its_name.<locals>.send_email"
    )
    task = send_email.enqueue(session, to="a@example.com")
    session.commit()
    assert (task.name, task.queue, task.priority, task.max_attempts) == (send_email.name, "mail", 5, 7)
    assert task.params == {"to": "a@example.com"}


def test_enqueue_overrides_the_registered_defaults(queue: tq.TaskQueue, session: Session) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    task = queue.enqueue(session, "record", {"key": 1}, queue="q2", priority=-3, run_at=later, max_attempts=1)
    session.commit()
    session.refresh(task)
    assert (task.queue, task.priority, task.max_attempts) == ("q2", -3, 1)
    assert abs(task.run_at - later) < timedelta(milliseconds=1)


@pytest.mark.parametrize(
    ("arguments", "error", "names"),
    [
        ({"name": "os.system"}, ValueError, "name"),
        ({"name": "record", "params": ["not", "a", "dict"]}, TypeError, "params"),
        ({"name": "record", "params": {"when": datetime.now(UTC)}}, TypeError, "params"),
        ({"name": "record", "params": {1: "int key"}}, TypeError, "params"),
        ({"name": "record", "run_at": datetime(2030, 1, 1)}, ValueError, "run_at"),
        ({"name": "record", "max_attempts": -1}, ValueError, "max_attempts"),
        ({"name": "record", "priority": "high"}, TypeError, "priority"),
        ({"name": "record", "queue": ""}, ValueError, "queue"),
    ],
)
def test_bad_arguments_are_refused_before_touching_the_database(
    queue: tq.TaskQueue,
    engine: sa.Engine,
    session: Session,
    arguments: dict[str, object],
    error: type[Exception],
    names: str,
) -> None:
    statements: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        with pytest.raises(error, match=names):
            queue.enqueue(session, **arguments)  # type: ignore[arg-type]
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    assert statements == []
    assert not session.new, "nothing half-written is left in the session"


def test_enqueue_many_inserts_in_the_callers_transaction_and_returns_ids(
    queue: tq.TaskQueue, engine: sa.Engine, session: Session
) -> None:
    ids = queue.enqueue_many(session, "record", ({"key": n} for n in range(2500)), priority=2)
    assert count_tasks(engine) == 0, "nothing is visible before the caller commits"
    session.commit()
    with Session(engine) as fresh:
        rows = fresh.execute(
            sa.select(tq.Task.id, tq.Task.params, tq.Task.priority).order_by(tq.Task.id)
        ).all()
    assert [row.params["key"] for row in rows] == list(range(2500))
    assert {row.priority for row in rows} == {2}
    if engine.dialect.insert_executemany_returning:
        assert ids == [row.id for row in rows]
    else:  # MySQL cannot return ids from a multi-row INSERT (MariaDB 10.5+ can)
        assert ids is None


class TenantBase(DeclarativeBase):
    pass


class TenantTask(tq.TaskMixin, TenantBase):
    """An application's task table with a column of its own, filled by a client-side default."""

    __tablename__ = "tenant_tasks"
    tenant: Mapped[str] = mapped_column(sa.String(20), default="acme")


def test_enqueue_many_fills_an_application_tables_own_defaults(engine: sa.Engine) -> None:
    TenantBase.metadata.drop_all(engine)
    TenantBase.metadata.create_all(engine)
    try:
        queue = tq.TaskQueue(engine, model=TenantTask)
        queue.task(name="noop")(lambda n: None)
        with Session(engine) as session:
            ids = queue.enqueue_many(session, "noop", [{"n": n} for n in range(1500)], chunk_size=700)
            session.commit()
        with Session(engine) as session:
            rows = session.execute(sa.select(TenantTask.id, TenantTask.params, TenantTask.tenant)).all()
        assert sorted(row.params["n"] for row in rows) == list(range(1500))
        assert {row.tenant for row in rows} == {"acme"}
        if ids is not None:
            assert ids == [row.id for row in sorted(rows, key=lambda row: row.params["n"])]
    finally:
        TenantBase.metadata.drop_all(engine)


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True])
def test_enqueue_many_refuses_a_chunk_size_that_is_not_a_positive_integer(
    queue: tq.TaskQueue, engine: sa.Engine, session: Session, chunk_size: object
) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        queue.enqueue_many(session, "record", [{"key": 1}], chunk_size=chunk_size)  # type: ignore[arg-type]
    session.commit()
    assert count_tasks(engine) == 0


def test_enqueue_many_checks_every_row_before_writing_any(
    queue: tq.TaskQueue, engine: sa.Engine, session: Session
) -> None:
    with pytest.raises(TypeError, match="params"):
        queue.enqueue_many(session, "record", [{"key": 1}, {"key": 2}, {"when": object()}])
    session.commit()
    assert count_tasks(engine) == 0
