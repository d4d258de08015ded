"""SQLite: one writer at a time, WAL and a busy timeout, BEGIN IMMEDIATE, RETURNING from 3.35."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from sqlalchemy import URL, ColumnElement, Connection, Engine, Insert, Table, event
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import ConnectionPoolEntry

from sa_taskqueue.backends.base import Backend, TableHealthProbe
from sa_taskqueue.backends.table_health.sqlite import measure as measure_table_health
from sa_taskqueue.backends.write_gate import WriteGate

logger = logging.getLogger("sa_taskqueue")

#: How long a connection waits for another process's write lock before giving
#: up (SQLite's "database is locked").  Claims hold it for milliseconds; an
#: application's transaction may hold it longer.  A ``?timeout=`` (seconds) in
#: the URL is kept instead.
BUSY_TIMEOUT_MS = 30_000

#: SQLite's result codes (the low byte of an extended code).
SQLITE_BUSY = 5
SQLITE_LOCKED = 6
#: Failures of the file or the machine, not of the statement: out of memory,
#: I/O error, disk full, cannot open the file, a locking protocol error.
SQLITE_OUTAGES = frozenset({7, 10, 13, 14, 15})

#: The first and the longest pause between tries to switch a busy file to WAL.
WAL_RETRY_FIRST = 0.01
WAL_RETRY_LONGEST = 1.0


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
    # INSERT ... ON CONFLICT DO NOTHING (3.24+), with the partial index's WHERE as its target.
    insert_skips_conflicts = True
    # No datetime type at all: values are text, kept as UTC wall time.
    stores_naive_utc = True
    # Only an INTEGER PRIMARY KEY is a rowid alias, numbered by SQLite itself; BIGINT is not.
    autoincrement_needs_integer_key = True
    # VARCHAR lengths are not enforced, and one appended after a generated
    # column misleads the reflection of its expression (see Backend).
    appended_columns_without_length = True
    # The URL's database is a file, which sqlite3 creates when it is missing.
    file_database = True

    # Python's sqlite3 is built in: no extra, no driver to name.
    async_driver_modules = frozenset({"aiosqlite"})

    @property
    def max_bound_values(self) -> int:  # type: ignore[override]
        # SQLITE_MAX_VARIABLE_NUMBER's default: 999 before SQLite 3.32.
        return 32766 if sqlite3.sqlite_version_info >= (3, 32) else 999

    def table_health_probe(self) -> TableHealthProbe:
        return partial(measure_table_health, label=self.label)

    def write_gate(self, url: URL) -> WriteGate | None:
        # A file's one write lock: a transactional task holds it for its run
        # (see the gate's module).  An in-memory database lives in one
        # process, and a URI may name anything: no gate for either.
        database = url.database
        if not database or database == ":memory:" or url.query.get("uri") or database.startswith("file:"):
            return None
        return WriteGate(database)

    def configure_engine(self, engine: Engine) -> None:
        # Python's sqlite3 gives up after 5 s on a lock another process holds;
        # a writing application may hold it longer.  Every connection waits
        # BUSY_TIMEOUT_MS, unless the URL sets a timeout of its own.
        if "timeout" in engine.url.query:
            return
        if not event.contains(engine, "connect", _set_busy_timeout):
            event.listen(engine, "connect", _set_busy_timeout)

    def prepare_database(self, engine: Engine) -> None:
        # Only WAL lets readers (enqueueing applications, status queries) go
        # on while a claim writes.  It is a property of the file, kept once
        # set, so it is read first: a file already in WAL needs no lock.
        if engine.url.database in (None, "", ":memory:"):
            return
        with engine.connect() as conn:
            if _journal_mode(conn) != "wal":
                _switch_to_wal(conn, str(engine.url.database))

    def insert_skipping_conflicts(
        self, into: Table | type[Any], key: ColumnElement[Any], index_where: ColumnElement[bool]
    ) -> Insert:
        # A partial index is a conflict target only with its WHERE repeated.
        return sqlite.insert(into).on_conflict_do_nothing(index_elements=[key], index_where=index_where)

    @contextmanager
    def bounded_lock_wait(self, conn: Connection, seconds: float) -> Iterator[None]:
        # The busy timeout is the connection's: its own value is put back afterwards.
        before = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {max(int(seconds * 1000), 1)}")
        try:
            yield
        finally:
            conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(before or 0)}")

    def unindexed(self, sql: str) -> str:
        # A unary + is SQLite's own way to keep a term from an index, and
        # the term no longer implies a partial index's WHERE.
        return f"(+{sql})"

    def lock_wait_ran_out(self, error: BaseException | None) -> bool:
        return _is_busy(error)

    def outage(self, error: BaseException) -> bool | None:
        # sqlite3 files every failure, "too many columns" as much as an I/O
        # error, under OperationalError; the result code tells them apart.
        code = getattr(error, "sqlite_errorcode", None)
        if not isinstance(code, int):
            return None
        return code & 0xFF in SQLITE_OUTAGES or code & 0xFF in (SQLITE_BUSY, SQLITE_LOCKED)

    def busy(self, error: BaseException | None) -> str | None:
        if not _is_busy(error):
            return None
        return "the SQLite database is busy: another connection kept its write lock past the busy timeout"


def _is_busy(error: BaseException | None) -> bool:
    """Whether ``error`` is SQLite's "database is locked": a lock wait that ran out (or was not waited)."""
    code = getattr(error, "sqlite_errorcode", None)
    busy_codes = (SQLITE_BUSY, SQLITE_LOCKED)
    return isinstance(error, sqlite3.Error) and isinstance(code, int) and code & 0xFF in busy_codes


def _journal_mode(conn: Connection) -> str:
    return str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()


def _switch_to_wal(conn: Connection, database: str) -> None:
    """Switch the file to WAL, waiting for other connections' transactions to end, within the busy timeout.

    The switch needs the file to itself, and SQLite does not wait for it: it
    answers "database is locked" at once while another connection writes.
    So it is tried again with a growing pause, for as long as the busy
    timeout, with one line saying what it waits for.  If the file is still
    busy then, the queue goes on in the file's own journal mode (readers wait
    for writers, nothing is lost), and the next start tries again.
    """
    wait_ms = int(conn.exec_driver_sql("PRAGMA busy_timeout").scalar() or 0)
    deadline = time.monotonic() + wait_ms / 1000
    pause = WAL_RETRY_FIRST
    waiting_logged = False
    while True:
        try:
            conn.exec_driver_sql("PRAGMA journal_mode = WAL")
            if waiting_logged:
                logger.info("SQLite file %s switched to WAL", database)
            return
        except OperationalError as error:
            if not _is_busy(error.orig):
                raise
        if time.monotonic() >= deadline:
            logger.warning(
                "SQLite file %s stays in %s journal mode for now: other connections kept it busy for "
                "%.0fs; readers will wait for writers until a start finds it free to switch to WAL",
                database,
                _journal_mode(conn),
                wait_ms / 1000,
            )
            return
        if not waiting_logged:
            logger.info(
                "SQLite file %s is busy (another connection is writing): waiting up to %.0fs "
                "to switch it to WAL",
                database,
                wait_ms / 1000,
            )
            waiting_logged = True
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, WAL_RETRY_LONGEST)


def _set_busy_timeout(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


__all__ = ["BUSY_TIMEOUT_MS", "SQLiteBackend"]
