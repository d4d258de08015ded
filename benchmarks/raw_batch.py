"""The raw drivers' claim loop again, completing each claimed batch in one statement.

The clients of benchmarks.clients complete each task with its own
statement, as a worker reports each outcome on its own.  At B > 1 the
pattern's limit is lower still: one UPDATE for the whole batch
(``id = ANY(...)`` on PostgreSQL, ``id IN (...)`` elsewhere), which is what
these clients measure.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

import sqlalchemy as sa

from benchmarks.clients import TABLE, Client, MariaDBClient, PostgresClient, SQLiteClient

#: The drain's name for this loop (beside "sa_taskqueue" and "raw").
RAW_BATCH = "raw_batch"
#: sa_taskqueue's loop completing each claimed batch with one `TaskQueue.complete_many` call.
QUEUE_BATCH = "sa_taskqueue_batch"
#: The loops whose clients complete a claimed batch in one call.
BATCHED = (RAW_BATCH, QUEUE_BATCH)


class BatchClient(Client, Protocol):
    def complete_many(self, task_ids: list[int]) -> None: ...


def _all_done(task_ids: list[int], rowcount: int) -> None:
    if rowcount != len(task_ids):
        raise RuntimeError(f"completed {rowcount} of {len(task_ids)} claimed tasks")


class PostgresBatchClient(PostgresClient):
    COMPLETE_MANY = f"""
        UPDATE {TABLE} SET status = 'completed', finished_at = now(), locked_until = NULL
        WHERE id = ANY(%(ids)s) AND status = 'running' AND locked_by = %(worker)s
    """

    def complete_many(self, task_ids: list[int]) -> None:
        cursor = self.conn.execute(self.COMPLETE_MANY, {"ids": task_ids, "worker": self.args["worker"]})
        _all_done(task_ids, cursor.rowcount)


class MariaDBBatchClient(MariaDBClient):
    def complete_many(self, task_ids: list[int]) -> None:
        with self.conn.cursor() as cursor:
            cursor.execute(
                f"UPDATE {TABLE} SET status = 'completed', finished_at = %s, locked_until = NULL "
                f"WHERE id IN ({', '.join(['%s'] * len(task_ids))}) "
                "AND status = 'running' AND locked_by = %s",
                (datetime.now(UTC).replace(tzinfo=None), *task_ids, self.worker),
            )
            _all_done(task_ids, cursor.rowcount)
        self.conn.commit()


class SQLiteBatchClient(SQLiteClient):
    def complete_many(self, task_ids: list[int]) -> None:
        cursor = self.conn.execute(
            f"UPDATE {TABLE} SET status = 'completed', finished_at = ?, locked_until = NULL "
            f"WHERE id IN ({', '.join(['?'] * len(task_ids))}) AND status = 'running' AND locked_by = ?",
            (self._now(), *task_ids, self.worker),
        )
        _all_done(task_ids, cursor.rowcount)


BATCH_CLIENTS: dict[str, Callable[[str, int], BatchClient]] = {
    "postgresql": PostgresBatchClient,
    "mysql": MariaDBBatchClient,
    "mariadb": MariaDBBatchClient,
    "sqlite": SQLiteBatchClient,
}


def make_batch_client(implementation: str, url: str, batch: int) -> BatchClient:
    if implementation == QUEUE_BATCH:
        from benchmarks.clients import QueueClient

        return QueueClient(url, batch)
    return BATCH_CLIENTS[sa.make_url(url).get_backend_name()](url, batch)
