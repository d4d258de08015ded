"""The claim-run-complete loop, twice: through sa_taskqueue, and written directly on the driver.

The raw clients are the limit of the pattern on the machine: the best SQL we
know for each database, one connection, no ORM, no SQLAlchemy.  Both run the
same no-op task and complete each task with its own statement.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa

from sa_taskqueue.core.concurrency import LIMITED_RECHECK_SECONDS

TABLE = "sa_taskqueue_task"
LEASE = timedelta(minutes=5)


def noop(**_params: Any) -> None:
    """The benchmark's task: nothing, so that the queue is all that is measured."""


async def async_noop(**_params: Any) -> None:
    """The async benchmark's task: nothing, run on the worker's event loop."""


class Client(Protocol):
    def claim(self) -> list[tuple[int, dict[str, Any]]]: ...
    def complete(self, task_id: int) -> None: ...
    def close(self) -> None: ...


# sa_taskqueue ---------------------------------------------------------------------


class QueueClient:
    def __init__(self, url: str, batch: int, *, controlled: bool = False, rated: bool = False) -> None:
        import sa_taskqueue as tq

        self.engine = sa.create_engine(url)
        self.queue = tq.TaskQueue(self.engine, lease=LEASE)
        if controlled:
            register_controlled(self.queue)
        elif rated:
            register_rated(self.queue)
        else:
            self.queue.task(name="noop")(noop)
        self.batch = batch
        self.held: dict[int, Any] = {}

    def claim(self) -> list[tuple[int, dict[str, Any]]]:
        # As a worker claims: limited tasks looked for again 0.1 s after none was found.
        claimed = self.queue.claim(limit=self.batch, limited_recheck=LIMITED_RECHECK_SECONDS)
        for task in claimed:
            self.held[task.id] = task
        return [(task.id, task.params) for task in claimed]

    def complete(self, task_id: int) -> None:
        if not self.queue.complete(self.held.pop(task_id)):
            raise RuntimeError(f"lost task {task_id}")

    def complete_many(self, task_ids: list[int]) -> None:
        claimed = [self.held.pop(task_id) for task_id in task_ids]
        written = self.queue.complete_many(claimed)
        if len(written) != len(claimed):
            raise RuntimeError(f"completed {len(written)} of {len(claimed)} claimed tasks")

    def close(self) -> None:
        self.queue.close()
        self.engine.dispose()


def register_controlled(queue: Any) -> None:
    """The controlled drains' tasks (benchmarks.controls): ``noop``, and ``limited`` with a limit per key."""
    from benchmarks.controls import LIMIT

    queue.task(name="noop")(noop)
    queue.task(name="limited", concurrency_limit=LIMIT, concurrency_key="key")(limited_noop)


def register_rated(queue: Any) -> None:
    """The rate-limit drains' tasks (benchmarks.rates): ``noop``, and ``rated`` with a limit per key."""
    from benchmarks.rates import RATE_LIMIT

    queue.task(name="noop")(noop)
    queue.task(name="rated", rate_limit=RATE_LIMIT, rate_key="key")(limited_noop)


def limited_noop(key: str) -> None:
    """The limited task: nothing, with the param its concurrency key is made of."""
    del key


# Raw drivers ------------------------------------------------------------------------


def _worker_id() -> str:
    return f"raw:{os.getpid()}"


class PostgresClient:
    """psycopg, autocommit: the claim is one statement (locking CTE, UPDATE ... FROM, RETURNING)."""

    CLAIM = f"""
        WITH c AS (
            SELECT id FROM {TABLE}
            WHERE status = 'queued' AND run_at <= now()
            ORDER BY priority, run_at, id
            LIMIT %(batch)s
            FOR UPDATE SKIP LOCKED
        )
        UPDATE {TABLE} t SET status = 'running', attempts = t.attempts + 1, started_at = now(),
            locked_by = %(worker)s, locked_until = now() + interval '5 minutes'
        FROM c WHERE t.id = c.id
        RETURNING t.id, t.params
    """
    COMPLETE = f"""
        UPDATE {TABLE} SET status = 'completed', finished_at = now(), locked_until = NULL
        WHERE id = %(id)s AND status = 'running' AND locked_by = %(worker)s
    """

    def __init__(self, url: str, batch: int) -> None:
        import psycopg

        u = sa.make_url(url)
        self.conn = psycopg.connect(
            host=u.host,
            port=u.port or 5432,
            user=u.username,
            password=u.password,
            dbname=u.database,
            autocommit=True,
        )
        self.args = {"batch": batch, "worker": _worker_id()}

    def claim(self) -> list[tuple[int, dict[str, Any]]]:
        return [(row[0], row[1]) for row in self.conn.execute(self.CLAIM, self.args).fetchall()]

    def complete(self, task_id: int) -> None:
        self.conn.execute(self.COMPLETE, {"id": task_id, "worker": self.args["worker"]})

    def close(self) -> None:
        self.conn.close()


