"""Workers on small connection pools.

A pool of one connection runs a worker, its self-test included: each check
takes its second connection from a short-lived pool of its own, and a worker
whose LISTEN connection would take the pool's last one polls instead.  A pool
that cannot lend what a worker holds at once for its task runs (a connection
per running transactional task, per advisory-lock claim) is refused at start,
with the numbers and the fix, rather than left to starve its lease renewals
until its watchdog kills it.  The smallest pool that fits starts, one less
does not.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.notify import can_listen
from sa_taskqueue.health.self_test import TRANSACTION_POOLING
from tests.app import ASYNC_DRIVER_VARIABLE, Execution, executions, make_queue
from tests.backends import Backend
from tests.helpers import enqueue_records, run_cli, start_cli, wait_until
from tests.pgbouncer import pgbouncer

#: The subprocesses' queues are on a sync engine, whatever --async-driver says:
#: their transactional task is a plain def.
SYNC = {ASYNC_DRIVER_VARIABLE: ""}


def small_engine(url: str, connections: int) -> sa.Engine:
    """An engine whose pool lends ``connections`` at once; a borrower waits at most 5 s for one."""
    return sa.create_engine(url, pool_size=connections, max_overflow=0, pool_timeout=5)


@pytest.fixture
def pool_of_one(backend: Backend, engine: sa.Engine) -> Iterator[sa.Engine]:
    own = small_engine(backend.url, 1)
    yield own
    own.dispose()


def statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tq.Task.status, sa.func.count()).group_by(tq.Task.status)).all()
    return {str(status): count for status, count in rows}


def transactional_queue(own: sa.Engine) -> tq.TaskQueue:
    """The test application's queue on ``own``, with a transactional task writing its execution."""
    queue = tq.TaskQueue(own, lease=timedelta(minutes=5))

    @queue.task(name="effect", transactional=True)
    def effect(session: Session, key: int) -> int:
        session.add(Execution(task_key=key, pid=os.getpid()))
        return key

    return queue


def enqueue_effects(queue: tq.TaskQueue, engine: sa.Engine, count: int) -> None:
    with Session(engine) as session:
        queue.enqueue_many(session, "effect", ({"key": key} for key in range(count)))
        session.commit()


def run_bounded(worker: tq.Worker, seconds: float = 60) -> BaseException | None:
    """Run ``worker`` in a thread for at most ``seconds``; what it raised, or None once it returned.

    A worker that neither returns nor raises in time is stopped and the test fails.
    """
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        worker.stop()
        thread.join(30)
        raise AssertionError(f"the worker neither started and finished nor refused within {seconds}s")
    return raised[0] if raised else None


# The self-test ----------------------------------------------------------------------------


def test_the_self_test_runs_on_a_pool_of_one_connection(pool_of_one: sa.Engine, strategy_name: str) -> None:
    queue = tq.TaskQueue(pool_of_one, strategy=strategy_name)
    try:
        report = queue.check_footing()
        assert report.ok, report.lines()
        expected = [strategy_name, *(["listen"] if can_listen(pool_of_one) else [])]
        assert [check.name for check in report.checks] == expected
        assert pool_of_one.pool.checkedout() == 0, "the application's one connection is back in its pool"  # type: ignore[attr-defined]
    finally:
        queue.close()


@pytest.mark.slow  # starts PgBouncer
@pytest.mark.backends("postgres")
def test_on_a_pool_of_one_the_self_test_still_names_a_transaction_pooler(
    backend: Backend, engine: sa.Engine
) -> None:
    # The second connection of each check comes from a pool of the self-test's
    # own, through the same URL: a pooler in front of the server is still seen.
    with pgbouncer(backend.url, "transaction") as url:
        own = small_engine(url, 1)
        try:
            report = tq.TaskQueue(own, strategy="advisory_lock").check_footing()
            assert [check.name for check in report.checks] == ["advisory_lock", "listen"]
            for check in report.checks:
                assert not check.passed
                assert TRANSACTION_POOLING in check.detail, check.detail
        finally:
            own.dispose()


# A worker process on a small pool -----------------------------------------------------------


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize(
    "connections",
    # Two connections ran a worker already, except where it LISTENs: the
    # listener held one and the connection kept for claims the other.
    [1, pytest.param(2, marks=pytest.mark.backends("postgres", "postgres18"))],
)
def test_a_worker_on_a_small_pool_proves_its_footing_and_drains_its_tasks(
    backend: Backend, engine: sa.Engine, connections: int
) -> None:
    tasks = 60
    enqueue_records(make_queue(engine, None, timedelta(minutes=5)), engine, tasks)
    # Not --burst: a worker that is not a burst listens where it can, and
    # runs its services; the self-test is on, as by default.
    proc = start_cli(
        "worker",
        "tests.small_pool_app:queue",
        "--concurrency",
        "2",
        "--poll-interval",
        "0.2",
        url=backend.url,
        SA_TASKQUEUE_TEST_POOL=str(connections),
        **SYNC,
    )
    try:
        wait_until(lambda: statuses(engine) == {"completed": tasks}, 60, "the worker to run every task")
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "started: strategy=" in err
    assert "database unavailable" not in err, err
    assert executions(engine) == dict.fromkeys(range(tasks), 1)
    if can_listen(engine):
        # Its LISTEN connection would have held the pool's last connection for good.
        assert "polls every poll_interval instead of waiting on LISTEN" in err, err


