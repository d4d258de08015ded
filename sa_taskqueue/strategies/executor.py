"""`StatementExecutor`: the connections and compiled statements a claim strategy runs its SQL with.

One object with its own state: the statements compiled per dialect and table
(`PreparedStatement`), and the connections kept per engine for hot statements
(`KeptConnection`).  How a statement or a transaction is run on a database is
its backend's word (autocommit single statements, a write lock taken at
BEGIN); the executor only carries it out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.engine import Dialect

from sa_taskqueue.backends import backend_for
from sa_taskqueue.strategies.kept_connection import KeptConnection
from sa_taskqueue.strategies.prepared import PreparedStatement, send_driver_sql


class StatementExecutor:
    """Compiled statements and kept connections, shared by every thread of one strategy."""

    def __init__(self, *, locking_reads: bool = False) -> None:
        #: Its transactions take locking reads: kept connections run at the
        #: backend's `Backend.locking_reads_isolation` (where it has one).
        self.locking_reads = locking_reads
        self._statements: dict[tuple[Any, ...], PreparedStatement] = {}
        self._kept: dict[tuple[Engine, bool], KeptConnection] = {}
        self._mutex = threading.Lock()

    def prepared(
        self, name: tuple[Any, ...], dialect: Dialect, table: Table, build: Callable[[], Any]
    ) -> PreparedStatement:
        """The statement ``name`` for this table, compiled for ``dialect`` on first use and kept.

        Two threads compiling the same statement at once both get a correct
        one; the first kept wins.
        """
        key = (*name, table, dialect)
        found = self._statements.get(key)
        if found is None:
            found = self._statements.setdefault(key, PreparedStatement(build(), dialect, table))
        return found

    def kept_connection(self, engine: Engine, *, autocommit: bool) -> KeptConnection:
        """The connections kept for ``engine``'s hot statements, in either mode."""
        found = self._kept.get((engine, autocommit))
        if found is None:
            isolation = backend_for(engine.dialect).locking_reads_isolation if self.locking_reads else None
            with self._mutex:
                found = self._kept.get((engine, autocommit))
                if found is None:
                    found = self._kept[engine, autocommit] = KeptConnection(
                        engine, autocommit=autocommit, transaction_isolation=isolation
                    )
        return found

    @contextmanager
    def single_statement(self, engine: Engine) -> Iterator[Connection]:
        """A connection for one statement that is atomic on its own (a claim, a completion).

        In autocommit where the backend runs single statements so; otherwise
        a transaction that commits when the statement is done.
        """
        autocommit = backend_for(engine.dialect).autocommit_statements
        with self.kept_connection(engine, autocommit=autocommit).lend() as conn:
            yield conn

    @contextmanager
    def transaction(self, engine: Engine) -> Iterator[Connection]:
        """A connection in a transaction that commits on success and rolls back on error.

        Where single statements run in autocommit, transactions are rare and
        take a pooled connection, except where the backend must take its
        write lock at BEGIN: that BEGIN is sent on the kept autocommit
        connection, with the driver's own transaction handling out of the way.
        Elsewhere it is a kept connection, in a transaction of its own.
        """
        backend = backend_for(engine.dialect)
        if backend.write_begin is not None:
            with self.kept_connection(engine, autocommit=True).lend() as conn:
                send_driver_sql(conn, backend.write_begin)
                try:
                    yield conn
                except BaseException:
                    # SQLite rolls a transaction back itself after some errors
                    # (an interrupt, a full disk), and then refuses ROLLBACK:
                    # the error to raise is the one that ended it.  (The loan
                    # ends in error, so the connection is not lent again.)
                    with contextlib.suppress(Exception):
                        send_driver_sql(conn, "ROLLBACK")
                    raise
                send_driver_sql(conn, "COMMIT")
            return
        if backend.autocommit_statements:
            with engine.begin() as conn:
                yield conn
            return
        with self.kept_connection(engine, autocommit=False).lend() as conn:
            yield conn

    def close(self) -> None:
        """Give every kept connection back to its pool (a later statement checks out a new one)."""
        with self._mutex:
            kept = list(self._kept.values())
        for connection in kept:
            connection.close()


__all__ = ["StatementExecutor"]
