"""Paused queues: stored in the control table, honoured by every worker, resumed at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.strategies.claiming import ClaimRequest, due_clause
from sa_taskqueue.worker import claim_loop as claim_loop_module
from tests.app import executions, make_queue
from tests.backends import Backend
from tests.helpers import ROOT, enqueue_one, run_cli, start_cli, wait_until


def queued_keys(engine: sa.Engine) -> set[int]:
    """The ``key`` of every task still queued."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tq.Task.params).where(tq.Task.status == tq.TaskStatus.QUEUED))
        return {params["key"] for (params,) in rows}


def completed(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count()).select_from(tq.Task).where(tq.Task.status == tq.TaskStatus.COMPLETED)
        ).scalar_one()


def test_a_paused_queue_is_left_out_of_claims_until_resumed(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    held = [enqueue_one(queue, engine, "record", {"key": n}, queue="held") for n in range(3)]
    free = [enqueue_one(queue, engine, "record", {"key": 10 + n}, queue="free") for n in range(3)]
    queue.pause("held")
    queue.pause("held")  # twice is the same as once
    assert queue.paused_queues() == ["held"]
    # Another queue object of the table (another process, as far as the table knows) reads it too.
    other = make_queue(engine, queue.strategy.name, queue.lease)
    try:
        assert sorted(task.id for task in other.claim(limit=10)) == free, "every queue but the paused one"
        assert other.claim(limit=10, queues=["held"]) == [], "nor when asked for by name"
        assert other.claim(limit=10, queues=["held", "free"]) == []
    finally:
        other.close()
    queue.resume("held")
    queue.resume("held")
    queue.resume("never-paused")
    assert queue.paused_queues() == []
    assert sorted(task.id for task in queue.claim(limit=10, queues=["held"])) == held


def test_pausing_changes_the_claim_sql_only_while_a_queue_is_paused() -> None:
    now = utcnow()
    plain = ClaimRequest(limit=1, queues=None, worker_id="w", now=now, lease_until=now)
    paused = ClaimRequest(limit=1, queues=None, worker_id="w", now=now, lease_until=now, paused=("a", "b"))
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    plain_sql = str(due_clause(tq.Task.__table__, plain).compile(dialect=dialect))  # type: ignore[arg-type]
    paused_sql = str(due_clause(tq.Task.__table__, paused).compile(dialect=dialect))  # type: ignore[arg-type]
    assert "NOT IN" not in plain_sql
    assert paused_sql.startswith(plain_sql) and "NOT IN" in paused_sql
    assert plain.shape != paused.shape, "the two are cached as different statements"
    assert paused.params()["claim_paused_1"] == "b"


def test_bad_queue_names_are_refused(default_queue: tq.TaskQueue, backend: Backend) -> None:
    with pytest.raises(ValueError, match="queue must be a non-empty string"):
        default_queue.pause("")
    with pytest.raises(TypeError, match="queue must be a string"):
        default_queue.resume(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="queue must be a non-empty string of at most"):
        default_queue.pause("x" * 1000)
    result = run_cli("pause", "", url=backend.url)
    assert result.returncode == 2 and "queue must be a non-empty string" in result.stderr, result.stderr
    assert default_queue.paused_queues() == []


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_worker_processes_leave_a_paused_queue_queued_and_drain_it_once_resumed(
    backend: Backend, engine: sa.Engine
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    workers = [
        start_cli(
            "worker", "tests.cli_app:queue", "--poll-interval", "0.2", "--concurrency", "2", url=backend.url
        )
        for _ in range(2)
    ]
    try:
        paused = run_cli("pause", "held", url=backend.url)
        assert paused.returncode == 0 and "paused queue held" in paused.stdout, paused.stderr
        # The held tasks come due a while after the pause (the workers read it
        # within their poll interval), and the free ones after them: once the
        # free ones are done, the workers were claiming while the held ones
        # were due.
        soon = utcnow() + timedelta(seconds=1.5)
        for n in range(10):
            enqueue_one(queue, engine, "record", {"key": n}, queue="held", run_at=soon)
        for n in range(10):
            enqueue_one(
                queue, engine, "record", {"key": 100 + n}, queue="free", run_at=soon + timedelta(seconds=0.5)
            )
        wait_until(lambda: completed(engine) == 10, 60, "the free queue to drain")
        assert queued_keys(engine) == set(range(10)), "the paused queue's tasks are all still queued"
        assert sorted(executions(engine)) == list(range(100, 110))
        status = run_cli("status", url=backend.url)
        assert status.returncode == 0 and "paused queues: held" in status.stdout, status.stderr
        resumed = run_cli("resume", "held", url=backend.url)
        assert resumed.returncode == 0 and "resumed queue held" in resumed.stdout, resumed.stderr
        wait_until(lambda: completed(engine) == 20, 30, "the resumed queue to drain")
        assert set(executions(engine).values()) == {1}
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.communicate(timeout=60)
    queue.close()


RACER = """
import sys, time
from pathlib import Path
import sqlalchemy as sa
import sa_taskqueue as tq
queue = tq.TaskQueue(sa.create_engine(sys.argv[1]))
while not Path(sys.argv[2]).exists():
    time.sleep(0.01)
for n in range(8):
    queue.pause(f"race-{n}")
print("done")
"""


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_processes_pausing_at_once_all_succeed(backend: Backend, engine: sa.Engine, tmp_path: Path) -> None:
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, backend.url, str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    go.touch()  # each first pause of a queue inserts its row: they race to create it
    outputs = [racer.communicate(timeout=120) for racer in racers]
    for racer, (out, err) in zip(racers, outputs, strict=True):
        assert racer.returncode == 0 and out.strip() == "done", err
    queue = tq.TaskQueue(engine)
    assert queue.paused_queues() == [f"race-{n}" for n in range(8)]
    for n in range(8):
        queue.resume(f"race-{n}")
    assert queue.paused_queues() == []


@pytest.mark.requires("notify")
def test_a_listening_worker_picks_up_a_resume_at_once(
    backend: Backend, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every empty claim waits the whole poll interval (60s): only the
    # notification of the resume can wake the worker within the test's wait.
    monkeypatch.setattr(claim_loop_module, "MIN_POLL_INTERVAL", 60.0)
    queue = make_queue(engine, None, timedelta(minutes=5))
    queue.pause("held")
    enqueue_one(queue, engine, "record", {"key": 1}, queue="held")
    worker = tq.Worker(queue, queues=["held"], poll_interval=60.0, watchdog=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:

        def listening_to_pauses() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.scalar(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND query LIKE 'LISTEN %sa_taskqueue_ctl_%'"
                        )
                    )
                )

        wait_until(listening_to_pauses, 30, "the worker to listen for pauses")
        assert queued_keys(engine) == {1}
        # Resumed through another queue object: the worker's own kept set is stale.
        tq.TaskQueue(engine).resume("held")
        wait_until(lambda: executions(engine) == {1: 1}, 5, "the resumed task to run")
    finally:
        worker.stop()
        thread.join(timeout=30)
    queue.close()


def test_a_worker_reads_the_pauses_beside_its_claims_never_before_them(engine: sa.Engine) -> None:
    # A busy worker with a short poll interval: every read of the control
    # table is its pause watch's, in a thread of its own, but for at most
    # one by the first claim, sent before the watch's first read.
    queue = make_queue(engine, None, timedelta(minutes=5))
    with Session(engine) as session:
        queue.enqueue_many(session, "record", [{"key": n} for n in range(200)])
        session.commit()
    control = tq.Task.__table__.name + "_control"
    readers: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        if control in statement and statement.lstrip().upper().startswith("SELECT"):
            readers.append(threading.current_thread().name)

    sa.event.listen(queue.engine, "before_cursor_execute", seen)
    try:
        worker = tq.Worker(
            queue, concurrency=4, burst=True, poll_interval=0.01, watchdog=False, self_test=False
        )
        worker.run()
    finally:
        sa.event.remove(queue.engine, "before_cursor_execute", seen)
        queue.close()
    assert executions(engine) == dict.fromkeys(range(200), 1)
    assert readers, "the watch read the pauses at least once"
    off_the_watch = [name for name in readers if name != "sa_taskqueue-pauses"]
    assert len(off_the_watch) <= 1, readers


def test_a_worker_sees_a_pause_made_elsewhere_without_a_notification(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No LISTEN, every empty claim followed by a minute's wait, and the pause
    # made through another queue object once the worker is idle: only the
    # worker's watch can bring it in.
    monkeypatch.setattr(claim_loop_module, "MIN_POLL_INTERVAL", 60.0)
    queue = make_queue(engine, None, timedelta(minutes=5))
    enqueue_one(queue, engine, "record", {"key": 1}, queue="free")
    worker = tq.Worker(queue, poll_interval=60.0, listen=False, watchdog=False, self_test=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    other = tq.TaskQueue(engine)
    try:
        wait_until(lambda: executions(engine) == {1: 1}, 30, "the worker to claim and run its first task")
        other.pause("held")
        wait_until(lambda: "held" in queue.paused.queues, 10, "the worker's watch to read the pause")
        other.resume("held")
        wait_until(lambda: not queue.paused.queues, 10, "the worker's watch to read the resume")
    finally:
        worker.stop()
        thread.join(timeout=30)
        other.close()
        queue.close()
