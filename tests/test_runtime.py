"""The production worker: shutdown, process isolation, timeouts, outages, wake-ups, hooks, logs."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core import notify
from sa_taskqueue.worker import services as services_module
from tests.app import executions
from tests.backends import Backend, reachable
from tests.helpers import (
    StreamLines,
    kill_other_sessions,
    listening,
    received,
    start_cli,
    task_row,
    task_rows,
    wait_until,
)
from tests.helpers import enqueue_one as enqueue

WORKER = ("worker", "tests.cli_app:queue", "--poll-interval", "0.1")


def stop(worker: object, sig: int = signal.SIGTERM, timeout: float = 30) -> tuple[int, str]:
    worker.send_signal(sig)  # type: ignore[attr-defined]
    _, err = worker.communicate(timeout=timeout)  # type: ignore[attr-defined]
    return worker.returncode, err  # type: ignore[attr-defined]


@pytest.mark.slow
def test_sigterm_lets_a_running_task_finish_then_exits_0(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    task_id = enqueue(default_queue, engine, "record", {"key": 1, "sleep": 1.5})
    worker = start_cli(
        *WORKER,
        "--shutdown-timeout",
        "30",
        url=backend.url,
    )
    try:
        wait_until(lambda: task_row(engine, task_id).status == tq.TaskStatus.RUNNING, 30, "the task to start")
        returncode, err = stop(worker)
    finally:
        worker.kill()
    assert returncode == 0, err
    assert task_row(engine, task_id).status == tq.TaskStatus.COMPLETED
    assert executions(engine) == {1: 1}


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_sigterm_gives_back_a_task_that_outlasts_the_shutdown_timeout(
    backend: Backend, engine: sa.Engine, queue: tq.TaskQueue, strategy_name: str, isolation: str
) -> None:
    task_id = enqueue(queue, engine, "hang", {"key": 7})
    worker = start_cli(
        *WORKER,
        "--shutdown-timeout",
        "0.5",
        "--isolation",
        isolation,
        url=backend.url,
        SA_TASKQUEUE_TEST_STRATEGY=strategy_name,
    )
    try:
        wait_until(lambda: executions(engine).get(7) == 1, 30, "the task to start")
        returncode, err = stop(worker)
    finally:
        worker.kill()
    assert returncode == 0, err
    row = task_row(engine, task_id)
    assert (row.status, row.attempts) == (tq.TaskStatus.QUEUED, 0), "given back, the attempt not counted"
    assert "given back" in err
    [again] = queue.claim()
    assert (again.id, again.attempts) == (task_id, 1), "claimable at once by the next worker"


@pytest.mark.slow
def test_a_second_signal_stops_at_once(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    enqueue(default_queue, engine, "hang", {"key": 7})
    worker = start_cli(*WORKER, "--shutdown-timeout", "600", url=backend.url)
    log = StreamLines(worker.stderr)
    try:
        wait_until(lambda: executions(engine).get(7) == 1, 30, "the task to start")
        worker.send_signal(signal.SIGTERM)
        log.wait_for(lambda line: "received SIGTERM:" in line, 30, "the worker to handle the SIGTERM")
        worker.send_signal(signal.SIGINT)
        returncode = worker.wait(timeout=15)
    finally:
        worker.kill()
    err = log.text()
    assert returncode != 0, err
    assert "received SIGINT again: exiting now" in err, err
    assert task_rows(engine)[0].status == tq.TaskStatus.RUNNING, "left to its lease"


@pytest.mark.slow
def test_process_isolation_contains_crashes_and_enforces_timeouts(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    ids = {
        "exit": enqueue(default_queue, engine, "exit_hard", {"code": 3}, max_attempts=1),
        "segfault": enqueue(default_queue, engine, "segfault", {}, max_attempts=1),
        "timeout": enqueue(default_queue, engine, "slow", {"seconds": 60}, max_attempts=1),
        "raises": enqueue(default_queue, engine, "boom", {"message": "in a child"}, max_attempts=1),
        "fine": enqueue(default_queue, engine, "record", {"key": 1}),
    }
    worker = start_cli(
        *WORKER,
        "--isolation",
        "process",
        "--concurrency",
        "2",
        "--burst",
        url=backend.url,
    )
    _, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, err
    rows = {name: task_row(engine, task_id) for name, task_id in ids.items()}
    assert rows["fine"].status == tq.TaskStatus.COMPLETED
    assert executions(engine) == {1: 1}
    for name in ("exit", "segfault", "timeout", "raises"):
        assert rows[name].status == tq.TaskStatus.FAILED, name
    assert "exited with code 3" in (rows["exit"].last_error or "")
    assert "SIGSEGV" in (rows["segfault"].last_error or "")
    assert "killed after its 0.5s timeout" in (rows["timeout"].last_error or "")
    assert "ValueError: in a child" in (rows["raises"].last_error or "")
    assert "Traceback" in (rows["raises"].last_error or "")


def test_a_thread_task_that_returns_after_its_timeout_is_failed(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    task_id = enqueue(default_queue, engine, "slow", {"seconds": 0.8}, max_attempts=1)
    default_queue.run_worker(burst=True, poll_interval=0.05)
    row = task_row(engine, task_id)
    assert row.status == tq.TaskStatus.FAILED
    assert "over its 0.5s timeout" in (row.last_error or "")


def test_hooks_see_every_start_success_and_failure(default_queue: tq.TaskQueue, engine: sa.Engine) -> None:
    ok = enqueue(default_queue, engine, "record", {"key": 1})
    bad = enqueue(default_queue, engine, "boom", {"message": "nope"}, max_attempts=1)
    seen: list[tuple[str, int, object]] = []

    def broken_hook(task: tq.ClaimedTask, result: object) -> None:
        seen.append(("success", task.id, result))
        raise RuntimeError("a broken metrics hook must not break the worker")

    default_queue.run_worker(
        burst=True,
        poll_interval=0.05,
        on_start=lambda task: seen.append(("start", task.id, None)),
        on_success=broken_hook,
        on_failure=lambda task, error: seen.append(("failure", task.id, type(error).__name__)),
    )
    assert sorted(seen, key=str) == sorted(
        [("start", ok, None), ("start", bad, None), ("success", ok, 1), ("failure", bad, "ValueError")],
        key=str,
    )
    assert task_row(engine, ok).status == tq.TaskStatus.COMPLETED


@pytest.mark.slow
def test_json_logs_one_object_per_line_with_task_start_and_end(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    task_id = enqueue(default_queue, engine, "record", {"key": 1})
    worker = start_cli(*WORKER, "--burst", "--log-format", "json", url=backend.url)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    entries = [json.loads(line) for line in err.splitlines() if line.strip()]
    messages = [entry["message"] for entry in entries]
    assert f"task {task_id} record attempt 1 started" in messages
    assert any(m.startswith(f"task {task_id} record attempt 1 done in ") for m in messages)
    assert {entry["logger"] for entry in entries} == {"sa_taskqueue"}


#: A command that restarts the local PostgreSQL server; where it is set, the
#: outage test restarts the server instead of terminating the backends.
RESTART_ENV = "SA_TASKQUEUE_TEST_POSTGRES_RESTART"


def drop_connections(engine: sa.Engine) -> int:
    """Kill every other session on this database, as a failover or an admin would."""
    with engine.connect() as conn:
        return kill_other_sessions(conn)


@pytest.mark.slow
@pytest.mark.backends("postgres", "mysql", "mariadb")  # a server whose sessions another one can kill
def test_the_worker_survives_a_restart_or_its_connections_being_killed(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    worker = start_cli(*WORKER, "--concurrency", "2", url=backend.url)
    try:
        first = enqueue(default_queue, engine, "record", {"key": 1})
        wait_until(lambda: task_row(engine, first).status == tq.TaskStatus.COMPLETED, 30, "the first task")
        engine.dispose()  # our own pooled connections go too
        restart = os.environ.get(RESTART_ENV) if backend.name == "postgres" else None
        if restart:
            # Allowed here: restart the whole server under the running worker.
            subprocess.run(shlex.split(restart), check=True, timeout=120)
        else:
            assert drop_connections(engine) >= 1
        engine.dispose()
        wait_until(lambda: reachable(backend.url), 60, "the database to answer again")
        second = enqueue(default_queue, engine, "record", {"key": 2})
        wait_until(lambda: task_row(engine, second).status == tq.TaskStatus.COMPLETED, 60, "the second task")
        returncode, err = stop(worker)
    finally:
        worker.kill()
    assert returncode == 0, err
    assert executions(engine) == {1: 1, 2: 1}, "nothing lost, nothing run twice"
    assert "Traceback" not in err, err


#: The worker's text log line: its time, then the message.
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
NEXT_POLL = re.compile(r"nothing more due: next poll in (\d+\.\d+)s$")


def logged(line: str) -> tuple[datetime, str] | None:
    """When a line of the worker's text log was written, and its message."""
    match = LOG_LINE.match(line.rstrip("\n"))
    if match is None:
        return None
    return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f"), match[2]


