"""Transactional tasks: their writes commit with their completion, once, or not at all."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.worker.slot_runner import FREE_GIVE_BACKS_AFTER_A_CUT
from tests.app import queue_bind
from tests.backends import Backend
from tests.helpers import MovableClock, kill_other_sessions, read_through_outages, wait_until
from tests.txn_app import Effect, effects, make_txn_queue, reset

ROOT = Path(__file__).resolve().parent.parent
LEASE = timedelta(minutes=5)


@pytest.fixture
def txn_engine(engine: sa.Engine) -> sa.Engine:
    reset(engine)
    return engine


@pytest.fixture
def txn_queue(txn_engine: sa.Engine, strategy_name: str) -> Iterator[tq.TaskQueue]:
    queue = make_txn_queue(txn_engine, strategy_name, LEASE)
    yield queue
    queue.close()


def enqueue(queue: tq.TaskQueue, engine: sa.Engine, name: str = "effect", **params: Any) -> int:
    with Session(engine) as session:
        task_id = queue.enqueue(session, name, params, max_attempts=2).id
        session.commit()
    return task_id


def row(engine: sa.Engine, task_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(tq.Task.__table__).where(tq.Task.id == task_id)).one()


def run_burst(queue: tq.TaskQueue, **options: Any) -> tq.Worker:
    return queue.run_worker(burst=True, poll_interval=0.05, watchdog=False, **options)


# Running -------------------------------------------------------------------------------


def test_the_writes_and_the_completion_commit_together(
    txn_engine: sa.Engine, txn_queue: tq.TaskQueue
) -> None:
    ids = [enqueue(txn_queue, txn_engine, key=key) for key in range(3)]
    worker = run_burst(txn_queue, concurrency=2)
    assert worker.processed == 3
    assert effects(txn_engine) == {0: 1, 1: 1, 2: 1}
    for key, task_id in enumerate(ids):
        done = row(txn_engine, task_id)
        assert done.status == tq.TaskStatus.COMPLETED
        assert done.result == key
        assert done.finished_at is not None
        assert done.locked_until is None


@pytest.mark.parametrize("commit", [False, True], ids=["flushed", "committed-by-the-task"])
def test_a_task_that_raises_leaves_no_writes_and_is_retried_then_failed(
    txn_engine: sa.Engine, txn_queue: tq.TaskQueue, commit: bool
) -> None:
    # The task's own commit() only releases a savepoint: the raise still undoes its writes.
    task_id = enqueue(txn_queue, txn_engine, key=7, fail=True, commit=commit)

    def failed_for_good() -> bool:
        run_burst(txn_queue)  # (a retry may not be due yet when a burst ends)
        return bool(row(txn_engine, task_id).status == tq.TaskStatus.FAILED)

    wait_until(failed_for_good, 30, "the task to use its two attempts")
    failed = row(txn_engine, task_id)
    assert failed.attempts == 2
    assert "task 7 failed after writing" in failed.last_error
    assert effects(txn_engine) == {}, "every failed attempt's writes were rolled back"


def test_an_engine_in_autocommit_still_rolls_back_a_failed_task(
    txn_engine: sa.Engine, strategy_name: str
) -> None:
    # Such an engine sends no BEGIN, and MySQL and MariaDB accept a SAVEPOINT
    # outside a transaction: the task's connection must leave AUTOCOMMIT.
    bind = queue_bind(txn_engine)
    if isinstance(bind, sa.Engine):
        autocommit: Any = sa.create_engine(bind.url, isolation_level="AUTOCOMMIT")
    else:
        from sqlalchemy.ext.asyncio import create_async_engine

        autocommit = create_async_engine(bind.url, isolation_level="AUTOCOMMIT")
    queue = make_txn_queue(txn_engine, strategy_name, LEASE, bind=autocommit)
    try:
        task_id = enqueue(queue, txn_engine, key=9, fail=True)
        wait_until(
            lambda: run_burst(queue) and row(txn_engine, task_id).status == tq.TaskStatus.FAILED,
            30,
            "the task to use its two attempts",
        )
        assert effects(txn_engine) == {}, "every failed attempt's writes were rolled back"
        ok_id = enqueue(queue, txn_engine, key=10)
        run_burst(queue)
        assert row(txn_engine, ok_id).status == tq.TaskStatus.COMPLETED
        assert effects(txn_engine) == {10: 1}
    finally:
        queue.close()
        autocommit.sync_engine.dispose() if not isinstance(autocommit, sa.Engine) else autocommit.dispose()


def test_a_task_over_its_timeout_never_commits(txn_engine: sa.Engine, txn_queue: tq.TaskQueue) -> None:
    task_id = enqueue(txn_queue, txn_engine, "effect_slow", key=3)
    worker = run_burst(txn_queue)
    assert worker.failed >= 1
    late = row(txn_engine, task_id)
    assert late.status != tq.TaskStatus.COMPLETED
    assert "timeout" in late.last_error
    assert effects(txn_engine) == {}


def test_a_worker_whose_lease_was_taken_over_rolls_back_and_leaves_the_new_outcome(
    txn_engine: sa.Engine, strategy_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = MovableClock()
    first = make_txn_queue(txn_engine, strategy_name, LEASE, clock.now)
    second = make_txn_queue(txn_engine, strategy_name, LEASE, clock.now)
    task_id = enqueue(first, txn_engine, key=1)
    claimed = threading.Event()
    go_on = threading.Event()

    def hold(_task: tq.ClaimedTask) -> None:
        # Held after the claim, before the run: on SQLite the run's
        # transaction would hold the write lock the takeover needs.
        claimed.set()
        go_on.wait(30)

    worker = tq.Worker(first, burst=True, poll_interval=0.05, watchdog=False, on_start=hold)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(claimed.is_set, 30, "the first worker to claim the task")
        if first.strategy.name == "advisory_lock":
            # There the advisory lock, not the lease, says who holds the task:
            # it goes with the first worker's connection (closed through the
            # queue, so on an async engine on its loop).  The server drops the
            # lock once its backend has seen the close, a moment later.
            first.close()
            wait_until(lambda: second.recover() == 1, 30, "the first worker's lock to go")
        else:
            clock.advance(LEASE + timedelta(seconds=1))
            assert second.recover() == 1
        [taken] = second.claim(limit=1)
        assert (taken.id, taken.attempts) == (task_id, 2)
        assert second.complete(taken, "the second worker's")
    finally:
        with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
            go_on.set()
            thread.join(30)
        first.close()
        second.close()
    assert not thread.is_alive()
    assert effects(txn_engine) == {}, "the first worker's writes were rolled back"
    done = row(txn_engine, task_id)
    assert (done.status, done.result, done.attempts) == (tq.TaskStatus.COMPLETED, "the second worker's", 2)
    assert worker.processed == 0
    assert "its lease was lost" in caplog.text


class CutAtEveryRun:
    """A transactional task ``cut_me``: it writes, then waits in its transaction for the test to cut it."""

    def __init__(self, queue: tq.TaskQueue, engine: sa.Engine) -> None:
        self.inside = threading.Semaphore(0)
        self.go_on = threading.Semaphore(0)
        self.engine = engine
        self.observer = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)  # pooled with nothing
        self.last_run = False
        hold = self._hold
        if queue.is_async:

            @queue.task(name="cut_me", transactional=True)
            async def cut_me_async(session: Any, key: int) -> int:
                session.add(Effect(task_key=key))
                await session.flush()
                hold()
                return key

        else:

            @queue.task(name="cut_me", transactional=True)
            def cut_me(session: Session, key: int) -> int:
                session.add(Effect(task_key=key))
                session.flush()
                hold()
                return key

    def _hold(self) -> None:
        if self.last_run:
            return
        self.inside.release()
        if not self.go_on.acquire(timeout=30):
            raise TimeoutError("the test never cut the connection")

    def cut(self) -> None:
        """Wait for a run to be inside its transaction, cut every connection but the test's, let it go on.

        (The test's own engine's pooled connections are cut too: its pool is emptied.)
        """
        assert self.inside.acquire(timeout=30), "no run reached its transaction"
        with self.observer.connect() as conn:
            assert kill_other_sessions(conn) >= 1
        self.engine.dispose()
        self.go_on.release()

    def ended(self, task_id: int) -> Any:
        wait_until(
            lambda: row(self.observer, task_id).status in (tq.TaskStatus.COMPLETED, tq.TaskStatus.FAILED),
            60,
            "the task to end",
        )
        return row(self.observer, task_id)


@pytest.mark.backends("postgres", "postgres18", "mysql", "mariadb")
def test_a_task_whose_connection_the_server_cuts_runs_again_without_spending_an_attempt(
    txn_engine: sa.Engine, txn_queue: tq.TaskQueue, caplog: pytest.LogCaptureFixture
) -> None:
    # As a server restart does: every connection is cut while the task is
    # inside its transaction, its insert made.  Its one attempt is not spent.
    task = CutAtEveryRun(txn_queue, txn_engine)
    with Session(txn_engine) as session:
        task_id = txn_queue.enqueue(session, "cut_me", {"key": 5}, max_attempts=1).id
        session.commit()
    worker = tq.Worker(txn_queue, concurrency=1, poll_interval=0.05, watchdog=False)
    thread = threading.Thread(target=worker.run)
    with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
        thread.start()
        try:
            task.cut()
            task.last_run = True
            done = task.ended(task_id)
        finally:
            task.go_on.release()
            worker.stop()
            thread.join(60)
    assert (done.status, done.attempts, done.result) == (tq.TaskStatus.COMPLETED, 1, 5), (
        "the run the server cut did not count"
    )
    assert effects(task.observer) == {5: 1}, "the cut run's insert was rolled back, the next one's committed"
    assert "its connection was cut" in caplog.text
    assert worker.given_back == 1


@pytest.mark.backends("postgres", "mysql", "mariadb")
def test_a_task_cut_off_at_every_run_fails_in_the_end(txn_engine: sa.Engine, txn_queue: tq.TaskQueue) -> None:
    # A task whose own statements make the server drop its connection would
    # be given back forever: past a few free runs, a cut counts.
    task = CutAtEveryRun(txn_queue, txn_engine)
    with Session(txn_engine) as session:
        task_id = txn_queue.enqueue(session, "cut_me", {"key": 6}, max_attempts=1).id
        session.commit()
    worker = tq.Worker(txn_queue, concurrency=1, poll_interval=0.05, watchdog=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        for _ in range(FREE_GIVE_BACKS_AFTER_A_CUT + 1):
            task.cut()
        done = task.ended(task_id)
    finally:
        task.last_run = True
        task.go_on.release()
        worker.stop()
        thread.join(60)
    assert (done.status, done.attempts) == (tq.TaskStatus.FAILED, 1)
    assert worker.given_back == FREE_GIVE_BACKS_AFTER_A_CUT
    assert effects(task.observer) == {}


# Registration --------------------------------------------------------------------------


def test_bad_transactional_tasks_are_refused_at_decoration() -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))
    with pytest.raises(TypeError, match="first positional parameter"):
        queue.task(transactional=True)(lambda *, key: key)
    with pytest.raises(TypeError, match="first positional parameter"):

        @queue.task(transactional=True)
        def no_params() -> None: ...

    with pytest.raises(TypeError, match=r"async def.*sync Engine"):

        @queue.task(transactional=True)
        async def on_a_sync_engine(session: Any) -> None: ...

    with pytest.raises(TypeError, match="True or False"):
        queue.task(transactional="yes")  # type: ignore[arg-type]
    assert queue.task_names == []

    from sqlalchemy.ext.asyncio import create_async_engine

    async_queue = tq.TaskQueue(create_async_engine("sqlite+aiosqlite://"))
    with pytest.raises(TypeError, match=r"plain def.*AsyncEngine"):

        @async_queue.task(transactional=True)
        def on_an_async_engine(session: Session) -> None: ...


def test_params_are_checked_without_the_session() -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))

    @queue.task(transactional=True)
    def task(session: Session, key: int, note: str = "") -> None: ...

    task.check_params({"key": 1})
    task.check_params({"key": 1, "note": "x"})
    with pytest.raises(TypeError, match="params do not fit"):
        task.check_params({"session": None, "key": 1})
    with pytest.raises(TypeError, match="params do not fit"):
        task.check_params({})


def test_process_isolation_refuses_transactional_tasks_at_start() -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))

    @queue.task(transactional=True)
    def task(session: Session) -> None: ...

    with pytest.raises(ValueError, match="isolation='process' cannot run transactional tasks"):
        tq.Worker(queue, isolation="process", watchdog=False).run()


# The kill storm -------------------------------------------------------------------------

STORM_TASKS = 5000
STORM_WORKERS = 4
STORM_SLOTS = 4
STORM_LEASE = 1.5
STORM_PAUSE = 0.02
STORM_ATTEMPTS = 100


def start_worker(
    backend: Backend, tmp_path: Path, n: int, *options: str, lease: float = STORM_LEASE
) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"worker-{n}.log", "wb")  # noqa: SIM115 - closed with the process below
    args = ["--url", backend.node_url(n), "--lease", str(lease), "--concurrency", str(STORM_SLOTS), *options]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.txn_app", *args, "--name", f"w{n}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def statuses(engine: sa.Engine) -> dict[str, int]:
    rows = read_through_outages(
        engine,
        lambda conn: conn.execute(sa.select(tq.Task.status, sa.func.count()).group_by(tq.Task.status)).all(),
    )
    return {tq.TaskStatus(status).value: count for status, count in rows}


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_kill_storm_every_task_s_writes_commit_exactly_once(
    backend: Backend, txn_engine: sa.Engine, tmp_path: Path
) -> None:
    """5,000 transactional tasks drained by worker processes that are SIGKILLed and SIGSTOPped.

    Workers run without the watchdog and with a short lease, so a stopped
    worker wakes up after its leases ran out and its tasks were taken by
    others: only the fence keeps its transactions from committing.  Every
    task must end COMPLETED with exactly one effect row.
    """
    queue = make_txn_queue(txn_engine, None, timedelta(seconds=STORM_LEASE), bind=txn_engine)
    with Session(txn_engine) as session:
        # Each task pauses in its transaction, its row inserted: a stop then
        # often catches a worker between its writes and its commit.  Not on
        # SQLite: there the transaction holds the database's one write lock,
        # so a pause would hold up every worker, and no other worker can take
        # a task over while its transaction is open anyway.
        pause = 0.0 if backend.is_sqlite else STORM_PAUSE
        tasks = ({"key": key, "pause": pause} for key in range(STORM_TASKS))
        # Lost runs count as attempts; the storm loses many, and is about effects, not retries.
        queue.enqueue_many(session, "effect", tasks, max_attempts=STORM_ATTEMPTS)
        session.commit()
    queue.close()
    chaos = random.Random(20261125)
    started = time.monotonic()
    workers = {n: start_worker(backend, tmp_path, n) for n in range(STORM_WORKERS)}
    next_name = STORM_WORKERS
    stopped: dict[int, float] = {}  # worker -> when it is to be continued (monotonic)
    kills = stops = 0
    try:
        # A bound on liveness only: on a busy 2-core machine running other sessions beside it, a
        # drain on SQLite, whose stopped workers can hold its one write lock, takes minutes.
        deadline = started + 480
        while (counts := statuses(txn_engine)).get("completed", 0) < STORM_TASKS:
            assert time.monotonic() < deadline, f"the storm did not end: {counts}"
            assert "failed" not in counts, f"tasks failed for good: {counts}"
            now = time.monotonic()
            for n, resume_at in list(stopped.items()):
                if now >= resume_at:
                    workers[n].send_signal(signal.SIGCONT)
                    del stopped[n]
            running = [n for n in workers if n not in stopped]
            action = chaos.random()
            if action < 0.2 and len(running) > 1:
                victim = chaos.choice(running)
                workers.pop(victim).kill()
                kills += 1
                workers[next_name] = start_worker(backend, tmp_path, next_name)
                next_name += 1
            elif action < 0.65 and len(stopped) < 2 and len(running) > 2:
                victim = chaos.choice(running)
                workers[victim].send_signal(signal.SIGSTOP)
                # Half the stops outlast the lease: the tasks go to others meanwhile.
                stopped[victim] = now + chaos.uniform(0.3, 2 * STORM_LEASE + 1)
                stops += 1
            time.sleep(0.5)
    finally:
        for n, proc in workers.items():
            if n in stopped:
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - started
    found = effects(txn_engine)
    logs = "".join(path.read_text(errors="replace") for path in tmp_path.glob("worker-*.log"))
    rolled_back = logs.count("its lease was lost")
    figures = (
        f"kill storm on {backend.name}: {STORM_TASKS} tasks in {elapsed:.1f}s, {kills} SIGKILLs, "
        f"{stops} SIGSTOPs, {rolled_back} runs rolled back for a lost lease; "
        f"statuses {statuses(txn_engine)}, {sum(found.values())} effect rows for {len(found)} tasks"
    )
    print(figures)
    assert statuses(txn_engine) == {"completed": STORM_TASKS}, figures
    assert sum(found.values()) == STORM_TASKS, figures
    assert set(found) == set(range(STORM_TASKS)), figures
    assert max(found.values()) == 1, f"a task's writes committed twice: {figures}"
    assert "Traceback" not in logs, logs[-5000:]


@pytest.mark.slow  # starts processes: run in each backend's full session
@pytest.mark.backends("sqlite")
def test_workers_sharing_a_sqlite_file_keep_their_leases_behind_transactional_tasks(
    backend: Backend, txn_engine: sa.Engine, tmp_path: Path
) -> None:
    """Four watched workers of two slots, a 2 s lease, each task holding SQLite's one write lock for its run.

    A renewal waiting for that lock in no order behind the tasks would run
    out of time, and the watchdog would kill its worker: none may die.
    """
    lease, count = 2.0, 160
    queue = make_txn_queue(txn_engine, None, timedelta(seconds=lease), bind=txn_engine)
    pauses = random.Random(20261128)
    with Session(txn_engine) as session:
        tasks = ({"key": key, "pause": pauses.uniform(0.02, 0.1)} for key in range(count))
        queue.enqueue_many(session, "effect", tasks, max_attempts=1)
        session.commit()
    queue.close()
    workers = [start_worker(backend, tmp_path, n, "--watchdog", lease=lease) for n in range(4)]

    def all_done() -> bool:
        for n, worker in enumerate(workers):
            log = (tmp_path / f"worker-{n}.log").read_text()
            assert worker.poll() is None, f"worker {n} ended ({worker.returncode}): {log[-2000:]}"
        return statuses(txn_engine).get("completed", 0) == count

    try:
        wait_until(all_done, 120, f"the workers to complete {count} tasks")
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert effects(txn_engine) == dict.fromkeys(range(count), 1)
