"""The async path: a queue on an AsyncEngine, enqueues through an AsyncSession, async def tasks,
and a worker running inside an application's event loop.

The driver is ``--async-driver``, else the first of the backend's in
``tests.backends.ASYNC_DRIVERS``.  Rows are read back with the sync engine,
so what is checked is what the database holds.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import NullPool

import sa_taskqueue as tq
from tests.app import Execution, executions
from tests.backends import ASYNC_DRIVERS, Backend, async_url
from tests.helpers import run_cli, task_row, wait_until
from tests.helpers import task_rows as rows

pytestmark = pytest.mark.async_path


@pytest.fixture(scope="module")
def driver(request: pytest.FixtureRequest, backend: Backend) -> str:
    chosen: str | None = request.config.getoption("--async-driver")
    return chosen or ASYNC_DRIVERS[backend.name][0]


@pytest.fixture
def async_engine(backend: Backend, driver: str, engine: sa.Engine) -> AsyncEngine:
    """An AsyncEngine to the suite's database (whose tables ``engine`` created).

    Without a pool: a connection closes on the loop that used it when it is
    given back, so the tests' own loops and the queue's never meet in a pool
    (a test of its own covers that).
    """
    return create_async_engine(async_url(backend.url, driver), poolclass=NullPool)


@pytest.fixture
def async_queue(async_engine: AsyncEngine) -> Iterator[tq.TaskQueue]:
    queue = tq.TaskQueue(async_engine, lease=timedelta(minutes=5))

    @queue.task(name="record")
    def record(key: int) -> int:
        return key

    @queue.task(name="arecord")
    async def arecord(key: int) -> int:
        """Writes its execution through the application's async engine, on the loop the worker gives it."""
        async with AsyncSession(async_engine) as session:
            session.add(Execution(task_key=key, pid=os.getpid()))
            await session.commit()
        return key

    yield queue
    queue.close()


async def eventually(condition: Callable[[], Awaitable[bool]], seconds: float, what: str) -> None:
    """Await ``condition()`` every 20 ms until true, for at most ``seconds``; the loop runs meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


# The queue --------------------------------------------------------------------


def test_an_async_sessionmaker_binds_a_queue_to_its_engine(async_engine: AsyncEngine) -> None:
    queue = tq.TaskQueue(async_sessionmaker(async_engine))
    assert queue.is_async and queue.engine is async_engine.sync_engine
    with pytest.raises(TypeError, match="async_sessionmaker passed as bind is not bound to an engine"):
        tq.TaskQueue(async_sessionmaker())
    with pytest.raises(TypeError, match="AsyncEngine"):
        tq.TaskQueue("sqlite://")  # type: ignore[arg-type]


def test_every_database_call_of_an_async_queue_goes_through_its_engine(
    async_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session:
        ids = [async_queue.enqueue(session, "record", {"key": n}).id for n in range(3)]
        session.commit()
    assert async_queue.cancel(ids[2]) is True
    assert async_queue.explain_claim(limit=2).strip()  # the database's plan, read on the engine's loop
    [first, second] = async_queue.claim(limit=5)
    assert async_queue.extend_leases([first, second]) == {first.id, second.id}
    assert async_queue.release(second) is True
    assert async_queue.complete(first, 10) is True
    assert async_queue.outcome_written(first, completed=True) is True
    assert async_queue.recover() == 0
    assert [(t.status, t.attempts) for t in rows(engine)] == [
        (tq.TaskStatus.COMPLETED, 1),
        (tq.TaskStatus.QUEUED, 0),
        (tq.TaskStatus.CANCELLED, 0),
    ]


# Enqueue ---------------------------------------------------------------------


def test_an_async_session_enqueues_in_the_callers_transaction(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    record = async_queue.registered("record")
    assert record is not None

    async def main() -> tuple[int, list[int] | None]:
        async with AsyncSession(async_engine) as session:
            one_id = (await record.enqueue(session, key=1)).id
            await async_queue.enqueue(session, "record", {"key": 2}, priority=5)
            many = await async_queue.enqueue_many(session, "record", [{"key": 3}, {"key": 4}])
            await session.commit()
        async with AsyncSession(async_engine) as session:
            await record.enqueue(session, key=99)
            await session.rollback()
        return one_id, many

    first_id, many_ids = asyncio.run(main())
    found = rows(engine)
    assert [(t.params["key"], t.priority, t.status) for t in found] == [
        (1, 0, tq.TaskStatus.QUEUED),
        (2, 5, tq.TaskStatus.QUEUED),
        (3, 0, tq.TaskStatus.QUEUED),
        (4, 0, tq.TaskStatus.QUEUED),
    ]
    assert found[0].id == first_id
    if many_ids is not None:  # MySQL returns no ids from a multi-row INSERT
        assert many_ids == [found[2].id, found[3].id]


def test_bad_input_raises_at_the_call_before_anything_is_awaited(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    record = async_queue.registered("record")
    assert record is not None

    async def main() -> None:
        async with AsyncSession(async_engine) as session:
            with pytest.raises(TypeError, match="params do not fit task 'record'"):
                record.enqueue(session, wrong=1)
            with pytest.raises(ValueError, match="no task registered under 'nope'"):
                async_queue.enqueue_many(session, "nope", [{}])
            with pytest.raises(ValueError, match="priority"):
                async_queue.enqueue(session, "record", {"key": 1}, priority=2**40)
            assert not session.new
            await record.enqueue(session, key=7)  # the transaction is still usable
            await session.commit()

    asyncio.run(main())
    assert [t.params for t in rows(engine)] == [{"key": 7}]


def test_an_enqueue_never_awaited_logs_an_error_naming_the_task(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Without ``await`` nothing is added; the log says so, in the application's words, once it is dropped."""
    record = async_queue.registered("record")
    assert record is not None

    async def forget_to_await() -> None:
        async with AsyncSession(async_engine) as session:
            record.enqueue(session, key=1)  # type: ignore[unused-coroutine]
            async_queue.enqueue_many(session, "record", [{"key": 2}])  # type: ignore[unused-coroutine]
            await session.commit()

    with caplog.at_level(logging.ERROR, logger="sa_taskqueue"):
        asyncio.run(forget_to_await())
        gc.collect()
    assert rows(engine) == []
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors
    for message in errors:
        assert "'record'" in message and "did not happen" in message and "not awaited" in message, message


