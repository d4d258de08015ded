"""`KeptConnection`: the connections a strategy keeps out of the pool for its hot statements.

A claim or a completion is one short statement.  Checking a connection out of
the pool for it, switching the connection to autocommit and back, and
returning it costs more CPU than the statement itself (about 65 µs of the
190 µs a completion took on PostgreSQL on this project's benchmark machine).
So a strategy keeps connections checked out and lends each to one thread at
a time.  It keeps at most `KEEP` of them: a worker's claim and the write of
its slots' successes overlap (on PostgreSQL it claims while it writes), and
each then has one of its own.  A thread that finds every kept connection
lent out takes a pooled one as before: no thread waits for another.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import QueuePool, SingletonThreadPool, StaticPool

#: Seconds after which a kept connection goes back to the pool and a fresh
#: one is checked out, so that the pool's recycle and pre-ping settings still
#: apply to it, and an idle worker does not sit on a connection a server may
#: have timed out.
RENEW_AFTER = 30.0

#: The most connections kept per engine and mode: a claim and a write at once.
KEEP = 2


@dataclass
class _Kept:
    conn: Connection
    checked_out_at: float
    generation: int


class KeptConnection:
    """Connections kept for one engine, each lent to one borrower at a time.

    ``autocommit`` keeps them in the driver's autocommit mode, for statements
    that are atomic on their own (and for SQLite's explicit ``BEGIN
    IMMEDIATE``); otherwise each loan is a transaction that commits when the
    borrower is done.  After an error the connection lent is closed and a
    later loan checks out a new one, so a broken connection is never lent
    again.  The one used last is lent first, so a single thread always gets
    the same connection.  A forked child never touches the connections its
    parent kept: it checks out its own, and leaves the parent's alone
    (closing them, or letting them be collected, would write on the parent's
    socket).
    """

    def __init__(self, engine: Engine, *, autocommit: bool) -> None:
        self.engine = engine
        self.autocommit = autocommit
        self._lock = threading.Lock()
        self._idle: list[_Kept] = []  # kept and not lent; the one used last at the end
        self._lent = 0  # kept connections lent out now
        self._generation = 0  # moved on by close(): a loan of an older one ends by closing it
        self._pid = os.getpid()
        self._inherited: list[Connection] = []
        # StaticPool and SingletonThreadPool hand every borrower in a thread
        # (or in the process) the same DBAPI connection: keeping it in
        # autocommit would change it under the application's own sessions.
        shares_one = isinstance(engine.pool, SingletonThreadPool | StaticPool)
        self._keep = 0 if shares_one else _how_many_to_keep(engine)

    @contextmanager
    def lend(self) -> Iterator[Connection]:
        """A kept connection, or a pooled one if every kept one is lent; a transaction unless autocommit."""
        kept = self._take()
        if kept is None:
            with self._pooled() as conn, self._scope(conn):
                yield conn
            return
        try:
            with self._scope(kept.conn):
                yield kept.conn
        except BaseException:
            self._give_back(kept, broken=True)
            raise
        self._give_back(kept, broken=False)

    def _scope(self, conn: Connection) -> AbstractContextManager[object]:
        # In autocommit every statement commits on its own, and beginning and
        # committing a transaction around it would only cost CPU.
        return contextlib.nullcontext() if self.autocommit else conn.begin()

    def close(self) -> None:
        """Give the kept connections back to the pool (later loans check out new ones).

        One lent out now goes back to the pool when its loan ends.
        """
        self._after_fork()
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation += 1
        for kept in idle:
            self._close(kept.conn)

    def _take(self) -> _Kept | None:
        """An idle kept connection, a new one to keep, or None: take a pooled one."""
        self._after_fork()
        with self._lock:
            if self._idle:
                kept: _Kept | None = self._idle.pop()
            elif self._lent < self._keep:
                kept = None  # a new one, checked out below
            else:
                return None
            self._lent += 1
            generation = self._generation
        try:
            if kept is not None and time.monotonic() - kept.checked_out_at > RENEW_AFTER:
                self._close(kept.conn)
                kept = None
            if kept is None:
                conn = self.engine.connect()
                if self.autocommit:
                    conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                kept = _Kept(conn, time.monotonic(), generation)
        except BaseException:
            with self._lock:
                self._lent -= 1
            raise
        return kept

    def _give_back(self, kept: _Kept, *, broken: bool) -> None:
        with self._lock:
            self._lent -= 1
            keep = not broken and kept.generation == self._generation and self._pid == os.getpid()
            if keep:
                self._idle.append(kept)
        if not keep:
            self._close(kept.conn)

    def _after_fork(self) -> None:
        """In a forked child, leave the parent's connections alone and start afresh.

        Checked before the lock is taken: a parent's thread may have held it
        at the fork, and the child has a lock of its own from here.
        """
        if self._pid == os.getpid():
            return
        self._inherited += [kept.conn for kept in self._idle]
        self._lock = threading.Lock()
        self._idle, self._lent = [], 0
        self._generation += 1  # a loan made in the parent is never kept here
        self._pid = os.getpid()

    def _close(self, conn: Connection) -> None:
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


def _how_many_to_keep(engine: Engine) -> int:
    """`KEEP`, or fewer where the pool is small, so that the application's sessions always find one.

    A pool of one connection (pool_size=1, max_overflow=0) keeps none.
    """
    pool = engine.pool
    if not isinstance(pool, QueuePool):
        return KEEP
    overflow = getattr(pool, "_max_overflow", 0)
    if overflow < 0:
        return KEEP
    return max(0, min(KEEP, pool.size() + overflow - 1))


__all__ = ["KEEP", "KeptConnection"]
