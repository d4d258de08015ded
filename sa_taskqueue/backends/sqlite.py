"""SQLite: one writer at a time, WAL and a busy timeout, BEGIN IMMEDIATE, RETURNING from 3.35."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.pool import ConnectionPoolEntry

from sa_taskqueue.backends.base import Backend

#: How long a connection waits for another process's write lock before giving
#: up with "database is locked".  Claims hold it for milliseconds.
BUSY_TIMEOUT_MS = 30_000


class SQLiteBackend(Backend):
    label = "SQLite"

    # A writing statement takes the database's write lock when it starts,
    # before its subqueries read (waiting out the busy timeout), so no other
    # process writes between its read and its write.
    serialised_writes = True
    partial_indexes = True
    # An autocommit UPDATE is atomic on its own and needs no BEGIN IMMEDIATE.
    autocommit_statements = True
    direct_execution = True
    # Python's sqlite3 (legacy transaction mode) sends no BEGIN before a
    # SELECT, and a deferred transaction that reads first and writes later
    # fails with "database is locked" instead of waiting when another process
    # wrote meanwhile: a transaction that will write takes the lock up front.
    write_begin = "BEGIN IMMEDIATE"
    # Asking SQLAlchemy for ids in parameter order makes it send one row per
    # statement; a multi-row INSERT inside the write lock numbers them in turn.
    multi_row_insert_ids_in_order = True
    explain_prefix = "EXPLAIN QUERY PLAN "
    # ALTER TABLE cannot change a column's type or add most constraints.
    batch_migrations = True
    # No datetime type at all: values are text, kept as UTC wall time.
    stores_naive_utc = True

    def configure_engine(self, engine: Engine) -> None:
        # Python's sqlite3 gives up at once on a lock another process holds
        # unless a busy timeout is set, on every connection.
        if not event.contains(engine, "connect", _set_busy_timeout):
            event.listen(engine, "connect", _set_busy_timeout)

    def prepare_database(self, engine: Engine) -> None:
        # Only WAL lets readers (enqueueing applications, status queries) go
        # on while a claim writes.  It is a property of the file, kept once set.
        if engine.url.database in (None, "", ":memory:"):
            return
        with engine.connect() as conn:
            conn.exec_driver_sql(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.exec_driver_sql("PRAGMA journal_mode = WAL")


def _set_busy_timeout(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


__all__ = ["BUSY_TIMEOUT_MS", "SQLiteBackend"]
