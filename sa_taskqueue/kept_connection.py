"""`KeptConnection`: the one connection a strategy keeps out of the pool for its hot statements.

A claim or a completion is one short statement.  Checking a connection out of
the pool for it, switching the connection to autocommit and back, and
returning it costs more CPU than the statement itself (about 65 µs of the
190 µs a completion took on PostgreSQL on this project's benchmark machine).
So a strategy keeps one connection checked out and lends it to one thread at
a time.  A thread that finds it lent out takes a pooled connection as before:
no thread waits for another, and the strategy holds at most one connection
more than it is using.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import QueuePool, SingletonThreadPool, StaticPool

#: Seconds after which the kept connection goes back to the pool and a fresh
#: one is checked out, so that the pool's recycle and pre-ping settings still
#: apply to it, and an idle worker does not sit on a connection a server may
#: have timed out.
RENEW_AFTER = 30.0


class KeptConnection:
    """A connection kept for one engine and lent to one borrower at a time.

    ``autocommit`` keeps it in the driver's autocommit mode, for statements
    that are atomic on their own (and for SQLite's explicit ``BEGIN
    IMMEDIATE``); otherwise each loan is a transaction that commits when the
    borrower is done.  After an error the connection is closed and the next
    loan checks out a new one, so a broken connection is never lent again.  A
    forked child never touches the connection its parent kept: it checks out
    its own, and leaves the parent's alone (closing it, or letting it be
    collected, would write on the parent's socket).
    """

    def __init__(self, engine: Engine, *, autocommit: bool) -> None:
        self.engine = engine
        self.autocommit = autocommit
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._checked_out_at = 0.0
        self._pid = os.getpid()
        self._inherited: list[Connection] = []
        # StaticPool and SingletonThreadPool hand every borrower in a thread
        # (or in the process) the same DBAPI connection: keeping it in
        # autocommit would change it under the application's own sessions.
        self._keeps = not isinstance(engine.pool, SingletonThreadPool | StaticPool) and _can_spare_one(engine)

    @contextmanager
    def lend(self) -> Iterator[Connection]:
        """The kept connection, or a pooled one if another thread has it; a transaction unless autocommit."""
        if not self._keeps or not self._lock.acquire(blocking=False):
            with self._pooled() as conn, self._scope(conn):
                yield conn
            return
        try:
            conn = self._current()
            try:
                with self._scope(conn):
                    yield conn
            except BaseException:
                self._close()
                raise
        finally:
            self._lock.release()

    def _scope(self, conn: Connection) -> AbstractContextManager[object]:
        # In autocommit every statement commits on its own, and beginning and
        # committing a transaction around it would only cost CPU.
        return contextlib.nullcontext() if self.autocommit else conn.begin()

    def close(self) -> None:
        """Give the kept connection back to the pool (a later loan checks out a new one)."""
        if self._pid != os.getpid():
            # A forked child: a parent's thread may have held the lock at the
            # fork, and the connection is the parent's to close anyway.
            self._close()
            return
        with self._lock:
            self._close()

    def _current(self) -> Connection:
        if self._pid != os.getpid():
            if self._conn is not None:
                self._inherited.append(self._conn)
            self._conn = None
            self._pid = os.getpid()
        if self._conn is not None and time.monotonic() - self._checked_out_at > RENEW_AFTER:
            self._close()
        if self._conn is None:
            conn = self.engine.connect()
            self._conn = conn.execution_options(isolation_level="AUTOCOMMIT") if self.autocommit else conn
            self._checked_out_at = time.monotonic()
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._pid != os.getpid():
            self._inherited.append(conn)
            return
        # Closing returns it to the pool, whose reset may fail on a broken
        # connection; the borrower's own error is the one to report.
        with contextlib.suppress(Exception):
            conn.close()

    @contextmanager
    def _pooled(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT") if self.autocommit else conn


def _can_spare_one(engine: Engine) -> bool:
    # A pool of one connection (pool_size=1, max_overflow=0) would be kept
    # whole, and the application's sessions would wait for it.
    pool = engine.pool
    if not isinstance(pool, QueuePool):
        return True
    overflow = getattr(pool, "_max_overflow", 0)
    return overflow < 0 or pool.size() + overflow >= 2


__all__ = ["KeptConnection"]