# Refused at start -------------------------------------------------------------------------------


def assert_drains(backend: Backend, engine: sa.Engine, *, pool: int, concurrency: int, tasks: int) -> None:
    """A worker of ``concurrency`` on a pool of ``pool`` starts and runs the ``tasks`` queued, each once."""
    enough = small_engine(backend.url, pool)
    try:
        worker = tq.Worker(transactional_queue(enough), concurrency=concurrency, burst=True, watchdog=False)
        assert run_bounded(worker) is None
        assert worker.processed == tasks
    finally:
        enough.dispose()
    assert statuses(engine) == {"completed": tasks}
    assert executions(engine) == dict.fromkeys(range(tasks), 1)


#: Where each running transactional task holds a connection: on a SQLite file they take turns at the
#: write gate, one at a time (see the SQLite test below).
SERVERS = pytest.mark.backends("postgres", "postgres18", "mysql", "mariadb")


@SERVERS
@pytest.mark.slow  # the command line
def test_a_worker_whose_pool_cannot_hold_its_transactional_tasks_is_refused_naming_the_fix(
    backend: Backend, engine: sa.Engine
) -> None:
    queue = transactional_queue(engine)
    enqueue_effects(queue, engine, 3)
    result = run_cli(
        "worker",
        "tests.small_pool_app:queue",
        "--burst",
        "--concurrency",
        "8",
        url=backend.url,
        SA_TASKQUEUE_TEST_POOL="6",
        SA_TASKQUEUE_TEST_TRANSACTIONAL="1",
        **SYNC,
    )
    assert result.returncode == 1, result.stderr
    # 8 transactional tasks, 2 connections kept for claims and completions, 1
    # for renewals: 11; 3 slots fit in 6.
    assert result.stderr.startswith(
        "error: the engine's pool lends 6 connection(s) at once (pool_size=6, max_overflow=0), and this "
        "worker of concurrency 8 holds 11 at once: 8 for its transactional tasks (each holds one while it "
        "runs), 2 kept for claims and completions, 1 for lease renewals and other short statements."
    ), result.stderr
    assert (
        "Fix: give the engine at least 11 connections: pool_size + max_overflow >= 11, "
        "e.g. create_engine(..., pool_size=11, max_overflow=0), "
        "or run the worker with concurrency=3 (--concurrency 3)"
    ) in result.stderr
    assert statuses(engine) == {"queued": 3}, "nothing was claimed"
    assert executions(engine) == {}


@SERVERS
def test_the_smallest_pool_that_holds_the_transactional_tasks_starts_and_one_less_is_refused(
    backend: Backend, engine: sa.Engine
) -> None:
    # Two slots of transactional tasks, 2 kept, 1 for renewals: 5.  (A burst
    # worker does not listen.)
    tasks = 6
    enqueue_effects(transactional_queue(engine), engine, tasks)
    short = small_engine(backend.url, 4)
    try:
        worker = tq.Worker(transactional_queue(short), concurrency=2, burst=True, watchdog=False)
        refused = run_bounded(worker)
        assert isinstance(refused, tq.TaskQueueError), refused
        assert isinstance(refused, tq.PoolTooSmall)
        assert isinstance(refused, ValueError)
        assert "pool_size=4, max_overflow=0" in str(refused)
        assert "holds 5 at once: 2 for its transactional tasks" in str(refused)
        assert str(refused).endswith(
            "pool_size + max_overflow >= 5, e.g. create_engine(..., pool_size=5, max_overflow=0), "
            "or run the worker with concurrency=1 (--concurrency 1)"
        ), refused
        assert statuses(engine) == {"queued": tasks}, "nothing was claimed"
    finally:
        short.dispose()
    assert_drains(backend, engine, pool=5, concurrency=2, tasks=tasks)


@pytest.mark.backends("sqlite")
def test_on_a_sqlite_file_transactional_tasks_hold_one_connection_at_a_time(
    backend: Backend, engine: sa.Engine
) -> None:
    # They take turns at the write gate before they take a connection: eight
    # slots need 1, plus 2 kept and 1 for renewals: 4.  A pool of 2 keeps 1: 3.
    tasks = 12
    enqueue_effects(transactional_queue(engine), engine, tasks)
    short = small_engine(backend.url, 2)
    try:
        worker = tq.Worker(transactional_queue(short), concurrency=8, burst=True, watchdog=False)
        refused = run_bounded(worker)
        assert isinstance(refused, tq.PoolTooSmall), refused
        assert "holds 3 at once: 1 for its transactional tasks" in str(refused)
    finally:
        short.dispose()
    assert_drains(backend, engine, pool=4, concurrency=8, tasks=tasks)


@pytest.mark.requires("advisory_locks")
def test_advisory_lock_claims_on_a_pool_of_one_are_refused(pool_of_one: sa.Engine) -> None:
    # Each claim holds the connection its locks live on while its tasks run:
    # the lease renewals would wait for them.
    queue = make_queue(pool_of_one, "advisory_lock", timedelta(minutes=5))
    try:
        refused = run_bounded(tq.Worker(queue, burst=True, watchdog=False))
        assert isinstance(refused, tq.PoolTooSmall), refused
        assert "worker of concurrency 1 holds 2 at once: 1 for its advisory-lock claims" in str(refused)
    finally:
        queue.close()
