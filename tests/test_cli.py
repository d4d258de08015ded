"""The command line, run as a new user would: real subprocesses, checked on exit code and output."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.backends import Backend
from tests.helpers import run_cli, task_row, task_rows

# Every test here starts real processes.
pytestmark = pytest.mark.slow


def one_line_error(result: object, *fragments: str) -> None:
    """A failure for people: non-zero exit, one line on stderr, no traceback."""
    assert result.returncode != 0  # type: ignore[attr-defined]
    err = result.stderr.strip()  # type: ignore[attr-defined]
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_enqueue_then_status_shows_it(backend: Backend, engine: sa.Engine) -> None:
    result = run_cli(
        "enqueue",
        "send_email",
        "--params",
        '{"to": "a@example.com"}',
        "--queue",
        "mail",
        "--priority",
        "-1",
        "--delay",
        "10m",
        url=backend.url,
    )
    assert result.returncode == 0, result.stderr
    [task] = task_rows(engine)
    assert f"enqueued task {task.id}" in result.stdout
    assert (task.name, task.queue, task.priority, task.params) == (
        "send_email",
        "mail",
        -1,
        {"to": "a@example.com"},
    )
    assert timedelta(minutes=9) < task.run_at - datetime.now(UTC) <= timedelta(minutes=10)

    status = run_cli("status", url=backend.url)
    assert status.returncode == 0, status.stderr
    assert "mail" in status.stdout
    assert "oldest due task: none waiting" in status.stdout, "a delayed task is not due"


def test_status_reports_due_age_and_expired_leases(backend: Backend, engine: sa.Engine) -> None:
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    with Session(engine) as session:
        session.add(tq.Task(name="a", run_at=long_ago))
        session.add(
            tq.Task(
                name="b",
                status=tq.TaskStatus.RUNNING,
                attempts=1,
                locked_by="gone",
                started_at=long_ago,
                locked_until=long_ago + timedelta(minutes=5),
            )
        )
        session.commit()
        stuck = session.scalars(sa.select(tq.Task.id).where(tq.Task.name == "b")).one()
    result = run_cli("status", url=backend.url)
    assert result.returncode == 0, result.stderr
    assert "oldest due task: waiting 2.0h" in result.stdout
    assert f"running with an expired lease (worker gone?): 1: {stuck}" in result.stdout


def test_retry_cancel_and_purge(backend: Backend, engine: sa.Engine) -> None:
    old = datetime.now(UTC) - timedelta(days=10)
    with Session(engine) as session:
        failed = tq.Task(name="f", status=tq.TaskStatus.FAILED, attempts=3, finished_at=old, last_error="x")
        queued = tq.Task(name="q")
        done = [
            tq.Task(name="d", status=tq.TaskStatus.COMPLETED, attempts=1, finished_at=old) for _ in range(25)
        ]
        recent = tq.Task(name="r", status=tq.TaskStatus.COMPLETED, attempts=1, finished_at=datetime.now(UTC))
        session.add_all([failed, queued, *done, recent])
        session.commit()
        failed_id, queued_id, recent_id = failed.id, queued.id, recent.id

    assert run_cli("retry", str(failed_id), url=backend.url).returncode == 0
    row = task_row(engine, failed_id)
    assert (row.status, row.attempts, row.finished_at) == (tq.TaskStatus.QUEUED, 0, None)
    one_line_error(run_cli("retry", str(failed_id), url=backend.url), "not failed or cancelled")

    assert run_cli("cancel", str(queued_id), url=backend.url).returncode == 0
    assert task_row(engine, queued_id).status == tq.TaskStatus.CANCELLED
    one_line_error(run_cli("cancel", str(queued_id), url=backend.url), "already cancelled: nothing cancelled")

    result = run_cli("purge", "--completed", "--older-than", "7d", "--batch-size", "10", url=backend.url)
    assert result.returncode == 0, result.stderr
    assert "deleted 25 task(s)" in result.stdout
    assert {t.name for t in task_rows(engine)} == {"f", "q", "r"}
    assert task_row(engine, recent_id).status == tq.TaskStatus.COMPLETED

    assert run_cli("retry", "--all-failed", url=backend.url).returncode == 0
    usage = run_cli("purge", "--older-than", "1d", url=backend.url)
    assert usage.returncode == 2, "a usage error, shown with the usage"
    assert "Usage:" in usage.stderr and "--completed, --failed and/or --cancelled" in usage.stderr


def test_the_demo_runs_every_task_exactly_once(backend: Backend) -> None:
    result = run_cli("demo", "--tasks", "60", "--workers", "2", "--url", backend.url, url=backend.url)
    assert result.returncode == 0, result.stderr
    assert "every task ran exactly once" in result.stdout
    assert "completed 60" in result.stdout


@pytest.mark.backends("sqlite")  # no database server involved
def test_migrate_creates_the_table_on_an_empty_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/fresh.db"
    result = run_cli("migrate", "--url", url, url=url)
    assert result.returncode == 0, result.stderr
    assert "migrated" in result.stdout
    assert sa.inspect(sa.create_engine(url)).has_table("sa_taskqueue_task")


@pytest.mark.backends("sqlite")  # no database server involved
@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("status", "--url", "nope://nowhere"), ("bad database URL nope://nowhere",)),
        (
            ("status", "--url", "postgresql+psycopg://u:secret@127.0.0.1:1/x"),
            ("cannot use the database", "***"),
        ),
        (("worker", "no_such_module_here:queue"), ("cannot import 'no_such_module_here'",)),
        (("worker", "tests.cli_app:nothing"), ("has no attribute 'nothing'",)),
        (("worker", "tests.app:make_queue"), ("not a sa_taskqueue.TaskQueue",)),
        (("worker", "tests.cli_app"), ("is not MODULE:QUEUE_OBJECT",)),
        (("enqueue", "x", "--params", "[1]"), ("must be a JSON object",)),
        (("enqueue", "x", "--delay", "soon"), ("not a duration",)),
        (("status", "--url", "postgresql+psycopg://u:secret@127.0.0.1:abc/db"), ("***",)),
        (("status", "--url", "u:secret@host/db"), ("bad database URL", "***")),
        (("migrate", "--url", "sqlite://", "--revision", "nosuch"), ("migration failed",)),
        (("worker", "tests.broken_app:queue"), ("importing 'tests.broken_app' failed: KeyError",)),
        (("enqueue", "x", "--queue", "q" * 101), ("queue must be a non-empty string of at most 100",)),
    ],
)
def test_errors_are_one_line_for_people(
    backend: Backend, args: tuple[str, ...], fragments: tuple[str, ...]
) -> None:
    result = run_cli(*args, url=backend.url)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert "secret" not in result.stderr, "passwords are never printed"


@pytest.mark.backends("sqlite")  # no database server involved
def test_a_missing_table_says_to_migrate(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/empty.db"
    sqlite3.connect(tmp_path / "empty.db").close()  # a database without the table (no file: another error)
    for args in (
        ("status",),
        ("enqueue", "x"),
        ("cancel", "1"),
        ("purge", "--completed", "--older-than", "1d"),
    ):
        one_line_error(run_cli(*args, url=url), "does not exist", "sa-taskqueue migrate")


@pytest.mark.backends("sqlite")  # no database server involved
def test_debug_shows_the_traceback() -> None:
    result = run_cli("--debug", "status", "--url", "nope://nowhere", url="nope://nowhere")
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_worker_burst_runs_due_tasks(backend: Backend, engine: sa.Engine) -> None:
    enqueued = run_cli("enqueue", "record", "--params", json.dumps({"key": 5}), url=backend.url)
    assert enqueued.returncode == 0, enqueued.stderr
    result = run_cli("worker", "tests.cli_app:queue", "--burst", "--concurrency", "2", url=backend.url)
    assert result.returncode == 0, result.stderr
    [task] = task_rows(engine)
    assert (task.status, task.result) == (tq.TaskStatus.COMPLETED, 5)