def logged_at(line: str) -> datetime:
    entry = logged(line)
    assert entry is not None, line
    return entry[0]


def long_idle_wait(line: str, seconds: float) -> float | None:
    """The next poll the line announces, if it is ``seconds`` away or more."""
    entry = logged(line)
    match = NEXT_POLL.search(entry[1]) if entry else None
    return float(match[1]) if match and float(match[1]) >= seconds else None


@pytest.mark.slow
@pytest.mark.requires("notify", "listen")
def test_notify_wakes_an_idle_worker_long_before_its_poll(
    backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    worker = start_cli(
        "worker", "tests.cli_app:queue", "--poll-interval", "120", "--log-level", "debug", url=backend.url
    )
    log = StreamLines(worker.stderr)
    try:
        # Idle until its backoff has grown: the worker says its next poll is
        # seconds away (5 s or more: 6.4 s less up to 20% jitter).
        idle_line = log.wait_for(lambda line: long_idle_wait(line, 5.0), 60, "a next poll 5 s away")
        task_id = enqueue(default_queue, engine, "record", {"key": 1})
        wait_until(lambda: task_row(engine, task_id).status == tq.TaskStatus.COMPLETED, 30, "the task")
        worker.send_signal(signal.SIGTERM)
        returncode = worker.wait(timeout=30)
    finally:
        worker.kill()
    err = log.text()
    assert returncode == 0, err
    # By the worker's own log, the task started well inside that wait: only
    # the NOTIFY can have ended it (the poll would have come ``poll_in`` after).
    poll_in = long_idle_wait(idle_line, 5.0)
    assert poll_in is not None
    start_line = next(line for line in err.splitlines() if f"task {task_id} record attempt 1 started" in line)
    assert (logged_at(start_line) - logged_at(idle_line)).total_seconds() < poll_in / 2, err


@pytest.mark.requires("notify", "listen")
def test_a_listening_worker_stops_without_waiting_out_its_quiet_connections_wait(
    engine: sa.Engine, default_queue: tq.TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notify, "QUIET_WAIT", 3600.0)  # a quiet connection is read only when woken
    listeners: list[notify.Listener] = []

    def kept_listener(*args: Any, **kwargs: Any) -> notify.Listener:
        listeners.append(notify.Listener(*args, **kwargs))
        return listeners[-1]

    monkeypatch.setattr(services_module, "Listener", kept_listener)
    worker = tq.Worker(default_queue, poll_interval=0.05)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        wait_until(lambda: listen_connections(engine, default_queue) == 1, 30, "the worker to LISTEN")
    finally:
        worker.stop()
        runner.join(timeout=30)
    assert not runner.is_alive()
    assert len(listeners) == 1
    assert not listeners[0].is_alive(), "the listener ended with the worker, not an hour later"
    wait_until(lambda: listen_connections(engine, default_queue) == 0, 30, "its LISTEN connection to close")


def listen_connections(engine: sa.Engine, queue: tq.TaskQueue) -> int:
    """Connections whose last statement LISTENs on ``queue``'s control channel (a worker's listener's)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND query LIKE :listen"
                ),
                {"listen": f"LISTEN %{notify.control_channel_name(queue.table)}%"},
            ).scalar_one()
        )


@pytest.mark.requires("notify")
def test_notify_is_sent_at_commit_and_never_for_a_rollback(
    backend: Backend, default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    with listening(backend, tq.Task.__table__) as listener:
        with Session(engine) as session:
            default_queue.enqueue(session, "record", {"key": 1}, queue="mail")
            assert list(listener.notifies(timeout=0.3)) == [], "nothing before the commit"
            session.rollback()
            with session.begin_nested():  # a savepoint rolled back does not count either
                default_queue.enqueue(session, "record", {"key": 2}, queue="mail")
                session.get_nested_transaction().rollback()  # type: ignore[union-attr]
            default_queue.enqueue(session, "record", {"key": 3}, queue="mail")
            default_queue.enqueue(session, "record", {"key": 4}, queue="mail")
            session.commit()
        payloads = received(listener)
    assert payloads == ["mail"], "one wake-up per queue and commit, none for the rollbacks"
    assert [t.params["key"] for t in task_rows(engine)] == [3, 4]


def test_a_rolled_back_enqueue_leaves_nothing(default_queue: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        default_queue.enqueue(session, "record", {"key": 1})
        session.rollback()
    assert task_rows(engine) == []
    assert default_queue.claim() == []


def test_worker_refuses_bad_settings(default_queue: tq.TaskQueue) -> None:
    with pytest.raises(ValueError, match="isolation"):
        tq.Worker(default_queue, isolation="fiber")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency"):
        tq.Worker(default_queue, concurrency=0)
    with pytest.raises(TypeError, match="queues"):
        tq.Worker(default_queue, queues="default")
    with pytest.raises(ValueError, match="timeout"):
        default_queue.task(name="x", timeout=timedelta(0))(print)