def test_an_awaited_enqueue_logs_nothing(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    async def enqueue() -> None:
        async with AsyncSession(async_engine) as session:
            await async_queue.enqueue(session, "record", {"key": 1})
            await asyncio.ensure_future(async_queue.enqueue_many(session, "record", [{"key": 2}]))
            await session.commit()

    with caplog.at_level(logging.ERROR, logger="sa_taskqueue"):
        asyncio.run(enqueue())
        gc.collect()
    assert sorted(t.params["key"] for t in rows(engine)) == [1, 2]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_an_async_scoped_session_enqueues_in_its_scope(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    async def main() -> None:
        scoped = async_scoped_session(async_sessionmaker(async_engine), scopefunc=asyncio.current_task)
        task = await async_queue.enqueue(scoped, "record", {"key": 3})
        assert task in scoped()
        await scoped.commit()
        await scoped.remove()

    asyncio.run(main())
    assert [t.params for t in rows(engine)] == [{"key": 3}]


def test_a_sync_session_still_enqueues_on_an_async_queue(
    async_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session:
        task = async_queue.enqueue(session, "record", {"key": 1})
        session.commit()
        assert isinstance(task, tq.Task)
    assert [t.params for t in rows(engine)] == [{"key": 1}]


# The loop that owns the connections --------------------------------------------


def test_run_sync_runs_a_function_where_an_async_queues_engine_may_be_used(
    async_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session:
        session.add(tq.Task(name="record", params={"key": 1}))
        session.commit()

    def count() -> int:
        with async_queue.engine.connect() as conn:  # the sync_engine: MissingGreenlet outside run_sync
            return conn.scalar(sa.select(sa.func.count()).select_from(async_queue.table)) or 0

    assert async_queue.run_sync(count) == 1


def test_a_sync_call_on_the_engines_loop_raises_instead_of_deadlocking(async_queue: tq.TaskQueue) -> None:
    async def on_the_loop() -> str:
        with pytest.raises(tq.SyncCallOnEventLoop, match=r"asyncio\.to_thread"):
            async_queue.claim()
        claimed = await asyncio.to_thread(async_queue.claim)  # the way out it names
        return f"claimed {len(claimed)}"

    loop = async_queue.event_loop()
    assert asyncio.run_coroutine_threadsafe(on_the_loop(), loop).result(timeout=30) == "claimed 0"


def test_a_pooled_connection_is_never_used_on_a_loop_other_than_its_own(
    backend: Backend, driver: str, engine: sa.Engine
) -> None:
    # One pooled connection, used in turn by the application's loops and the queue's.
    shared = create_async_engine(async_url(backend.url, driver), pool_size=1, max_overflow=0)
    opened: list[int] = []
    sa.event.listen(shared.sync_engine, "connect", lambda *_: opened.append(1))
    queue = tq.TaskQueue(shared)

    @queue.task(name="record")
    def record(key: int) -> int:
        return key

    async def application(key: int) -> None:
        async with AsyncSession(shared) as session:
            await record.enqueue(session, key=key)
            await session.commit()

    try:
        asyncio.run(application(1))
        [claimed] = queue.claim()
        assert queue.complete(claimed, 1)
        asyncio.run(application(2))  # a new loop: the queue's connection is not reused here
        [claimed] = queue.claim()
        assert claimed.params == {"key": 2}
        assert queue.complete(claimed, 2)
    finally:
        queue.close()
        asyncio.run_coroutine_threadsafe(shared.dispose(), queue.event_loop()).result(timeout=30)
    # Each change of loop opened a connection of its own; none was shared.
    assert len(opened) >= 3
    assert [(t.params["key"], t.status) for t in rows(engine)] == [
        (1, tq.TaskStatus.COMPLETED),
        (2, tq.TaskStatus.COMPLETED),
    ]


# Workers ------------------------------------------------------------------------


def test_a_worker_on_an_async_engine_runs_sync_and_async_tasks_each_once(
    async_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session:
        async_queue.enqueue_many(session, "record", [{"key": n} for n in range(10)])
        async_queue.enqueue_many(session, "arecord", [{"key": n} for n in range(100, 120)])
        session.commit()
    worker = async_queue.run_worker(concurrency=4, burst=True, poll_interval=0.05)
    assert (worker.processed, worker.failed) == (30, 0)
    assert executions(engine) == dict.fromkeys(range(100, 120), 1)
    assert {(t.status, t.result) for t in rows(engine)} == {
        (tq.TaskStatus.COMPLETED, t.params["key"]) for t in rows(engine)
    }


def test_an_async_task_past_its_timeout_is_cancelled_and_fails(
    async_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    cancelled = threading.Event()

    @async_queue.task(name="sleepy", timeout=timedelta(seconds=0.2), max_attempts=1)
    async def sleepy() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    from sqlalchemy.orm import Session

    with Session(engine) as session:
        sleepy.enqueue(session)
        session.commit()
    worker = async_queue.run_worker(burst=True, poll_interval=0.05)
    assert worker.failed == 1
    assert cancelled.is_set()  # enforced: the coroutine was stopped, not left running
    [row] = rows(engine)
    assert row.status == tq.TaskStatus.FAILED
    assert "TaskTimeout" in (row.last_error or "") and "0.2s timeout" in (row.last_error or "")


def test_async_tasks_of_a_sync_queue_share_one_loop_of_the_worker(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)  # a sync engine, whatever --async-driver says
    loops: list[asyncio.AbstractEventLoop] = []

    @queue.task(name="where")
    async def where(n: int) -> int:
        await asyncio.sleep(0)
        loops.append(asyncio.get_running_loop())
        return n

    from sqlalchemy.orm import Session

    with Session(engine) as session:
        queue.enqueue_many(session, "where", [{"n": n} for n in range(12)])
        session.commit()
    try:
        worker = queue.run_worker(concurrency=4, burst=True, poll_interval=0.05)
    finally:
        queue.close()
    assert (worker.processed, worker.failed) == (12, 0)
    assert len(set(map(id, loops))) == 1  # one loop per worker, not one per task
    assert loops[0].is_closed()  # stopped with the worker
    assert {t.result for t in rows(engine)} == set(range(12))


def test_an_async_task_runs_in_its_own_child_under_process_isolation(
    async_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    @async_queue.task(name="pid")
    async def pid() -> int:
        await asyncio.sleep(0)
        return os.getpid()

    from sqlalchemy.orm import Session

    with Session(engine) as session:
        pid.enqueue(session)
        session.commit()
    worker = async_queue.run_worker(burst=True, poll_interval=0.05, isolation="process")
    assert (worker.processed, worker.failed) == (1, 0)
    [row] = rows(engine)
    assert row.status == tq.TaskStatus.COMPLETED
    assert isinstance(row.result, int) and row.result != os.getpid()


# run_worker_async ----------------------------------------------------------------


def test_run_worker_async_serves_a_running_loop_and_cancelling_it_gives_back_what_runs(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    started = threading.Event()

    @async_queue.task(name="forever")
    async def forever(key: int) -> None:
        async with AsyncSession(async_engine) as session:
            session.add(Execution(task_key=key, pid=os.getpid()))
            await session.commit()
        started.set()
        await asyncio.Event().wait()

    async def main() -> None:
        ticks = 0

        async def ticking() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(ticking())
        serving = asyncio.create_task(
            async_queue.run_worker_async(concurrency=3, poll_interval=0.05, shutdown_timeout=0)
        )
        async with AsyncSession(async_engine) as session:
            await async_queue.enqueue_many(session, "arecord", [{"key": n} for n in range(5)])
            await async_queue.enqueue(session, "forever", {"key": 50})
            await session.commit()

        async def ran_all() -> bool:
            # (``forever`` commits its row before it sets ``started``: both, so it is surely running.)
            return started.is_set() and await asyncio.to_thread(lambda: len(executions(engine)) == 6)

        await eventually(ran_all, 30, "five tasks done and one running")
        before = ticks
        await eventually(lambda: _true_after(ticks > before + 3), 5, "the loop to keep running")
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        ticker.cancel()

    asyncio.run(main())
    assert started.is_set()
    by_key = {t.params["key"]: t for t in rows(engine)}
    assert {k: by_key[k].status for k in range(5)} == dict.fromkeys(range(5), tq.TaskStatus.COMPLETED)
    # Given back when the worker was cancelled: queued again, the attempt not counted.
    assert (by_key[50].status, by_key[50].attempts) == (tq.TaskStatus.QUEUED, 0)


async def _true_after(value: bool) -> bool:
    await asyncio.sleep(0)
    return value


def test_run_worker_async_in_burst_returns_the_worker(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    async def main() -> tq.Worker:
        async with AsyncSession(async_engine) as session:
            await async_queue.enqueue_many(session, "arecord", [{"key": n} for n in range(8)])
            await session.commit()
        return await async_queue.run_worker_async(concurrency=2, burst=True, poll_interval=0.05)

    worker = asyncio.run(main())
    assert (worker.processed, worker.failed) == (8, 0)
    assert executions(engine) == dict.fromkeys(range(8), 1)


def test_a_second_run_worker_async_of_one_queue_is_refused_while_the_first_runs(
    async_queue: tq.TaskQueue,
) -> None:
    """Each run_worker_async closes the queue's kept connections, advisory locks included, as it
    starts and ends: a second one beside the first would take the first one's locks away."""

    async def main() -> str:
        first = asyncio.create_task(async_queue.run_worker_async(poll_interval=0.05))
        await asyncio.sleep(0)  # the first call has started and holds the queue
        try:
            with pytest.raises(RuntimeError, match="already runs a worker") as refused:
                await async_queue.run_worker_async(poll_interval=0.05)
        finally:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        # Once the first has stopped, the queue takes a worker again.
        again = await async_queue.run_worker_async(burst=True, poll_interval=0.05)
        assert again.processed == 0
        return str(refused.value)

    message = asyncio.run(main())
    assert "TaskQueue of its own" in message


def test_run_worker_async_runs_the_async_tasks_of_a_sync_queue_on_the_applications_loop(
    engine: sa.Engine,
) -> None:
    from sqlalchemy.orm import Session

    queue = tq.TaskQueue(engine)
    loops: list[asyncio.AbstractEventLoop] = []

    @queue.task(name="where")
    async def where(n: int) -> int:
        loops.append(asyncio.get_running_loop())
        return n

    with Session(engine) as session:
        queue.enqueue_many(session, "where", [{"n": n} for n in range(4)])
        session.commit()

    async def main() -> tuple[tq.Worker, asyncio.AbstractEventLoop]:
        worker = await queue.run_worker_async(concurrency=2, burst=True, poll_interval=0.05)
        return worker, asyncio.get_running_loop()

    try:
        worker, application_loop = asyncio.run(main())
    finally:
        queue.close()
    assert (worker.processed, worker.failed) == (4, 0)
    assert {id(loop) for loop in loops} == {id(application_loop)}


# Prompt pickup -------------------------------------------------------------------------


@pytest.mark.requires("notify")
def test_notify_wakes_an_idle_worker_on_an_async_engine(
    async_queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    from sqlalchemy.orm import Session

    caplog.set_level(logging.DEBUG, logger="sa_taskqueue")
    worker = tq.Worker(async_queue, poll_interval=60, watchdog=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        # Idle long enough that its next poll is seconds away.
        wait_until(lambda: _next_poll_at_least(caplog, 3.0), 60, "a next poll 3 s away")
        with Session(engine) as session:
            task_id = async_queue.enqueue(session, "record", {"key": 1}).id
            session.commit()
        woke = time.monotonic()
        wait_until(lambda: task_row(engine, task_id).status == tq.TaskStatus.COMPLETED, 30, "the task")
        assert time.monotonic() - woke < 2.0, "picked up by the NOTIFY, not the next poll"
    finally:
        worker.stop()
        thread.join(timeout=30)


def _next_poll_at_least(caplog: pytest.LogCaptureFixture, seconds: float) -> bool:
    prefix = "nothing more due: next poll in "
    waits = [r.getMessage().removeprefix(prefix) for r in caplog.records if r.getMessage().startswith(prefix)]
    return any(float(wait.rstrip("s")) >= seconds for wait in waits)


# The command line -----------------------------------------------------------------------


@pytest.mark.slow
def test_the_command_line_worker_runs_both_kinds_of_task_of_an_app_with_only_an_async_engine(
    backend: Backend, driver: str, async_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session:
        session.add_all([tq.Task(name="double", params={"n": n}) for n in range(5)])
        session.add_all([tq.Task(name="arecord", params={"key": n}) for n in range(5)])
        session.commit()
    done = run_cli(
        "worker",
        "tests.async_cli_app:queue",
        "--burst",
        "--concurrency",
        "3",
        url=backend.url,
        SA_TASKQUEUE_TEST_ASYNC_DRIVER=driver,
    )
    assert done.returncode == 0, done.stderr
    assert executions(engine) == dict.fromkeys(range(5), 1)
    assert sorted((t.name, t.result) for t in rows(engine) if t.status == tq.TaskStatus.COMPLETED) == sorted(
        [("double", 2 * n) for n in range(5)] + [("arecord", n) for n in range(5)]
    )


def test_run_worker_async_cancelled_twice_still_returns_only_once_its_worker_has_stopped(
    async_queue: tq.TaskQueue, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    @async_queue.task(name="blocking")
    def blocking() -> None:
        started.set()
        release.wait(30)
        finished.set()

    async def main() -> None:
        serving = asyncio.create_task(
            async_queue.run_worker_async(concurrency=1, poll_interval=0.05, shutdown_timeout=30)
        )
        async with AsyncSession(async_engine) as session:
            await async_queue.enqueue(session, "blocking", {})
            await session.commit()
        await eventually(lambda: _true_after(started.is_set()), 30, "the task to start")
        serving.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        serving.cancel()
        # The running task finishes a little later; the worker waits for it.
        asyncio.get_running_loop().call_later(0.3, release.set)
        with pytest.raises(asyncio.CancelledError):
            await serving
        assert finished.is_set(), "run_worker_async returned while its worker still ran a task"

    asyncio.run(main())
    assert [r.status for r in rows(engine)] == [tq.TaskStatus.COMPLETED]


def test_a_worker_stopping_waits_for_a_cancelled_async_task_to_run_its_cleanup(engine: sa.Engine) -> None:
    """Shutdown cancels an async task on the worker's own loop; its ``finally`` still runs to its end."""
    from sqlalchemy.orm import Session

    queue = tq.TaskQueue(engine)
    started, cleaned_up = threading.Event(), threading.Event()
    statuses: list[tq.TaskStatus] = []

    @queue.task(name="hangs")
    async def hangs() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            # Cleanup that itself awaits, as an ``async with`` exit does.
            await asyncio.sleep(0.2)
            # Not given back before this: no other worker can run it meanwhile.
            statuses.append(await asyncio.to_thread(lambda: rows(engine)[0].status))
            cleaned_up.set()

    with Session(engine) as session:
        queue.enqueue(session, "hangs", {})
        session.commit()
    worker = tq.Worker(queue, concurrency=1, poll_interval=0.05, shutdown_timeout=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(started.is_set, 30, "the task to start")
        worker.stop()
        thread.join(60)
        assert not thread.is_alive()
        assert cleaned_up.is_set(), "the worker stopped before the cancelled task's cleanup ran"
    finally:
        worker.stop()
        thread.join(60)
        queue.close()
    assert statuses == [tq.TaskStatus.RUNNING]
    [row] = rows(engine)
    assert (row.status, row.attempts) == (tq.TaskStatus.QUEUED, 0)
