"""Running the command line and the test application as real subprocesses."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.notify import channel_name
from sa_taskqueue.core.types import utcnow
from tests.backends import Backend

ROOT = Path(__file__).resolve().parent.parent


def cli_env(url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "SA_TASKQUEUE_DATABASE_URL": url, **extra}


def run_cli(*args: str, url: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    """``python -m sa_taskqueue ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "sa_taskqueue", *args],
        cwd=ROOT,
        env=cli_env(url, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(*args: str, url: str, **extra: str) -> subprocess.Popen[str]:
    """``python -m sa_taskqueue ARGS`` in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "sa_taskqueue", *args],
        cwd=ROOT,
        env=cli_env(url, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(condition: Callable[[], object], seconds: float, what: str, every: float = 0.05) -> None:
    """Poll ``condition`` every ``every`` seconds until it is truthy, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


def read_through_outages(engine: sa.Engine, read: Callable[[sa.Connection], Any], seconds: float = 60) -> Any:
    """``read(conn)`` on a connection of ``engine``, again while the database answers with an outage.

    For a test's look at the table while it SIGSTOPs processes: a stopped
    SQLite process can hold a lock of the WAL's index, and a reader then gets
    "locking protocol", an outage the workers themselves wait out.
    """
    backend = backend_for(engine.dialect)
    deadline = time.monotonic() + seconds
    while True:
        try:
            with engine.connect() as conn:
                return read(conn)
        except sa.exc.OperationalError as error:
            if not backend.outage(error.orig) or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


class MovableClock:
    """A clock that stands still until the test moves it; pass ``clock.now`` as a queue's ``clock``.

    Queues sharing one see the same time, so a test can let a lease run out,
    or a retry come due, without waiting for it.
    """

    def __init__(self, start: datetime | None = None) -> None:
        start = utcnow() if start is None else start
        if start.utcoffset() is None:
            raise ValueError(f"start must be timezone-aware, got {start!r}")
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta) -> datetime:
        """Move the time forward by ``delta``; return the new time."""
        if delta < timedelta(0):
            raise ValueError(f"a clock does not go back: {delta!r}")
        with self._lock:
            self._now += delta
            return self._now


#: Lines of a process's output shown when a wait for one of them times out.
TAIL_LINES = 40


class StreamLines:
    """The lines a subprocess writes to one pipe, collected by a thread as they come.

    For waiting on what a running process logs without a sleep: ``wait_for``
    polls the lines read so far.
    """

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None, "the pipe was not opened"
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in iter(stream.readline, ""):
                with self._lock:
                    self._lines.append(line)

    @property
    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def wait_for(self, wanted: Callable[[str], object], seconds: float, what: str) -> str:
        """The first line for which ``wanted`` is truthy, waiting for it at most ``seconds``.

        On a timeout the error carries the last lines written, which tell
        what the process did instead.
        """
        found: list[str] = []

        def seen() -> bool:
            found.extend(line for line in self.lines if wanted(line))
            return bool(found)

        try:
            wait_until(seen, seconds, what)
        except AssertionError as timed_out:
            tail = "".join(self.lines[-TAIL_LINES:]) or "(nothing)\n"
            raise AssertionError(f"{timed_out}; the last lines written:\n{tail}") from None
        return found[0]

    def text(self, timeout: float = 30) -> str:
        """Everything written, once the pipe is closed (the process has exited)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the process still holds its pipe open"
        return "".join(self.lines)


@contextlib.contextmanager
def statements_sent(queue: tq.TaskQueue, kept: Callable[[str], bool]) -> Iterator[list[str]]:
    """What ``queue`` sends meanwhile for which ``kept(sql)`` holds, as SQLAlchemy's events see it.

    (On the queue's own engine: under an asyncio driver, the AsyncEngine's sync core.)
    """
    seen: list[str] = []

    def sent(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        if kept(statement):
            seen.append(statement)

    queue_engine = getattr(queue.engine, "sync_engine", queue.engine)
    sa.event.listen(queue_engine, "before_cursor_execute", sent)
    try:
        yield seen
    finally:
        sa.event.remove(queue_engine, "before_cursor_execute", sent)


def task_rows(engine: sa.Engine) -> list[tq.Task]:
    with Session(engine) as session:
        rows = list(session.scalars(sa.select(tq.Task).order_by(tq.Task.id)))
        session.expunge_all()
        return rows


def task_row(engine: sa.Engine, task_id: int) -> tq.Task:
    with Session(engine) as session:
        row = session.get(tq.Task, task_id)
        assert row is not None
        session.expunge(row)
        return row


def enqueue_records(
    task_queue: tq.TaskQueue, engine: sa.Engine, count: int, /, **options: object
) -> list[int]:
    """``count`` "record" tasks with keys 0, 1, ..., committed together; their ids in order."""
    with Session(engine) as session:
        tasks = [task_queue.enqueue(session, "record", {"key": n}, **options) for n in range(count)]  # type: ignore[arg-type]
        session.commit()
        return [task.id for task in tasks]


def enqueue_one(
    task_queue: tq.TaskQueue, engine: sa.Engine, name: str, params: dict[str, object], /, **options: object
) -> int:
    """One task, committed; its id."""
    with Session(engine) as session:
        task_id = task_queue.enqueue(session, name, params, **options).id  # type: ignore[arg-type]
        session.commit()
    return task_id


def kill_other_sessions(conn: sa.Connection) -> int:
    """Have the server end every other session on this database; how many it ended."""
    if conn.dialect.name == "postgresql":
        killed = conn.execute(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ).scalar_one()
        conn.commit()
        return int(killed)
    ids = conn.execute(
        sa.text(
            "SELECT id FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        )
    ).scalars()
    count = 0
    for session_id in list(ids):
        with contextlib.suppress(sa.exc.DBAPIError):  # it ended by itself meanwhile
            conn.execute(sa.text(f"KILL CONNECTION {int(session_id)}"))
            count += 1
    return count


@contextlib.contextmanager
def listening(backend: Backend, table: sa.Table) -> Iterator[Any]:
    """A psycopg connection of its own, in autocommit, LISTENing on ``table``'s channel."""
    import psycopg

    url = sa.make_url(backend.url)
    with psycopg.connect(
        host=url.host,
        port=url.port or 5432,
        user=url.username,
        password=url.password,
        dbname=url.database,
        autocommit=True,
    ) as listener:
        listener.execute(f'LISTEN "{channel_name(table)}"')
        yield listener


def received(listener: Any, seconds: float = 0.5) -> list[str]:
    """The payloads that arrive within ``seconds`` (a bounded wait for what a commit delivers)."""
    return [notification.payload for notification in listener.notifies(timeout=seconds)]
