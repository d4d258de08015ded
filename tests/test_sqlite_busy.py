"""SQLite beside a writing application: commands wait for its write lock and never say "database is locked".

SQLite has one writer at a time.  An application in the middle of a write
transaction holds the file's write lock until it commits; a worker or a
command started meanwhile waits for it, and works once it is free.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import AppBase, executions
from tests.helpers import StreamLines, run_cli, start_cli, task_rows, wait_until

pytestmark = [pytest.mark.backends("sqlite"), pytest.mark.slow]  # a file of its own; real processes

LOCKED = "database is locked"


@pytest.fixture
def database(tmp_path: Path) -> Iterator[tuple[str, sa.Engine]]:
    """A task table migrated by the command line (which leaves the file's journal mode alone)."""
    url = f"sqlite:///{tmp_path}/app.db"
    migrated = run_cli("migrate", url=url)
    assert migrated.returncode == 0, migrated.stderr
    engine = sa.create_engine(url)
    AppBase.metadata.create_all(engine)
    yield url, engine
    engine.dispose()


def writing_application(engine: sa.Engine, keys: range) -> Session:
    """An application in the middle of a write transaction that enqueues ``keys``: it holds the write lock."""
    session = Session(engine)
    for key in keys:
        session.add(tq.Task(name="record", params={"key": key}))
    session.flush()
    return session


def journal_mode(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return str(conn.exec_driver_sql("PRAGMA journal_mode").scalar())


def test_a_worker_started_beside_a_writing_application_waits_for_it_then_drains(
    database: tuple[str, sa.Engine],
) -> None:
    url, engine = database
    assert journal_mode(engine) == "delete", "the file starts in SQLite's default journal mode"
    application = writing_application(engine, range(3))
    worker = start_cli("worker", "tests.cli_app:queue", "--burst", url=url)
    err = StreamLines(worker.stderr)
    err.wait_for(lambda line: "waiting" in line or worker.poll() is not None, 30, "the worker to wait")
    assert worker.poll() is None, f"the worker gave up:\n{''.join(err.lines)}"
    application.commit()
    application.close()
    assert worker.wait(timeout=60) == 0, err.text()
    out = worker.stdout.read() if worker.stdout else ""
    assert LOCKED not in err.text() + out
    assert {task.status for task in task_rows(engine)} == {tq.TaskStatus.COMPLETED}
    assert executions(engine) == {0: 1, 1: 1, 2: 1}
    assert journal_mode(engine) == "wal", "switched to WAL once the application committed"


def test_a_worker_outwaited_by_a_long_write_says_the_database_is_busy_and_keeps_trying(
    database: tuple[str, sa.Engine],
) -> None:
    url, engine = database
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode = WAL")
    # A busy timeout of 0.2 s (the URL's own) runs out long before the application commits.
    impatient = f"{url}?timeout=0.2"
    application = writing_application(engine, range(2))
    worker = start_cli("worker", "tests.cli_app:queue", "--burst", url=impatient)
    err = StreamLines(worker.stderr)
    line = err.wait_for(lambda line: "busy" in line or worker.poll() is not None, 30, "the busy line")
    assert worker.poll() is None, f"the worker gave up:\n{''.join(err.lines)}"
    assert "another connection kept its write lock" in line
    application.commit()
    application.close()
    assert worker.wait(timeout=90) == 0, err.text()
    assert LOCKED not in err.text()
    assert executions(engine) == {0: 1, 1: 1}


def test_a_command_waits_for_a_writing_application_longer_than_sqlite3s_own_five_seconds(
    database: tuple[str, sa.Engine],
) -> None:
    url, engine = database
    application = writing_application(engine, range(1))
    enqueue = start_cli("enqueue", "record", "--params", '{"key": 7}', url=url)
    started = time.monotonic()
    # Python's sqlite3 gives up 5 s after the command's first write (which
    # comes a few seconds after its start, on a busy machine).
    wait_until(lambda: enqueue.poll() is not None or time.monotonic() - started > 10, 30, "10 s or an exit")
    assert enqueue.poll() is None, f"the command gave up: {enqueue.communicate()[1]}"
    application.commit()
    application.close()
    out, err = enqueue.communicate(timeout=60)
    assert enqueue.returncode == 0, err
    assert "enqueued task" in out
    assert sorted(task.params["key"] for task in task_rows(engine)) == [0, 7]


@pytest.mark.parametrize(
    "args",
    [
        ("enqueue", "record"),
        ("cancel", "1"),
        ("retry", "1"),
        ("purge", "--completed", "--older-than", "0s"),
    ],
)
def test_a_command_outwaited_by_a_long_write_says_the_database_is_busy_in_one_line(
    database: tuple[str, sa.Engine], args: tuple[str, ...]
) -> None:
    url, engine = database
    holder = sqlite3.connect(engine.url.database or "", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # not even a reader gets in
    result = run_cli(*args, url=f"{url}?timeout=0.2")
    holder.execute("ROLLBACK")
    holder.close()
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "the SQLite database is busy" in result.stderr
    assert "try again once it commits" in result.stderr
    assert LOCKED not in result.stderr
