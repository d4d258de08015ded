"""``session.add(Task(...))``: checked before the flush like ``enqueue``; on PostgreSQL, a NOTIFY at commit.

A refused row raises before any SQL: nothing is written, the caller's
transaction (with what it had already flushed) stays open and usable, and
the refused row stays in the session as the caller left it, so the next
flush refuses it again until it is fixed, expunged or rolled back.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session, sessionmaker

import sa_taskqueue as tq
from tests.app import executions
from tests.backends import Backend
from tests.helpers import StreamLines, listening, received, start_cli, task_row, task_rows, wait_until
from tests.test_runtime import logged_at, long_idle_wait


def nested(depth: int) -> list[Any]:
    """A list ``depth`` lists deep: with params itself, one level past what MariaDB takes."""
    value: list[Any] = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


#: (field, value, error, what the message says): one row field set to one bad value each.
REFUSED: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"name": None}, TypeError, "name must be set"),
    ({"name": 5}, TypeError, "name must be a string"),
    ({"name": ""}, ValueError, "name must be a non-empty string"),
    ({"name": "n" * 256}, ValueError, "name must be a non-empty string of at most 255"),
    ({"name": "a\x00b"}, ValueError, "name holds"),
    ({"queue": 7}, TypeError, "queue must be a string"),
    ({"queue": "q" * 101}, ValueError, "queue must be a non-empty string of at most 100"),
    ({"queue": "\ud800"}, ValueError, "queue holds"),
    ({"params": [1, 2]}, TypeError, "params must be a dict"),
    ({"params": {1: "x"}}, TypeError, "keys must be strings"),
    ({"params": {"x": float("nan")}}, ValueError, r"params\['x'\]: numbers must be finite"),
    ({"params": {"x": [2**70]}}, ValueError, r"params\['x'\]\[0\]: integers must fit in 64 bits"),
    ({"params": {"x": object()}}, TypeError, "object is not a JSON value"),
    ({"params": {"x": "\x00"}}, ValueError, "the string holds"),
    ({"params": {"x": nested(31)}}, ValueError, "nested more than 31"),
    ({"priority": "1"}, TypeError, "priority must be an integer"),
    ({"priority": True}, TypeError, "priority must be an integer"),
    ({"priority": 2**31}, ValueError, "priority must be between"),
    ({"priority": -(2**31) - 1}, ValueError, "priority must be between"),
    ({"attempts": 1.0}, TypeError, "attempts must be an integer"),
    ({"attempts": -1}, ValueError, "attempts must be between 0 and"),
    ({"attempts": 2**31}, ValueError, "attempts must be between 0 and"),
    ({"max_attempts": "3"}, TypeError, "max_attempts must be an integer"),
    ({"max_attempts": 0}, ValueError, "max_attempts must be at least 1"),
    ({"max_attempts": 2**31}, ValueError, "max_attempts must be between"),
    ({"run_at": "2030-01-01"}, TypeError, "run_at must be a datetime"),
    ({"run_at": datetime(2030, 1, 1)}, ValueError, "run_at must be timezone-aware"),
    ({"run_at": datetime(999, 12, 31, tzinfo=UTC)}, ValueError, "run_at must be between"),
    ({"created_at": datetime(2030, 1, 1)}, ValueError, "created_at must be timezone-aware"),
    ({"locked_until": 5}, TypeError, "locked_until must be a datetime"),
    ({"status": "QUEUED"}, ValueError, "status must be one of"),
    ({"status": 1}, TypeError, "status must be a TaskStatus"),
    ({"result": {"x": float("inf")}}, TypeError, "result is not JSON-serialisable"),
]


def refused_id(case: tuple[dict[str, Any], type[Exception], str]) -> str:
    [(field, value)] = case[0].items()
    return f"{field}={value!r}"[:40]


@pytest.mark.parametrize(("fields", "error", "message"), REFUSED, ids=[refused_id(c) for c in REFUSED])
def test_a_bad_field_is_refused_at_the_flush_with_nothing_written(
    engine: sa.Engine, fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with Session(engine) as session:
        good = tq.Task(name="first", params={"n": 1})
        session.add(good)
        session.flush()  # the caller's earlier work in the same transaction
        bad = tq.Task(**{"name": "second", **fields})
        session.add(bad)
        with pytest.raises(error, match=message) as raised:
            session.flush()
        field = next(iter(fields))
        assert field in str(raised.value), "the error names the field"
        # The state the caller is left in: the transaction is open with its
        # earlier work, the refused row is still pending, and the next flush
        # (here, the commit's) refuses it again.
        assert session.in_transaction()
        assert bad in session.new
        assert good in session and good.id is not None
        with pytest.raises(error, match=message):
            session.commit()
        assert session.in_transaction()
        session.expunge(bad)
        session.commit()
    assert [row.name for row in task_rows(engine)] == ["first"], "nothing of the refused row was written"


def test_a_refused_row_leaves_a_rollback_free_session_that_can_fix_it(engine: sa.Engine) -> None:
    with Session(engine) as session:
        task = tq.Task(name="fixed.later", priority=2**40)
        session.add(task)
        with pytest.raises(ValueError, match="priority"):
            session.flush()
        task.priority = 5
        session.commit()
    [row] = task_rows(engine)
    assert (row.name, row.priority) == ("fixed.later", 5)


def test_a_refused_row_fails_the_autoflush_of_a_query_and_nothing_else(engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.add(tq.Task(name="x", run_at=datetime(2030, 1, 1)))
        with pytest.raises(ValueError, match="run_at must be timezone-aware"):
            session.scalars(sa.select(tq.Task)).all()
        with session.no_autoflush:
            assert session.scalars(sa.select(tq.Task)).all() == []
        session.rollback()
        assert not session.new, "a rollback discards the refused row"
    assert task_rows(engine) == []


def test_defaults_apply_to_the_fields_left_unset_and_the_name_need_not_be_registered(
    engine: sa.Engine,
) -> None:
    before = datetime.now(UTC)
    with Session(engine) as session:
        session.add(tq.Task(name="registered.nowhere"))
        session.add(tq.Task(name="with.explicit.nones", queue=None, priority=None, params=None, run_at=None))
        session.commit()
    rows = task_rows(engine)
    assert len(rows) == 2
    for row in rows:
        assert (row.queue, row.priority, row.params) == ("default", 0, {})
        assert (row.status, row.attempts, row.max_attempts) == (tq.TaskStatus.QUEUED, 0, 3)
        assert row.run_at >= before - timedelta(seconds=1)
        assert row.created_at >= before - timedelta(seconds=1)


def test_good_values_are_stored_as_given(engine: sa.Engine) -> None:
    run_at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=2)))
    params = {"to": "a@example.com", "n": [1, 2.5, None, True, {"k": "é"}], "big": 2**64 - 1}
    with Session(engine) as session:
        task = tq.Task(
            name="mail.send",
            queue="m" * 100,
            params=params,
            priority=-(2**31),
            max_attempts=2**31 - 1,
            attempts=0,
            run_at=run_at,
            status="queued",
        )
        session.add(task)
        session.commit()
        task_id = task.id
    row = task_row(engine, task_id)
    assert (row.queue, row.params, row.priority, row.max_attempts) == ("m" * 100, params, -(2**31), 2**31 - 1)
    assert row.run_at == run_at
    assert row.status == tq.TaskStatus.QUEUED


def test_a_change_to_a_loaded_row_is_checked_too(engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.add(tq.Task(name="loaded", priority=1))
        session.commit()
    with Session(engine) as session:
        task = session.scalars(sa.select(tq.Task)).one()
        task.priority = 2**31
        with pytest.raises(ValueError, match=r"priority must be between .* \(in a changed Task row named"):
            session.flush()
        task.priority = 2
        task.queue = None  # type: ignore[assignment]
        with pytest.raises(TypeError, match="queue must not be None"):
            session.flush()
        session.rollback()
    [row] = task_rows(engine)
    assert row.priority == 1, "nothing of the refused changes was written"


def test_one_bad_row_among_many_refuses_the_whole_flush(engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.add_all([tq.Task(name=f"t{n}") for n in range(5)])
        session.add(tq.Task(name="the.bad.one", max_attempts=0))
        named = re.escape("max_attempts must be at least 1, got 0 (in a new Task row named 'the.bad.one')")
        with pytest.raises(ValueError, match=named):
            session.flush()
    assert task_rows(engine) == []


def test_sql_expressions_are_left_to_the_database(engine: sa.Engine) -> None:
    """An expression is computed by the database at the flush, so there is no value to check before it."""
    with Session(engine) as session:
        session.add(tq.Task(name="computed", run_at=sa.func.now()))
        session.commit()
    with Session(engine) as session:
        task = session.scalars(sa.select(tq.Task)).one()
        task.attempts = tq.Task.attempts + 1
        task.priority = tq.Task.priority - 3
        session.commit()
    [row] = task_rows(engine)
    assert (row.name, row.attempts, row.priority) == ("computed", 1, -3)
    assert row.run_at is not None


# An application's own model on its own declarative base --------------------------------------


class AppBase(DeclarativeBase):
    pass


class AppTask(tq.TaskMixin, AppBase):
    """Narrower columns than `tq.Task`'s: the checks follow this table, not the library's."""

    __tablename__ = "test_session_add_task"

    queue: Mapped[str] = mapped_column(sa.String(20), default="app")
    priority: Mapped[int] = mapped_column(sa.SmallInteger, default=0)


@pytest.fixture
def app_table(engine: sa.Engine) -> Iterator[type[AppTask]]:
    AppBase.metadata.drop_all(engine)
    AppBase.metadata.create_all(engine)
    yield AppTask
    AppBase.metadata.drop_all(engine)


def app_rows(engine: sa.Engine) -> list[tuple[str, str, int]]:
    with engine.connect() as conn:
        table = AppTask.__table__
        return [tuple(row) for row in conn.execute(sa.select(table.c.name, table.c.queue, table.c.priority))]  # type: ignore[misc]


def test_an_applications_own_task_model_is_checked_against_its_own_columns(
    engine: sa.Engine, app_table: type[AppTask]
) -> None:
    with Session(engine) as session:
        session.add(AppTask(name="app.job"))
        session.flush()
        too_long = AppTask(name="app.job", queue="q" * 21)  # tq.Task's column would take it
        session.add(too_long)
        with pytest.raises(ValueError, match="queue must be a non-empty string of at most 20 characters"):
            session.flush()
        session.expunge(too_long)
        too_big = AppTask(name="app.job", priority=2**15)  # a SMALLINT
        session.add(too_big)
        with pytest.raises(ValueError, match=r"priority must be between -32768 and 32767, .*AppTask"):
            session.flush()
        too_big.priority = 2**15 - 1
        session.commit()
    assert sorted(app_rows(engine)) == [("app.job", "app", 0), ("app.job", "app", 2**15 - 1)]


# PostgreSQL: a NOTIFY at commit -------------------------------------------------------------


@pytest.fixture
def notifies_sent(engine: sa.Engine) -> Iterator[list[str]]:
    """Each pg_notify statement the engine sends during the test."""
    sent: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "pg_notify" in statement:
            sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    yield sent
    sa.event.remove(engine, "before_cursor_execute", seen)


@pytest.mark.requires("notify")
def test_added_rows_notify_their_queues_once_each_at_commit(
    backend: Backend, engine: sa.Engine, notifies_sent: list[str]
) -> None:
    with listening(backend, tq.Task.__table__) as listener, Session(engine) as session:
        session.add_all([tq.Task(name="a", queue="mail"), tq.Task(name="b", queue="mail"), tq.Task(name="c")])
        session.flush()
        session.add(tq.Task(name="d", queue="reports"))
        session.add(tq.Task(name="e", queue="mail"))
        session.flush()
        assert received(listener, 0.3) == [], "nothing before the commit"
        session.commit()
        assert sorted(received(listener)) == ["default", "mail", "reports"]
    assert len(notifies_sent) == 3, "one pg_notify per queue and transaction"


@pytest.mark.requires("notify")
def test_a_rolled_back_add_sends_nothing_and_writes_nothing(backend: Backend, engine: sa.Engine) -> None:
    with listening(backend, tq.Task.__table__) as listener, Session(engine) as session:
        session.add(tq.Task(name="a", queue="mail"))
        session.flush()
        session.rollback()
        assert received(listener) == []
    assert task_rows(engine) == []


@pytest.mark.requires("notify")
def test_a_savepoint_rolled_back_does_not_keep_the_outer_transaction_from_notifying(
    backend: Backend, engine: sa.Engine, notifies_sent: list[str]
) -> None:
    with listening(backend, tq.Task.__table__) as listener, Session(engine) as session:
        savepoint = session.begin_nested()
        session.add(tq.Task(name="in.savepoint", queue="mail"))
        session.flush()  # its NOTIFY is sent inside the savepoint...
        savepoint.rollback()  # ...and discarded with it
        session.add(tq.Task(name="outer", queue="mail"))
        session.commit()
        assert received(listener) == ["mail"]
    assert [row.name for row in task_rows(engine)] == ["outer"]
    assert len(notifies_sent) == 2, "the outer transaction sent its own"


@pytest.mark.requires("notify")
def test_a_savepoint_inside_a_notified_transaction_sends_no_second_notify(
    backend: Backend, engine: sa.Engine, notifies_sent: list[str]
) -> None:
    with listening(backend, tq.Task.__table__) as listener, Session(engine) as session:
        session.add(tq.Task(name="outer", queue="mail"))
        session.flush()
        with session.begin_nested():
            session.add(tq.Task(name="inner", queue="mail"))
        session.commit()
        assert received(listener) == ["mail"]
    assert len(notifies_sent) == 1, "the outer transaction's NOTIFY covers the savepoint's row"


@pytest.mark.requires("notify")
def test_enqueue_and_add_in_one_transaction_notify_once(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue, notifies_sent: list[str]
) -> None:
    with listening(backend, tq.Task.__table__) as listener, Session(engine) as session:
        session.add(tq.Task(name="record", params={"key": 1}, queue="mail"))
        default_queue.enqueue(session, "record", {"key": 2}, queue="mail")
        default_queue.enqueue_many(session, "record", [{"key": 3}, {"key": 4}], queue="mail")
        default_queue.enqueue(session, "record", {"key": 5}, queue="mail")
        session.commit()
        assert received(listener) == ["mail"]
    assert len(notifies_sent) == 1


class ServerQueueTask(tq.TaskMixin, AppBase):
    """A queue column whose default only the database knows, not read back at the INSERT."""

    __tablename__ = "test_session_add_server_queue"
    __mapper_args__ = {"eager_defaults": False}  # noqa: RUF012 (SQLAlchemy's own declaration)

    queue: Mapped[str] = mapped_column(sa.String(20), server_default="srv")


class CallableQueueTask(tq.TaskMixin, AppBase):
    """A queue column whose default a function computes at the INSERT."""

    __tablename__ = "test_session_add_callable_queue"

    queue: Mapped[str] = mapped_column(sa.String(20), default=lambda: "computed")


@pytest.mark.parametrize("model", [ServerQueueTask, CallableQueueTask], ids=["server_default", "callable"])
def test_a_queue_only_the_insert_knows_is_added_and_committed(
    engine: sa.Engine, app_table: type[AppTask], model: type[tq.TaskMixin]
) -> None:
    with Session(engine) as session:
        session.add_all([model(name="one"), model(name="two", queue="named")])  # type: ignore[call-arg]
        session.commit()
    with engine.connect() as conn:
        table = model.__table__  # type: ignore[attr-defined]
        queues = sorted(conn.scalars(sa.select(table.c.queue)))
    assert queues == sorted(["named", "srv" if model is ServerQueueTask else "computed"])


@pytest.mark.requires("notify")
def test_a_queue_only_the_insert_knows_wakes_the_workers_of_every_queue(
    backend: Backend, engine: sa.Engine, app_table: type[AppTask]
) -> None:
    """Its queue is unknown after the INSERT: the NOTIFY says "look now" (empty payload), no SELECT."""
    selects: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "pg_notify" not in statement:
            selects.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        with listening(backend, ServerQueueTask.__table__) as listener, Session(engine) as session:
            session.add_all([ServerQueueTask(name="one"), ServerQueueTask(name="two", queue="named")])
            session.commit()
            assert sorted(received(listener)) == ["", "named"]
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    assert selects == [], "the queue was not read back row by row"


@pytest.mark.requires("notify")
def test_an_applications_own_table_notifies_on_its_own_channel(
    backend: Backend, engine: sa.Engine, app_table: type[AppTask]
) -> None:
    with listening(backend, AppTask.__table__) as listener, Session(engine) as session:
        session.add(AppTask(name="app.job"))  # its queue is its column's default
        session.commit()
        assert received(listener) == ["app"]


@pytest.mark.slow
@pytest.mark.requires("notify", "listen")
def test_an_added_row_wakes_an_idle_worker_long_before_its_poll(backend: Backend, engine: sa.Engine) -> None:
    worker = start_cli(
        "worker", "tests.cli_app:queue", "--poll-interval", "120", "--log-level", "debug", url=backend.url
    )
    log = StreamLines(worker.stderr)
    try:
        idle_line = log.wait_for(lambda line: long_idle_wait(line, 5.0), 60, "a next poll 5 s away")
        with Session(engine) as session:
            task = tq.Task(name="record", params={"key": 1})
            session.add(task)
            session.commit()
            task_id = task.id
        wait_until(lambda: task_row(engine, task_id).status == tq.TaskStatus.COMPLETED, 30, "the task")
        worker.send_signal(signal.SIGTERM)
        returncode = worker.wait(timeout=30)
    finally:
        worker.kill()
    err = log.text()
    assert returncode == 0, err
    assert executions(engine) == {1: 1}
    poll_in = long_idle_wait(idle_line, 5.0)
    assert poll_in is not None
    start_line = next(line for line in err.splitlines() if f"task {task_id} record attempt 1 started" in line)
    # Only the NOTIFY can have ended the wait this early: the poll was ``poll_in`` away.
    assert (logged_at(start_line) - logged_at(idle_line)).total_seconds() < poll_in / 2, err


# scoped_session, Flask-SQLAlchemy, AsyncSession ---------------------------------------------


def test_a_scoped_session_takes_added_rows_and_every_enqueue_path(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    scoped = scoped_session(sessionmaker(engine))
    record = default_queue.registered("record")
    assert record is not None
    try:
        scoped.add(tq.Task(name="record", params={"key": 1}))
        default_queue.enqueue(scoped, "record", {"key": 2})  # type: ignore[arg-type]
        default_queue.enqueue_many(scoped, "record", [{"key": 3}])  # type: ignore[arg-type]
        record.enqueue(scoped, key=4)  # type: ignore[arg-type]
        record.using(priority=1).enqueue(scoped, key=5)
        record.using(priority=1).enqueue_many(scoped, [{"key": 6}])
        scoped.add(tq.Task(name="record", params={"key": 7}, priority=2**31))
        with pytest.raises(ValueError, match="priority"):
            scoped.flush()
        scoped.rollback()
        scoped.add(tq.Task(name="record", params={"key": 8}))
        scoped.commit()
    finally:
        scoped.remove()
    assert [row.params["key"] for row in task_rows(engine)] == [8]


@pytest.mark.requires("notify")
def test_a_scoped_session_notifies_at_commit(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue, notifies_sent: list[str]
) -> None:
    scoped = scoped_session(sessionmaker(engine))
    record = default_queue.registered("record")
    assert record is not None
    try:
        with listening(backend, tq.Task.__table__) as listener:
            record.enqueue(scoped, key=1)  # type: ignore[arg-type]
            default_queue.enqueue_many(scoped, "record", [{"key": 2}], queue="mail")  # type: ignore[arg-type]
            scoped.add(tq.Task(name="record", params={"key": 3}, queue="reports"))
            scoped.commit()
            assert sorted(received(listener)) == ["default", "mail", "reports"]
    finally:
        scoped.remove()
    assert len(notifies_sent) == 3
    assert sorted(row.params["key"] for row in task_rows(engine)) == [1, 2, 3]


def test_flask_sqlalchemys_session(backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue) -> None:
    import flask
    import flask_sqlalchemy

    app = flask.Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = backend.url
    db = flask_sqlalchemy.SQLAlchemy(app)
    record = default_queue.registered("record")
    assert record is not None
    try:
        with app.app_context():
            record.enqueue(db.session, key=1)
            db.session.add(tq.Task(name="record", params={"key": 2}))
            db.session.add(tq.Task(name="record", params={"key": 3}, max_attempts=0))
            with pytest.raises(ValueError, match="max_attempts"):
                db.session.commit()
            db.session.rollback()
            record.using(queue="mail").enqueue(db.session, key=4)
            db.session.add(tq.Task(name="record", params={"key": 5}))
            db.session.commit()
    finally:
        with app.app_context():
            db.engine.dispose()
    assert sorted(row.params["key"] for row in task_rows(engine)) == [4, 5]


def async_url(backend: Backend) -> str:
    url = sa.make_url(backend.url)
    if url.get_backend_name() == "sqlite":
        return url.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False)
    return url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


@pytest.mark.backends("sqlite", "postgres")  # the async drivers the test extra installs: aiosqlite, psycopg
def test_an_async_session_checks_and_commits_added_rows(backend: Backend, engine: sa.Engine) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def add_rows() -> None:
        async_engine = create_async_engine(async_url(backend))
        try:
            async with AsyncSession(async_engine) as session:
                session.add(tq.Task(name="async.good", queue="mail"))
                await session.flush()
                bad = tq.Task(name="async.bad", params={"x": float("nan")})
                session.add(bad)
                with pytest.raises(ValueError, match=r"params\['x'\]: numbers must be finite"):
                    await session.flush()
                assert session.in_transaction()
                session.expunge(bad)
                await session.commit()
        finally:
            await async_engine.dispose()

    asyncio.run(add_rows())
    assert [row.name for row in task_rows(engine)] == ["async.good"]


@pytest.mark.backends("postgres")
@pytest.mark.requires("notify")
def test_an_async_session_notifies_at_commit(backend: Backend, engine: sa.Engine) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def add_row() -> None:
        async_engine = create_async_engine(async_url(backend))
        try:
            async with AsyncSession(async_engine) as session:
                session.add(tq.Task(name="async.job", queue="mail"))
                await session.commit()
        finally:
            await async_engine.dispose()

    with listening(backend, tq.Task.__table__) as listener:
        asyncio.run(add_row())
        assert received(listener) == ["mail"]
