"""An enqueue into a task table that is not there: the library's `SchemaMissing`, with the migrate hint.

Never the driver's own error ("no such table", "relation does not exist",
"Table doesn't exist"), on every path a task is written by; the driver's
error stays as the cause.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.cli.main import cli
from tests.app import Execution
from tests.backends import ASYNC_DRIVERS, Backend, async_url
from tests.missing_table_app import NeverMigrated, register

#: A table of the application's own Base: its own migrations make it, not the library's.
HINT = (
    "the task table 'never_migrated_task' does not exist: "
    "create it with the application's own migrations (`alembic upgrade head`)"
)


@pytest.fixture
def queue(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    assert not sa.inspect(engine).has_table(NeverMigrated.__tablename__)
    queue = register(tq.TaskQueue(engine, model=NeverMigrated))
    yield queue
    queue.close()


def assert_schema_missing(raised: pytest.ExceptionInfo[tq.SchemaMissing], engine: sa.Engine) -> None:
    assert HINT in str(raised.value)
    driver_error = engine.dialect.loaded_dbapi.Error
    assert isinstance(raised.value.__cause__, driver_error), repr(raised.value.__cause__)


def test_queue_enqueue(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session, pytest.raises(tq.SchemaMissing) as raised:
        queue.enqueue(session, "shop.mail", {"to": "a@example.com"})
    assert_schema_missing(raised, engine)


def test_a_registered_tasks_enqueue_and_a_unique_enqueue(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    mail = queue.registered("shop.mail")
    assert mail is not None
    with Session(engine) as session, pytest.raises(tq.SchemaMissing) as raised:
        mail.enqueue(session, to="a@example.com")
    assert_schema_missing(raised, engine)
    with Session(engine) as session, pytest.raises(tq.SchemaMissing) as raised:
        queue.enqueue(session, "shop.mail", {"to": "a@example.com"}, unique_key="a")
    assert_schema_missing(raised, engine)


@pytest.mark.parametrize("count", [1, 200], ids=["one-row", "many-rows"])
def test_enqueue_many(queue: tq.TaskQueue, engine: sa.Engine, count: int) -> None:
    # Many rows take the database's bulk path (COPY on PostgreSQL), one row a plain INSERT.
    params = [{"to": f"{n}@example.com"} for n in range(count)]
    with Session(engine) as session, pytest.raises(tq.SchemaMissing) as raised:
        queue.enqueue_many(session, "shop.mail", params)
    assert_schema_missing(raised, engine)
    with Session(engine) as session, pytest.raises(tq.SchemaMissing) as raised:
        # A keyed row goes one INSERT of its own (a key is for one row).
        queue.enqueue_many(session, "shop.mail", params[:1], unique_key="k")
    assert_schema_missing(raised, engine)


def test_session_add_then_commit(engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.add(NeverMigrated(name="shop.mail", params={"to": "a@example.com"}))
        with pytest.raises(tq.SchemaMissing) as raised:
            session.commit()
        assert_schema_missing(raised, engine)


def test_an_error_about_the_applications_own_rows_is_left_as_it_was(engine: sa.Engine) -> None:
    # Only the task table's absence is translated: an error about the caller's own rows, which
    # the enqueue's flush writes too, stays the caller's to handle.
    queue = register(tq.TaskQueue(engine))
    with Session(engine) as session:
        session.add(Execution(task_key=None, pid=1))  # NOT NULL: refused by the database
        with pytest.raises(sa.exc.IntegrityError):
            queue.enqueue(session, "shop.mail", {"to": "a@example.com"})
    queue.close()


def test_the_async_queue(backend: Backend, engine: sa.Engine) -> None:
    async_engine = create_async_engine(async_url(backend.url, ASYNC_DRIVERS[backend.name][0]))
    queue = register(tq.TaskQueue(async_engine, model=NeverMigrated))

    async def enqueue() -> None:
        async with AsyncSession(async_engine) as session:
            await queue.enqueue(session, "shop.mail", {"to": "a@example.com"})

    async def enqueue_many() -> None:
        async with AsyncSession(async_engine) as session:
            await queue.enqueue_many(session, "shop.mail", [{"to": "a@example.com"}] * 50)

    try:
        for attempt in (enqueue, enqueue_many):
            with pytest.raises(tq.SchemaMissing) as raised:
                asyncio.run(attempt())
            assert HINT in str(raised.value)
            assert isinstance(raised.value.__cause__, async_engine.dialect.loaded_dbapi.Error)
    finally:
        queue.close()
        asyncio.run(async_engine.dispose())


def test_the_command_lines_enqueue(backend: Backend) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "enqueue",
            "shop.mail",
            "--params",
            '{"to": "a@example.com"}',
            "--app",
            "tests.missing_table_app:queue",
        ],
        env={"SA_TASKQUEUE_DATABASE_URL": backend.url},
    )
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: {HINT}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.backends("sqlite")  # an empty database file of its own
def test_the_librarys_own_table_says_to_run_migrate(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path}/empty.db")
    queue = register(tq.TaskQueue(engine))
    with Session(engine) as session, pytest.raises(tq.SchemaMissing) as raised:
        queue.enqueue(session, "shop.mail", {"to": "a@example.com"})
    assert str(raised.value) == (
        "the task table 'sa_taskqueue_task' does not exist: "
        "run `sa-taskqueue migrate` (or `alembic upgrade head`)"
    )
    assert isinstance(raised.value.__cause__, engine.dialect.loaded_dbapi.Error)
    with Session(engine) as session:
        session.add(tq.Task(name="shop.mail"))
        with pytest.raises(tq.SchemaMissing, match="run `sa-taskqueue migrate`"):
            session.commit()
    queue.close()
    engine.dispose()
