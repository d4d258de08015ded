"""Claim with an atomic conditional UPDATE: SQLite, and MySQL/MariaDB too old for SKIP LOCKED.

No row is locked while a claim looks for work.  A task is taken by an UPDATE
whose WHERE clause repeats the test that made it claimable (still queued,
still due, same attempt), so of several claimers racing for one row exactly
one UPDATE matches it; the others match nothing and move on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Table, bindparam, event, update
from sqlalchemy.engine import Dialect
from sqlalchemy.pool import ConnectionPoolEntry

from sa_taskqueue.strategies.base import (
    ClaimRequest,
    ClaimStrategy,
    apply_claim,
    claimed_row,
    claimed_values,
    due_clause,
    due_select,
    limit_param,
    read_back,
)

CANDIDATE_ID = "candidate_id"
CANDIDATE_ATTEMPTS = "candidate_attempts"

#: How long a SQLite connection waits for another process's write lock before
#: giving up with "database is locked".  Claims hold it for milliseconds.
SQLITE_BUSY_TIMEOUT_MS = 30_000


class ConditionalUpdateStrategy(ClaimStrategy):
    """Compare-and-set on (status, attempts): the database's row update is the lock."""

    name = "conditional_update"

    def prepare(self, engine: Engine) -> None:
        if engine.dialect.name != "sqlite":
            return
        # Python's sqlite3 gives up at once on a lock another process holds
        # unless a busy timeout is set, and only WAL lets readers (enqueueing
        # applications, status queries) go on while a claim writes.
        if not event.contains(engine, "connect", _configure_sqlite_connection):
            event.listen(engine, "connect", _configure_sqlite_connection)
        if engine.url.database not in (None, "", ":memory:"):
            with engine.connect() as conn:
                conn.exec_driver_sql(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
                conn.exec_driver_sql("PRAGMA journal_mode = WAL")

    def finding_statement(self, dialect: Dialect, table: Table, request: ClaimRequest) -> Any:
        if dialect.name == "sqlite":
            return self.sqlite_claim(table, request)
        return super().finding_statement(dialect, table, request)

    def claim(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        if engine.dialect.name == "sqlite":
            return self._claim_returning(engine, table, request)
        return self._claim_row_by_row(engine, table, request)

    def sqlite_claim(self, table: Table, request: ClaimRequest) -> Any:
        """One UPDATE of the first due rows, RETURNING them (SQLite 3.35+)."""
        due_ids = due_select(table, request, table.c.id).limit(limit_param()).scalar_subquery()
        return (
            update(table)
            .where(table.c.id.in_(due_ids))
            .values(**claimed_values(table, request))
            .returning(*read_back(table))
        )

    def _claim_returning(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        # One statement in autocommit mode: SQLite takes the write lock when
        # a writing statement starts, before its subquery reads anything
        # (waiting out the busy timeout if another process has it), so no
        # other process can write between this UPDATE's subquery and its
        # update, and the claim is exact without a BEGIN IMMEDIATE around it.
        claim = self.claim_statement(
            "claim", engine.dialect, table, request, lambda: self.sqlite_claim(table, request)
        )
        with self.single_statement(engine) as conn:
            return [claimed_row(row, request) for row in claim.rows(conn, request.params())]

    def _claim_row_by_row(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        # Without RETURNING (MySQL, MariaDB) and without a database-wide write
        # lock, each candidate is taken by its own compare-and-set UPDATE, whose
        # row count says whether this claimer won it.
        candidates = self.claim_statement(
            "candidates",
            engine.dialect,
            table,
            request,
            lambda: due_select(table, request, *read_back(table)).limit(limit_param()),
        )
        take = self.claim_statement(
            "take",
            engine.dialect,
            table,
            request,
            lambda: (
                update(table)
                .where(
                    table.c.id == bindparam(CANDIDATE_ID),
                    table.c.attempts == bindparam(CANDIDATE_ATTEMPTS),
                    due_clause(table, request),
                )
                .values(**claimed_values(table, request))
            ),
        )
        params = request.params()
        claimed: list[dict[str, Any]] = []
        with self.transaction(engine) as conn:
            for row in candidates.rows(conn, params):
                won = take.execute(
                    conn, {**params, CANDIDATE_ID: row["id"], CANDIDATE_ATTEMPTS: row["attempts"]}
                )
                if won.rowcount == 1:
                    claimed.append(apply_claim(row, request))
        return claimed

    @contextmanager
    def transaction(self, engine: Engine) -> Iterator[Connection]:
        if engine.dialect.name != "sqlite":
            with super().transaction(engine) as conn:
                yield conn
            return
        # Python's sqlite3 (legacy transaction mode) sends no BEGIN before a
        # SELECT, and a deferred transaction that reads first and writes later
        # fails with "database is locked" instead of waiting when another
        # process wrote meanwhile.  So the driver's own transaction handling is
        # switched off and the write lock taken up front with BEGIN IMMEDIATE.
        with self.kept_connection(engine, autocommit=True).lend() as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")


def _configure_sqlite_connection(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()
