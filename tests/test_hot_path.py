"""Claims and completions run prepared SQL on connections the strategy keeps: what that must not change.

The kept connections and the prepared statements are there for speed (see
benchmarks/).  These tests hold them to the guarantees of the slower path:
rows read back as through SQLAlchemy, no thread waits for another, a broken
connection is replaced, a forked child never writes on its parent's socket,
and pools that share one DBAPI connection are left as they were.
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from sa_taskqueue.strategies.executor import StatementExecutor
from sa_taskqueue.strategies.kept_connection import KEEP
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import enqueue_records as enqueue
from tests.helpers import task_row, task_rows

TABLE = tq.Task.__table__


def backend_pid(queue: tq.TaskQueue) -> int:
    """The server's id for the connection the strategy keeps for single statements."""
    sql = {
        "postgresql": "SELECT pg_backend_pid()",
        "mysql": "SELECT CONNECTION_ID()",
        "mariadb": "SELECT CONNECTION_ID()",
    }
    with queue.strategy.executor.single_statement(queue.engine) as conn:
        return int(conn.exec_driver_sql(sql[conn.dialect.name]).scalar_one())


def test_claimed_rows_read_back_as_through_sqlalchemy(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    run_at = datetime(2020, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=-5)))
    params = {"key": 1, "text": "é ✓ 'quoted' %s %(x)s", "nested": {"list": [1, 2.5, None, True]}}
    queue.task(name="takes_any_params")(lambda **params: None)
    with Session(engine) as session:
        task = queue.enqueue(session, "takes_any_params", params, run_at=run_at, priority=-3, queue="mail")
        session.commit()
        task_id = task.id
    [claimed] = queue.claim(queues=["mail"])
    row = task_row(engine, task_id)
    assert claimed.params == row.params == params
    assert claimed.run_at == row.run_at == run_at
    for stamp in (claimed.run_at, claimed.created_at, claimed.started_at, claimed.locked_until):
        assert stamp.utcoffset() == timedelta(0), stamp
    assert (claimed.started_at, claimed.locked_until) == (row.started_at, row.locked_until)
    assert (claimed.priority, claimed.queue, claimed.attempts) == (row.priority, row.queue, row.attempts)
    assert queue.complete(claimed, {"answer": "é", "n": [1, 2]})
    assert task_row(engine, task_id).result == {"answer": "é", "n": [1, 2]}