class MariaDBClient:
    """PyMySQL under READ COMMITTED: lock the rows, update them by id, commit."""

    def __init__(self, url: str, batch: int) -> None:
        import pymysql

        u = sa.make_url(url)
        self.conn = pymysql.connect(
            host=u.host,
            port=u.port or 3306,
            user=u.username,
            password=u.password or "",
            database=u.database,
            autocommit=False,
        )
        with self.conn.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        self.batch = batch
        self.worker = _worker_id()

    def claim(self) -> list[tuple[int, dict[str, Any]]]:
        now = datetime.now(UTC).replace(tzinfo=None)
        with self.conn.cursor() as cursor:
            cursor.execute(
                f"SELECT id, params FROM {TABLE} WHERE status = 'queued' AND run_at <= %s "
                "ORDER BY priority, run_at, id LIMIT %s FOR UPDATE SKIP LOCKED",
                (now, self.batch),
            )
            rows = cursor.fetchall()
            if rows:
                ids = [row[0] for row in rows]
                cursor.execute(
                    f"UPDATE {TABLE} SET status = 'running', attempts = attempts + 1, started_at = %s, "
                    f"locked_by = %s, locked_until = %s WHERE id IN ({', '.join(['%s'] * len(ids))})",
                    (now, self.worker, now + LEASE, *ids),
                )
        self.conn.commit()
        return [(row[0], json.loads(row[1])) for row in rows]

    def complete(self, task_id: int) -> None:
        with self.conn.cursor() as cursor:
            cursor.execute(
                f"UPDATE {TABLE} SET status = 'completed', finished_at = %s, locked_until = NULL "
                "WHERE id = %s AND status = 'running' AND locked_by = %s",
                (datetime.now(UTC).replace(tzinfo=None), task_id, self.worker),
            )
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()


class SQLiteClient:
    """sqlite3 in autocommit mode: the claim is one UPDATE ... RETURNING (its own write transaction)."""

    def __init__(self, url: str, batch: int) -> None:
        path = sa.make_url(url).database
        assert path
        self.conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.batch = batch
        self.worker = _worker_id()

    @staticmethod
    def _now() -> str:
        return datetime.now(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")

    def claim(self) -> list[tuple[int, dict[str, Any]]]:
        now = self._now()
        rows = self.conn.execute(
            f"UPDATE {TABLE} SET status = 'running', attempts = attempts + 1, started_at = ?, "
            "locked_by = ?, locked_until = ? WHERE id IN ("
            f"SELECT id FROM {TABLE} WHERE status = 'queued' AND run_at <= ? "
            "ORDER BY priority, run_at, id LIMIT ?) RETURNING id, params",
            (now, self.worker, now, now, self.batch),
        ).fetchall()
        return [(row[0], json.loads(row[1])) for row in rows]

    def complete(self, task_id: int) -> None:
        self.conn.execute(
            f"UPDATE {TABLE} SET status = 'completed', finished_at = ?, locked_until = NULL "
            "WHERE id = ? AND status = 'running' AND locked_by = ?",
            (self._now(), task_id, self.worker),
        )

    def close(self) -> None:
        self.conn.close()


RAW_CLIENTS: dict[str, Callable[[str, int], Client]] = {
    "postgresql": PostgresClient,
    "mysql": MariaDBClient,
    "mariadb": MariaDBClient,
    "sqlite": SQLiteClient,
}


def make_client(implementation: str, url: str, batch: int) -> Client:
    if implementation == "sa_taskqueue":
        return QueueClient(url, batch)
    if implementation == "sa_taskqueue_controls":
        return QueueClient(url, batch, controlled=True)
    if implementation == "sa_taskqueue_rated":
        return QueueClient(url, batch, rated=True)
    return RAW_CLIENTS[sa.make_url(url).get_backend_name()](url, batch)
