"""``sa-taskqueue workers``, and ``status`` on unserved tasks: real worker processes, the commands as run."""

from __future__ import annotations

import json
import signal
import subprocess
from datetime import timedelta

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.core.worker_table import worker_table_of
from sa_taskqueue.features.admin import Admin
from sa_taskqueue.features.live_workers import WorkerRecord, register_worker
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import enqueue_one, run_cli, start_cli, wait_until

TABLE = tq.Task.__table__


def worker_process(backend: Backend, *args: str) -> subprocess.Popen[str]:
    """A worker of the test application with a 3s lease: it heartbeats every 0.75s."""
    return start_cli(
        "worker",
        "tests.cli_app:queue",
        "--poll-interval",
        "0.2",
        "--shutdown-timeout",
        "0",
        *args,
        url=backend.url,
        SA_TASKQUEUE_TEST_LEASE="3",
    )


def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, then what it wrote to stderr (its log) once it has exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=60)
    return err or ""


def enqueue_named(engine: sa.Engine, name: str, queue: str = "default") -> int:
    """A task of any name, as the command line enqueues it (no registration needed)."""
    return Admin(engine, TABLE).enqueue(name, {}, queue=queue)


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_workers_lists_each_live_worker_whole_and_as_json(backend: Backend, engine: sa.Engine) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    first = worker_process(backend, "--queues", "mail,reports", "--concurrency", "2")
    second = worker_process(backend, "--queues", "other")
    try:
        wait_until(lambda: len(queue.workers()) == 2, 60, "both workers to register")
        task_id = enqueue_one(queue, engine, "record", {"key": 1, "sleep": 60}, queue="mail")
        wait_until(lambda: any(w.running for w in queue.workers()), 60, "the task to run")
        by_pid = {worker.pid: worker for worker in queue.workers()}
        mail = by_pid[first.pid]

        listing = run_cli("workers", url=backend.url)
        assert listing.returncode == 0, listing.stderr
        text = listing.stdout
        assert text.startswith(f"2 live worker(s) ({worker_table_of(TABLE).name})\n")
        blocks = {block.split("\n", 1)[0]: block for block in text.split("\n\n")[1:]}
        block = blocks[f"worker {mail.id}"]
        assert f"pid {first.pid}, sa_taskqueue {tq.__version__}, concurrency 2" in block
        assert "  queues: mail, reports\n" in block
        assert f"  task names: {', '.join(queue.task_names)}\n" in block, "every name, whole"
        assert "last heartbeat " in block and "started " in block
        assert "  running 1:\n" in block and f"    task {task_id} record (mail), for " in block
        other = blocks[f"worker {by_pid[second.pid].id}"]
        assert "  queues: other\n" in other and "  running: nothing" in other

        as_json = run_cli("workers", "tests.cli_app:queue", "--json", url=backend.url)
        assert as_json.returncode == 0, as_json.stderr
        rows = {row["pid"]: row for row in json.loads(as_json.stdout)}
        assert set(rows) == {first.pid, second.pid}
        row = rows[first.pid]
        assert (row["id"], row["host"], row["version"]) == (mail.id, mail.host, tq.__version__)
        assert row["queues"] == ["mail", "reports"] and row["task_names"] == queue.task_names
        assert row["concurrency"] == 2 and row["started_at"] == mail.started_at.isoformat()
        assert [(task["id"], task["name"], task["queue"]) for task in row["running"]] == [
            (task_id, "record", "mail")
        ]
        assert rows[second.pid]["queues"] == ["other"] and rows[second.pid]["running"] == []
    finally:
        stop(first)
        stop(second)
        queue.close()
    after = run_cli("workers", url=backend.url)
    assert after.returncode == 0 and after.stdout.startswith("no live workers"), after.stderr


def test_workers_with_no_live_worker_says_so_and_gives_an_empty_array(
    backend: Backend, engine: sa.Engine
) -> None:
    listing = run_cli("workers", url=backend.url)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout == f"no live workers ({worker_table_of(TABLE).name})\n"
    as_json = run_cli("workers", "--json", url=backend.url)
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == [], as_json.stderr
    both = run_cli("workers", "tests.cli_app:queue", "--app", "tests.cli_app:queue", url=backend.url)
    assert both.returncode == 2 and "give APP or --app, not both" in both.stderr


def test_workers_shows_a_worker_of_every_queue_as_such(backend: Backend, engine: sa.Engine) -> None:
    now = utcnow()
    record = WorkerRecord.of("host:1:aa", None, ["app.send"], 4)
    register_worker(engine, TABLE, record, now, now + timedelta(minutes=1))
    listing = run_cli("workers", url=backend.url)
    assert listing.returncode == 0, listing.stderr
    assert "worker host:1:aa\n" in listing.stdout
    assert "  queues: * (every queue)\n  task names: app.send\n" in listing.stdout
    assert "  running: nothing\n" in listing.stdout


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_status_and_the_worker_name_the_due_tasks_no_live_worker_serves(
    backend: Backend, engine: sa.Engine
) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    enqueue_named(engine, "app.nobody")
    enqueue_named(engine, "record", "elsewhere")
    alone = run_cli("status", url=backend.url)
    assert alone.returncode == 0, alone.stderr
    (line,) = [line for line in alone.stdout.splitlines() if line.startswith("no live worker serves: ")]
    assert "app.nobody on queue default (1 due, oldest " in line, "no worker at all"
    process = worker_process(backend, "--queues", "default")
    try:
        wait_until(lambda: queue.workers(), 60, "the worker to register")
        status = run_cli("status", "tests.cli_app:queue", url=backend.url)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        (unserved,) = [line for line in lines if line.startswith("no live worker serves: ")]
        assert "record on queue elsewhere (1 due, oldest " in unserved, "its name is known, not its queue"
        assert "app.nobody on queue default (1 due, oldest " in unserved
        assert any(line.startswith("not registered here: app.nobody") for line in lines), "kept for APP"
    finally:
        log = stop(process)
        queue.close()
    (warning,) = [line for line in log.splitlines() if "due tasks no live worker serves" in line]
    assert "app.nobody on queue default (1 due" in warning and "record on queue elsewhere (1 due" in warning


def test_status_with_every_due_task_served_says_none(backend: Backend, engine: sa.Engine) -> None:
    status = run_cli("status", url=backend.url)
    assert status.returncode == 0, status.stderr
    assert (
        "no live worker serves: none (a live worker serves every due task's queue and name)" in status.stdout
    )
