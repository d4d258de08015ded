"""Live workers: each worker listed while it lives, with what it runs; and the tasks no live worker serves."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.core.worker_table import worker_table_of
from sa_taskqueue.features import live_workers
from sa_taskqueue.features.admin import Admin
from sa_taskqueue.features.live_workers import (
    EXPIRES_AFTER_HEARTBEATS,
    PRUNE_AFTER,
    WorkerRecord,
    register_worker,
)
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import ROOT, MovableClock, enqueue_one, start_cli, wait_until

TABLE = tq.Task.__table__
#: The test application's lease for worker processes: heartbeats every 0.75s, expiry 2.25s after the last.
SHORT_LEASE = "3"


def worker_rows(engine: sa.Engine) -> list[sa.Row[tuple[object, ...]]]:
    """Every row of the live-worker table, expired or not."""
    table = worker_table_of(TABLE)
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table).order_by(table.c.id)))


def register(
    engine: sa.Engine,
    worker_id: str,
    queues: list[str] | None,
    names: list[str],
    *,
    ttl: timedelta = timedelta(minutes=1),
    at: datetime | None = None,
) -> None:
    """A worker's row as its service writes it at start, without the worker."""
    now = utcnow() if at is None else at
    register_worker(engine, TABLE, WorkerRecord.of(worker_id, queues, names, 2), now, now + ttl)


def enqueue_named(engine: sa.Engine, name: str, queue: str = "default", **options: object) -> int:
    """A task of any name, as the command line enqueues it (no registration needed)."""
    return Admin(engine, TABLE).enqueue(name, {}, queue=queue, **options)  # type: ignore[arg-type]


# The listing and the unserved tasks, from rows ----------------------------------------------


def test_a_registered_worker_is_listed_until_it_expires_and_not_after(engine: sa.Engine) -> None:
    now = utcnow()
    register(engine, "host:1:aa", ["mail", "reports"], ["app.send", "app.report"], at=now)
    register(engine, "host:2:bb", None, ["app.send"], ttl=timedelta(seconds=10), at=now)
    listed = tq.list_live_workers(engine, TABLE, now=now + timedelta(seconds=1))
    assert [worker.id for worker in listed] == ["host:1:aa", "host:2:bb"]
    first = listed[0]
    assert first.queues == ["mail", "reports"] and first.task_names == ["app.report", "app.send"]
    assert first.concurrency == 2 and first.pid == os.getpid() and first.version == tq.__version__
    assert first.started_at == first.heartbeat_at == now and first.expires_at == now + timedelta(minutes=1)
    assert first.running == []
    assert listed[1].queues == ["*"], "a worker claiming every queue"
    later = tq.list_live_workers(engine, TABLE, now=now + timedelta(seconds=10))
    assert [worker.id for worker in later] == ["host:1:aa"], "the second expired, and is left out"
    assert len(worker_rows(engine)) == 2, "its row stays until pruned"