def test_a_claim_finds_every_kept_connection_lent_out_and_takes_a_pooled_one(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    [task_id] = enqueue(queue, engine, 1)
    outcome: list[object] = []

    def claim_and_complete() -> None:
        [claimed] = queue.claim()
        outcome.append(queue.complete(claimed))

    executor = queue.strategy.executor
    lender = executor.kept_connection(engine, autocommit=backend_for(engine.dialect).autocommit_statements)
    with contextlib.ExitStack() as loans:
        lent = {
            loans.enter_context(executor.single_statement(engine)).connection.dbapi_connection
            for _ in range(KEEP)
        }
        assert len(lent) == lender.kept == KEEP
        other = threading.Thread(target=claim_and_complete)
        other.start()
        other.join(timeout=30)
        assert not other.is_alive(), "the claim waited for a thread holding a kept connection"
        assert lender.kept == KEEP, "the claim's connection came from the pool, and went back"
    assert outcome == [True]
    assert task_row(engine, task_id).status == tq.TaskStatus.COMPLETED


def test_a_claim_during_a_write_takes_no_connection_from_the_pool(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    # A worker claims while its successes are written (on PostgreSQL): once
    # kept, a connection for each, and neither checked out of the pool.
    executor = queue.strategy.executor
    checkouts: list[object] = []

    def count(*_: object) -> None:
        checkouts.append(1)

    def a_claim_during_a_write() -> set[object]:
        with executor.single_statement(engine) as writing, executor.single_statement(engine) as claiming:
            for conn in (writing, claiming):
                conn.exec_driver_sql("SELECT 1").scalar_one()
            return {writing.connection.dbapi_connection, claiming.connection.dbapi_connection}

    kept = a_claim_during_a_write()
    sa.event.listen(engine, "checkout", count)
    try:
        again = a_claim_during_a_write()
    finally:
        sa.event.remove(engine, "checkout", count)
    assert checkouts == [], "no connection checked out of the pool"
    assert again == kept and len(kept) == 2, "the same two connections, kept"


@pytest.mark.backends("postgres", "mysql", "mariadb")  # a server whose sessions another one can kill
def test_a_kept_connection_the_server_dropped_is_replaced(engine: sa.Engine) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    [first, second] = enqueue(queue, engine, 2)
    assert [t.id for t in queue.claim()] == [first]
    dropped = backend_pid(queue)
    with engine.connect() as admin:
        if engine.dialect.name == "postgresql":
            admin.exec_driver_sql(f"SELECT pg_terminate_backend({dropped})")
        else:
            admin.exec_driver_sql(f"KILL {dropped}")
    # The next statement on the dropped connection fails as a lost connection
    # (a claim is not retried blindly: it may have committed), and the one
    # after that runs on a new connection.
    with pytest.raises(tq.DatabaseUnavailable):
        queue.claim()
    assert [t.id for t in queue.claim()] == [second]
    assert backend_pid(queue) != dropped
    queue.close()


@pytest.mark.slow
def test_a_forked_child_and_its_parent_claim_side_by_side(engine: sa.Engine) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    ids = enqueue(queue, engine, 300)
    [first] = queue.claim()  # the parent now keeps a connection
    assert queue.complete(first)
    started_read, started_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: SQLAlchemy's rule after a fork, then the same queue object
        status = 1
        try:
            engine.dispose(close=False)
            signalled = False
            while claimed := queue.claim(limit=2):
                for task in claimed:
                    if not queue.complete(task, {"by": "child"}):
                        raise AssertionError(f"lost {task.id}")
                if not signalled:
                    os.write(started_write, b"1")
                    signalled = True
            status = 0
        finally:
            os._exit(status)
    # Start once the child has claimed, so that the two really run side by side.
    assert os.read(started_read, 1) == b"1"
    done = 1
    while claimed := queue.claim(limit=2):
        for task in claimed:
            assert queue.complete(task, {"by": "parent"})
            done += 1
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed: it wrote on its parent's connection?"
    rows = task_rows(engine)
    assert sorted(row.id for row in rows) == ids
    assert all(row.status == tq.TaskStatus.COMPLETED for row in rows)
    by_child = sum(row.result == {"by": "child"} for row in rows)
    assert done + by_child == len(ids) and by_child > 0, (done, by_child)
    if engine.dialect.name != "sqlite":
        # (SQLite's busy handler may let one process take every claim.)
        assert done > 1, (done, by_child)
    queue.close()


@pytest.mark.slow
def test_a_connection_lent_when_the_process_forks_stays_the_parents(engine: sa.Engine) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    ids = enqueue(queue, engine, 4)
    executor = queue.strategy.executor
    with executor.single_statement(engine) as lent:  # a claim or a write under way in the parent
        pid = os.fork()
        if pid == 0:  # the child claims on connections of its own, and ends
            status = 1
            try:
                engine.dispose(close=False)
                while claimed := queue.claim(limit=2):
                    for task in claimed:
                        if not queue.complete(task):
                            raise AssertionError(f"lost {task.id}")
                queue.close()
                status = 0
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child failed"
        # The child neither used nor closed it: the parent's session is still there.
        assert lent.exec_driver_sql("SELECT 1").scalar_one() == 1
    assert queue.claim() == []
    assert {row.status for row in task_rows(engine) if row.id in ids} == {tq.TaskStatus.COMPLETED}
    queue.close()


@pytest.mark.backends("sqlite")  # an SQLite file of its own: once is enough
def test_a_pool_sharing_one_connection_keeps_the_applications_transactions(tmp_path: object) -> None:
    # StaticPool (and SingletonThreadPool, SQLite's in-memory default) hand
    # every user the same DBAPI connection: one left in autocommit mode would
    # commit the application's session behind its back.
    engine = sa.create_engine(f"sqlite:///{tmp_path}/static.db", poolclass=sa.pool.StaticPool)
    tq.metadata.create_all(engine)
    queue = make_queue(engine, None, timedelta(minutes=5))
    enqueue(queue, engine, 1)
    [claimed] = queue.claim()
    assert queue.complete(claimed)
    with Session(engine) as session:
        queue.enqueue(session, "record", {"key": 9})
        session.rollback()
    assert [row.status for row in task_rows(engine)] == [tq.TaskStatus.COMPLETED]
    queue.close()
    engine.dispose()


def test_closing_the_queue_gives_its_connections_back(backend: Backend, engine: sa.Engine) -> None:
    own = sa.create_engine(backend.url)
    queue = make_queue(own, None, timedelta(minutes=5))
    enqueue(queue, own, 2)
    [claimed] = queue.claim()
    assert queue.complete(claimed)
    # The queue's own engine: ``own``, or its async twin under --async-driver.
    assert queue.engine.pool.checkedout() >= 1  # type: ignore[attr-defined]
    queue.close()
    assert queue.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    own.dispose()


def test_a_connection_lent_when_the_queue_closes_goes_back_once_its_loan_ends(backend: Backend) -> None:
    own = sa.create_engine(backend.url)
    lender = StatementExecutor().kept_connection(own, autocommit=True)
    with lender.lend(), lender.lend():  # both kept, both lent
        lender.close()
        assert own.pool.checkedout() == KEEP  # type: ignore[attr-defined]
    assert own.pool.checkedout() == 0  # type: ignore[attr-defined]
    own.dispose()


@pytest.mark.parametrize(("pool_size", "kept"), [(1, 0), (2, 1), (3, 1), (4, KEEP)])
def test_a_small_pool_keeps_room_for_the_application_and_a_listener(
    backend: Backend, pool_size: int, kept: int
) -> None:
    # One connection left for the application's sessions, and from three up
    # one more for a worker's LISTEN connection.
    own = sa.create_engine(backend.url, pool_size=pool_size, max_overflow=0, pool_timeout=2)
    lender = StatementExecutor().kept_connection(own, autocommit=True)
    with contextlib.ExitStack() as loans:  # a claim during a write, as far as the pool has room
        for _ in range(min(KEEP, pool_size)):
            loans.enter_context(lender.lend())
    assert lender.kept == own.pool.checkedout() == kept  # type: ignore[attr-defined]
    with contextlib.ExitStack() as others:  # each would wait pool_timeout and fail if kept
        for _ in range(pool_size - kept):
            assert others.enter_context(own.connect()).exec_driver_sql("SELECT 1").scalar_one() == 1
    lender.close()
    own.dispose()


def test_a_pool_of_one_connection_is_not_kept_from_the_application(
    backend: Backend, engine: sa.Engine
) -> None:
    own = sa.create_engine(backend.url, pool_size=1, max_overflow=0, pool_timeout=2)
    queue = make_queue(own, None, timedelta(minutes=5))
    enqueue(queue, own, 1)
    [claimed] = queue.claim()
    with Session(own) as session:  # would wait pool_timeout and fail if the queue kept the one connection
        assert session.execute(sa.text("SELECT 1")).scalar_one() == 1
    assert queue.complete(claimed)
    queue.close()
    own.dispose()


def test_oracle_statements_run_as_constructs_for_their_input_sizes() -> None:
    # python-oracledb binds a bare datetime as a DATE (no microseconds) unless
    # SQLAlchemy sets input sizes, which driver SQL skips: the guards would
    # never match on Oracle.
    from sqlalchemy.dialects import oracle, postgresql

    from sa_taskqueue.strategies.prepared import PreparedStatement

    update = sa.update(TABLE).where(TABLE.c.id == sa.bindparam("x")).values(locked_until=None)
    assert PreparedStatement(update, oracle.dialect(), TABLE).direct is False
    assert PreparedStatement(update, postgresql.dialect(), TABLE).direct is True
