"""Real worker processes: racing for one table, and killed in the middle of a task."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import executions, make_queue
from tests.backends import Backend
from tests.helpers import MovableClock, task_row, wait_until

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = 8
TASKS = 2000


def app_process(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.app", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def status_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tq.Task.status, sa.func.count()).group_by(tq.Task.status)).all()
    return {str(status): count for status, count in rows}


@pytest.mark.slow
def test_eight_processes_run_every_task_exactly_once(
    backend: Backend, engine: sa.Engine, strategy_name: str, tmp_path: Path
) -> None:
    # A small batch: several claimers compete for the same head rows on every
    # claim, and each claim still takes more than one row.
    batch = 3
    queue = make_queue(engine, strategy_name, timedelta(minutes=5))
    with Session(engine) as session:
        queue.enqueue_many(session, "record", ({"key": n} for n in range(TASKS)))
        session.commit()
    go = tmp_path / "go"
    procs = []
    for n in range(PROCESSES):
        ready = tmp_path / f"ready-{n}"
        procs.append(
            (
                ready,
                app_process(
                    "race",
                    "--url",
                    backend.node_url(n),  # (over a cluster's nodes in turn)
                    "--strategy",
                    strategy_name,
                    "--batch",
                    str(batch),
                    "--ready",
                    str(ready),
                    "--go",
                    str(go),
                ),
            )
        )
    try:
        wait_until(lambda: all(ready.exists() for ready, _ in procs), 120, "the workers to start")
        go.touch()  # all start claiming at once
        outputs = [proc.communicate(timeout=300) for _, proc in procs]
    finally:
        for _, proc in procs:
            proc.kill()
    for (_, proc), (_out, err) in zip(procs, outputs, strict=True):
        # A deadlock, "database is locked" or a lost lease would have ended the
        # process with an exception.
        assert proc.returncode == 0, err
        assert "deadlock" not in err.lower() and "database is locked" not in err.lower(), err
    ran = [json.loads(out)["ran"] for out, _ in outputs]
    ran_per_task = executions(engine)
    assert sorted(ran_per_task) == list(range(TASKS)), "every task ran"
    assert set(ran_per_task.values()) == {1}, "no task ran twice"
    assert sum(ran) == TASKS
    assert sum(1 for n in ran if n > 0) >= 2, f"the processes really raced: {ran}"
    assert status_counts(engine) == {"completed": TASKS}, "none is left"


@pytest.mark.slow
def test_a_task_of_a_killed_worker_is_claimed_again_and_completes(
    backend: Backend, engine: sa.Engine, strategy_name: str
) -> None:
    # Our queue reads the time from a clock that moves only when we move it.
    # The lease strategies free a dead worker's task once its lease has run
    # out on that clock; advisory locks free it with the clock not moved at
    # all, so it is not the lease that frees it there.
    advisory = strategy_name == "advisory_lock"
    lease = timedelta(minutes=10)
    clock = MovableClock()
    queue = make_queue(engine, strategy_name, lease, clock.now)
    with Session(engine) as session:
        task_id = queue.enqueue(session, "hang", {"key": 7}).id
        session.commit()
    worker = app_process(
        "run-one", "--url", backend.url, "--strategy", strategy_name, "--lease", str(lease.total_seconds())
    )
    try:
        wait_until(lambda: executions(engine).get(7) == 1, 60, "the task to start")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    assert worker.returncode == -signal.SIGKILL
    lease_end = task_row(engine, task_id).locked_until
    assert lease_end is not None and lease_end > clock.now()
    if advisory:
        # The server drops the dead session's locks in its own time; the
        # recovery pass finds them gone.
        wait_until(lambda: queue.recover() == 1, 30, "the dead worker's lock to go")
        assert clock.now() < lease_end, "freed with its lease still running"
    else:
        assert queue.claim() == [], "the lease still holds right after the kill"
        clock.advance(lease_end - timedelta(microseconds=1) - clock.now())
        assert queue.claim() == [], "and up to its last microsecond"
        # Past the lease, and past the next recovery pass, which gives the task back.
        clock.advance(timedelta(microseconds=1) + queue.strategy.recovery_interval(lease))
    [task] = queue.claim()
    assert (task.id, task.attempts) == (task_id, 2)
    assert queue.complete(task, "second time lucky") is True
    with Session(engine) as session:
        row = session.get(tq.Task, task_id)
        assert row is not None
        assert (row.status, row.result) == (tq.TaskStatus.COMPLETED, "second time lucky")
    queue.close()
