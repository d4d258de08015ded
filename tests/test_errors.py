"""Errors cross the queue's boundary as sa_taskqueue's own, with the driver's error as the cause."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

import sa_taskqueue as tq
from sa_taskqueue.core.exceptions import translate_database_errors
from tests.backends import Backend

TABLE = tq.Task.__table__


@pytest.mark.backends("sqlite")  # an SQLite file of its own: once is enough
def test_a_busy_database_with_an_exhausted_pool_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    # Telling "no such table" from the rest asks the database again; with the
    # pool's only connection taken, that must not replace the original error.
    engine = sa.create_engine(f"sqlite:///{tmp_path}/busy.db", pool_size=1, max_overflow=0, pool_timeout=0.1)
    tq.metadata.create_all(engine)
    busy = sa.exc.OperationalError("UPDATE ...", {}, Exception("database is locked"))
    holding_the_only_connection = engine.connect()
    with pytest.raises(tq.DatabaseUnavailable) as raised, translate_database_errors(engine, TABLE):
        raise busy
    holding_the_only_connection.close()
    assert raised.value.__cause__ is busy
    assert "database is locked" in str(raised.value)
    engine.dispose()


@pytest.mark.backends("sqlite")
def test_a_missing_table_is_named_and_a_refused_statement_is_a_database_error(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path}/empty.db")
    queue = tq.TaskQueue(engine)
    with pytest.raises(tq.SchemaMissing, match="sa-taskqueue migrate") as missing:
        queue.claim()
    assert isinstance(missing.value.__cause__, sa.exc.OperationalError)
    tq.metadata.create_all(engine)
    refused = sa.exc.IntegrityError("INSERT ...", {}, Exception("NOT NULL constraint failed"))
    with pytest.raises(tq.DatabaseError) as raised, translate_database_errors(engine, TABLE):
        raise refused
    assert not isinstance(raised.value, tq.DatabaseUnavailable), "refused, not worth retrying"
    assert raised.value.__cause__ is refused
    engine.dispose()


def refused(engine: sa.Engine, statement: sa.Executable) -> tq.DatabaseError:
    """What running ``statement`` raises through the queue's error translation."""
    with (
        pytest.raises(tq.DatabaseError) as raised,
        translate_database_errors(engine, TABLE),
        engine.connect() as conn,
    ):
        conn.execute(statement)
    return raised.value


def test_a_statement_naming_an_unknown_column_is_refused_not_an_outage(engine: sa.Engine) -> None:
    error = refused(engine, sa.select(sa.literal_column("no_such_column")).select_from(TABLE))
    assert not isinstance(error, tq.DatabaseUnavailable), "retrying would be refused again, forever"
    assert "refused a statement" in str(error)


@pytest.mark.backends("postgres", "sqlite")  # MySQL and MariaDB take a select list of any length
def test_a_statement_over_a_limit_of_the_database_is_refused_not_an_outage(engine: sa.Engine) -> None:
    too_many_columns = sa.select(*(sa.literal_column(str(n)) for n in range(5000)))
    error = refused(engine, too_many_columns)
    assert not isinstance(error, tq.DatabaseUnavailable), "retrying would be refused again, forever"


@pytest.mark.backends("postgres", "mysql", "mariadb")  # servers: a port nothing listens on
def test_a_server_that_cannot_be_reached_is_an_outage(backend: Backend) -> None:
    unreachable = sa.make_url(backend.url).set(host="127.0.0.1", port=1)
    engine = sa.create_engine(unreachable)
    with (
        pytest.raises(tq.DatabaseUnavailable),
        translate_database_errors(engine, TABLE),
        engine.connect() as conn,
    ):
        conn.execute(sa.select(1))
    engine.dispose()


class RefusingBase(DeclarativeBase):
    pass


class TaskWithoutLockedBy(tq.TaskMixin, RefusingBase):
    """A task table whose ``locked_by`` column was dropped: every claim is refused for what it asks."""

    __tablename__ = "sa_taskqueue_refusing_task"


def test_a_worker_whose_claim_is_refused_stops_with_the_error_instead_of_retrying(engine: sa.Engine) -> None:
    RefusingBase.metadata.drop_all(engine)
    RefusingBase.metadata.create_all(engine)
    queue = tq.TaskQueue(engine, model=TaskWithoutLockedBy)
    queue.task(name="noop")(lambda: None)
    with Session(engine) as session:  # a due task, so that every strategy goes as far as its UPDATE
        queue.enqueue(session, "noop")
        session.commit()
    with engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {TaskWithoutLockedBy.__tablename__} DROP COLUMN locked_by")
    with pytest.raises(tq.DatabaseError) as refused_claim:
        queue.claim()
    assert not isinstance(refused_claim.value, tq.DatabaseUnavailable)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            tq.Worker(queue, burst=False, poll_interval=0.05, listen=False).run()
        except tq.DatabaseError as error:
            raised.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the worker kept retrying a claim the database refuses"
    assert len(raised) == 1
    queue.close()
    RefusingBase.metadata.drop_all(engine)