def test_a_live_worker_is_listed_with_the_running_tasks_it_holds(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    ids = [enqueue_one(queue, engine, "record", {"key": n}) for n in range(3)]
    claimed = queue.claim(limit=2, worker_id="host:1:aa")
    queue.claim(limit=1, worker_id="host:9:gone")  # held by a worker not registered
    register(engine, "host:1:aa", None, queue.task_names)
    (worker,) = tq.list_live_workers(engine, TABLE)
    assert sorted(task.id for task in worker.running) == sorted(task.id for task in claimed)
    assert {task.id for task in worker.running} < set(ids)
    for task in worker.running:
        assert (task.name, task.queue) == ("record", "default")
        assert task.started_at is not None and task.locked_until is not None
        assert task.locked_until > task.started_at
    assert queue.workers() == [worker], "the queue's own call lists the same"


def test_unserved_tasks_are_the_due_ones_whose_queue_and_name_no_live_worker_serves(
    engine: sa.Engine,
) -> None:
    now = utcnow()
    register(engine, "w-mail", ["mail"], ["app.send"], at=now)
    register(engine, "w-all", None, ["app.any"], at=now)
    register(engine, "w-dead", ["reports"], ["app.report"], ttl=timedelta(seconds=-1), at=now)
    enqueue_named(engine, "app.send", "mail")  # served by w-mail
    enqueue_named(engine, "app.any", "whatever")  # served by w-all, on every queue
    enqueue_named(engine, "app.send", "other")  # its name is known, not on this queue
    enqueue_named(engine, "app.nobody", "mail")
    enqueue_named(engine, "app.nobody", "mail")
    enqueue_named(engine, "app.report", "reports")  # only a dead worker served it
    enqueue_named(engine, "app.later", "mail", delay=timedelta(hours=1))  # not due: not waiting yet
    found = tq.unserved_tasks(engine, TABLE, now=utcnow())
    assert {(group.queue, group.name, group.count) for group in found} == {
        ("other", "app.send", 1),
        ("mail", "app.nobody", 2),
        ("reports", "app.report", 1),
    }
    assert all(group.oldest_age >= timedelta(0) for group in found)
    ages = [group.oldest_age for group in found]
    assert ages == sorted(ages, reverse=True), "the longest waiting first"


def test_with_no_live_worker_every_due_task_is_unserved_and_with_none_due_nothing(engine: sa.Engine) -> None:
    assert tq.unserved_tasks(engine, TABLE) == []
    enqueue_named(engine, "app.send")
    (group,) = tq.unserved_tasks(engine, TABLE, now=utcnow() + timedelta(minutes=2))
    assert (group.queue, group.name, group.count) == ("default", "app.send", 1)
    assert group.oldest_age >= timedelta(minutes=2)


def test_a_heartbeat_moves_the_row_on_and_writes_it_again_when_it_is_gone(engine: sa.Engine) -> None:
    now = utcnow()
    record = WorkerRecord.of("host:1:aa", ["a"], ["app.x"], 1)
    assert live_workers.heartbeat_worker(engine, TABLE, record, now, now + timedelta(seconds=3)) is True
    later = now + timedelta(seconds=1)
    assert live_workers.heartbeat_worker(engine, TABLE, record, later, later + timedelta(seconds=3)) is False
    (row,) = worker_rows(engine)
    assert (row.started_at, row.heartbeat_at, row.expires_at) == (now, later, later + timedelta(seconds=3))
    live_workers.deregister_worker(engine, TABLE, "host:1:aa")
    assert worker_rows(engine) == []


@pytest.mark.parametrize("write", ["register", "heartbeat"])
def test_a_twin_that_writes_the_row_first_never_fails_the_worker(engine: sa.Engine, write: str) -> None:
    """Two `Worker` objects of one process share its id: the second INSERT finds the key taken, and is fine.

    The twin's INSERT is held uncommitted on another connection while this
    worker writes, so this worker's INSERT waits on the twin's key and finds
    it taken once the twin commits: so on PostgreSQL.  SQLite's one writer,
    and InnoDB's lock on the key the DELETE looks for, make this worker wait
    before its DELETE instead, which then replaces the twin's row.
    """
    now = utcnow()
    record = WorkerRecord.of("host:1:twin", ["a"], ["app.x"], 1)
    table = worker_table_of(TABLE)
    errors: list[BaseException] = []

    def write_ours() -> None:
        try:
            if write == "register":
                register_worker(engine, TABLE, record, now, now + timedelta(seconds=3))
            else:
                live_workers.heartbeat_worker(engine, TABLE, record, now, now + timedelta(seconds=3))
        except BaseException as error:  # noqa: BLE001 - the test reports it below
            errors.append(error)

    with engine.connect() as twin:
        twin.execute(
            sa.insert(table).values(
                id=record.id, host="host", pid=1, queues=["a"], task_names=["app.x"], concurrency=1,
                version="0", started_at=now, heartbeat_at=now, expires_at=now + timedelta(seconds=3),
            )
        )  # fmt: skip
        ours = threading.Thread(target=write_ours)
        ours.start()
        ours.join(timeout=1)  # ours waits on the twin's uncommitted key (or lock) meanwhile
        twin.commit()
    ours.join(timeout=30)
    assert not ours.is_alive()
    assert errors == []
    assert [row.id for row in worker_rows(engine)] == [record.id]


def test_pruning_deletes_only_rows_expired_long_ago(engine: sa.Engine) -> None:
    now = utcnow()
    register(engine, "old", None, [], ttl=timedelta(0), at=now - PRUNE_AFTER - timedelta(seconds=1))
    register(engine, "recent", None, [], ttl=timedelta(0), at=now - PRUNE_AFTER + timedelta(minutes=1))
    register(engine, "live", None, [], at=now)
    assert live_workers.prune_workers(engine, TABLE, now=now) == 1
    assert [row.id for row in worker_rows(engine)] == ["live", "recent"]


def test_the_listing_names_a_missing_live_worker_table_and_how_to_make_it(backend: Backend) -> None:
    # The task table alone, as a database not migrated since the live-worker table came.
    other = sa.MetaData()
    table = sa.Table("lw_only_tasks", other, sa.Column("id", sa.Integer, primary_key=True))
    engine = sa.create_engine(backend.url)
    try:
        table.create(engine)
        with pytest.raises(tq.SchemaMissing, match=r"live-worker table 'lw_only_tasks_workers'.*migrate"):
            tq.list_live_workers(engine, table)
    finally:
        table.drop(engine)
        engine.dispose()


# The worker's service: registered in process, its warning on an injected clock -------------


@pytest.fixture
def clocked_worker(
    engine: sa.Engine, clock: MovableClock
) -> Iterator[tuple[tq.TaskQueue, tq.Worker, threading.Thread]]:
    """A worker of the test application's queue on ``clock``, running in a thread (lease 3s)."""
    queue = make_queue(engine, None, timedelta(seconds=3), clock.now)
    worker = tq.Worker(queue, queues=["default"], watchdog=False, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, daemon=True)
    yield queue, worker, thread
    worker.stop()
    thread.join(timeout=30)
    queue.close()


def test_a_worker_logs_the_unserved_tasks_at_start_then_at_most_every_five_minutes(
    engine: sa.Engine,
    clock: MovableClock,
    clocked_worker: tuple[tq.TaskQueue, tq.Worker, threading.Thread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _queue, worker, thread = clocked_worker
    # Due before the clock's now: enqueued a minute back.
    enqueue_named(engine, "app.nobody", run_at=clock.now() - timedelta(minutes=1))
    enqueue_named(engine, "record", "elsewhere", run_at=clock.now() - timedelta(minutes=1))

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no live worker serves" in r.getMessage()]

    def beat_at(moment: datetime) -> bool:
        return any(row.heartbeat_at == moment for row in worker_rows(engine))

    with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
        thread.start()
        wait_until(warnings, 30, "the warning at start")
        (line,) = warnings()
        assert "app.nobody on queue default (1 due, oldest 1.0m)" in line
        assert "record on queue elsewhere (1 due, oldest 1.0m)" in line, "its name is known, not its queue"
        # Four minutes on, two heartbeats later: nothing more is said.
        four_on = clock.advance(timedelta(minutes=4))
        wait_until(lambda: beat_at(four_on), 30, "a heartbeat four minutes on")
        then = clock.advance(timedelta(seconds=1))
        wait_until(lambda: beat_at(then), 30, "the heartbeat after it")
        assert len(warnings()) == 1
        # Five minutes after the first, the next heartbeat says it again.
        clock.advance(timedelta(minutes=1))
        wait_until(lambda: len(warnings()) == 2, 30, "the warning five minutes on")
        assert "app.nobody on queue default (1 due, oldest 6.0m)" in warnings()[1]
    assert worker.worker_id in {row.id for row in worker_rows(engine)}


def test_a_worker_with_every_due_task_served_says_nothing(
    engine: sa.Engine,
    clock: MovableClock,
    clocked_worker: tuple[tq.TaskQueue, tq.Worker, threading.Thread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue, _worker, thread = clocked_worker
    queue.pause("default")  # the task stays due, and queued: served all the same
    enqueue_named(engine, "record", run_at=clock.now() - timedelta(minutes=1))
    with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
        thread.start()
        wait_until(lambda: queue.workers(), 30, "the worker to register")
        # Its first check follows its registration in the same heartbeat: wait for the next one.
        then = clock.advance(timedelta(seconds=1))
        wait_until(lambda: any(r.heartbeat_at == then for r in worker_rows(engine)), 30, "a later heartbeat")
    assert not [r for r in caplog.records if "no live worker serves" in r.getMessage()]
    assert tq.unserved_tasks(engine, TABLE, now=clock.now()) == []


def test_a_worker_deletes_its_row_when_it_stops_and_prunes_rows_long_expired(
    engine: sa.Engine, clock: MovableClock, clocked_worker: tuple[tq.TaskQueue, tq.Worker, threading.Thread]
) -> None:
    _queue, worker, thread = clocked_worker
    register(engine, "gone:1:aa", None, [], ttl=timedelta(0), at=clock.now() - PRUNE_AFTER - timedelta(1))
    thread.start()
    wait_until(lambda: [row.id for row in worker_rows(engine)] == [worker.worker_id], 30, "the prune")
    (row,) = worker_rows(engine)
    assert row.expires_at == row.heartbeat_at + timedelta(seconds=0.75) * EXPIRES_AFTER_HEARTBEATS
    worker.stop()
    thread.join(timeout=30)
    assert worker_rows(engine) == []


# Worker processes ------------------------------------------------------------------------


def worker_process(backend: Backend, *args: str) -> subprocess.Popen[str]:
    return start_cli(
        "worker",
        "tests.cli_app:queue",
        "--poll-interval",
        "0.2",
        "--shutdown-timeout",
        "0",
        *args,
        url=backend.url,
        SA_TASKQUEUE_TEST_LEASE=SHORT_LEASE,
    )


def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, then what it wrote to stderr (its log) once it has exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=60)
    return err or ""


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_worker_processes_are_listed_with_what_they_run_and_a_clean_exit_removes_the_row(
    backend: Backend, engine: sa.Engine
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    first = worker_process(backend, "--queues", "mail,reports", "--concurrency", "2")
    second = worker_process(backend, "--queues", "other")
    try:
        wait_until(lambda: len(queue.workers()) == 2, 60, "both workers to register")
        task_id = enqueue_one(queue, engine, "record", {"key": 1, "sleep": 60}, queue="mail")
        wait_until(lambda: any(w.running for w in queue.workers()), 60, "the task to run")
        by_pid = {worker.pid: worker for worker in queue.workers()}
        assert set(by_pid) == {first.pid, second.pid}
        mail = by_pid[first.pid]
        assert mail.queues == ["mail", "reports"] and mail.concurrency == 2
        assert mail.task_names == queue.task_names and mail.version == tq.__version__
        assert [(task.id, task.name, task.queue) for task in mail.running] == [(task_id, "record", "mail")]
        with engine.connect() as conn:
            locked_by = conn.scalar(sa.select(tq.Task.locked_by).where(tq.Task.id == task_id))
        assert mail.id == locked_by, "listed under the id it writes on the tasks it holds"
        assert by_pid[second.pid].queues == ["other"] and by_pid[second.pid].running == []

        stop(second)
        assert [worker.pid for worker in queue.workers()] == [first.pid]
        assert len(worker_rows(engine)) == 1, "its row was deleted, not left to expire"
    finally:
        stop(first)
        stop(second)
        queue.close()
    assert worker_rows(engine) == []


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_a_killed_worker_drops_out_once_its_heartbeat_lapses_and_its_row_is_pruned_later(
    backend: Backend, engine: sa.Engine, clock: MovableClock
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    process = worker_process(backend)
    try:
        wait_until(lambda: queue.workers(), 60, "the worker to register")
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=60)
    (row,) = worker_rows(engine)
    assert row.expires_at - row.heartbeat_at == timedelta(seconds=2.25), "three heartbeats of a 3s lease"
    # Listed until its heartbeat lapses, then not.
    wait_until(lambda: not queue.workers(), 30, "the killed worker to drop out")
    assert utcnow() >= row.expires_at
    assert [r.id for r in worker_rows(engine)] == [row.id], "its row stays until it has long expired"
    # The next worker to prune, long after (its clock moved on), deletes it.
    clock.advance(PRUNE_AFTER + timedelta(seconds=10))
    later = make_queue(engine, None, timedelta(seconds=3), clock.now)
    worker = tq.Worker(later, watchdog=False, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: [r.id for r in worker_rows(engine)] == [worker.worker_id], 30, "the prune")
    finally:
        worker.stop()
        thread.join(timeout=30)
        later.close()
        queue.close()


# A task registered in a script run directly ----------------------------------------------


SCRIPT = """
import sqlalchemy as sa
import sa_taskqueue as tq

queue = tq.TaskQueue(sa.create_engine("sqlite://"))

@queue.task{options}
def hello() -> None:
    pass

print("registered", queue.task_names)
"""


@pytest.mark.parametrize(("options", "registered"), [("", None), ('(name="hello")', "hello")])
def test_a_task_named_after_a_script_run_directly_is_refused_and_a_named_one_is_not(
    tmp_path: Path, options: str, registered: str | None
) -> None:
    script = tmp_path / "greetings.py"
    script.write_text(SCRIPT.format(options=options))
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if registered is not None:
        assert run.returncode == 0, run.stderr
        assert f"registered ['{registered}']" in run.stdout
        return
    assert run.returncode == 1
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("ValueError: cannot name task 'hello' after its module")
    assert "'__main__.hello', a name no worker finds" in error
    assert "(as greetings.hello)" in error, "the name a worker importing it would know"
    assert '@queue.task(name="hello")' in error and "a module the script imports" in error
