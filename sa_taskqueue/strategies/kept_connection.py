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
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import Pool, QueuePool, SingletonThreadPool, StaticPool

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
    pid: int


#: Every KeptConnection of this process, reset in a forked child (`_after_fork_in_child`).
_INSTANCES: weakref.WeakSet[KeptConnection] = weakref.WeakSet()


class KeptConnection:
    """Connections kept for one engine, each lent to one borrower at a time.

    ``autocommit`` keeps them in the driver's autocommit mode, for statements
    that are atomic on their own (and for SQLite's explicit ``BEGIN
    IMMEDIATE``); otherwise each loan is a transaction that commits when the
    borrower is done, at ``transaction_isolation`` if given (set once per
    connection kept; the pool sets its own level back when it returns).
    After an error the connection lent is closed and a later loan checks
    out a new one, so a broken connection is never lent again.  The one
    used last is lent first, so a single thread always gets the same
    connection.  A forked child never touches the connections its parent
    kept, idle or lent: it checks out its own, and leaves the
    parent's alone (closing them, or letting them be collected, would write
    on the parent's socket).
    """

    def __init__(self, engine: Engine, *, autocommit: bool, transaction_isolation: str | None = None) -> None:
        self.engine = engine
        self.autocommit = autocommit
        self.transaction_isolation = transaction_isolation
        self._lock = threading.Lock()
        self._idle: list[_Kept] = []  # kept and not lent; the one used last at the end
        self._lent: list[_Kept] = []  # kept and lent out now
        self._connecting = 0  # new ones being checked out to keep
        self._generation = 0  # moved on by close(): a loan of an older one ends by closing it
        self._inherited: list[Connection] = []  # a forked child's share of its parent's: never touched
        # StaticPool and SingletonThreadPool hand every borrower in a thread
        # (or in the process) the same DBAPI connection: keeping it in
        # autocommit would change it under the application's own sessions.
        shares_one = isinstance(engine.pool, SingletonThreadPool | StaticPool)
        self._keep = 0 if shares_one else how_many_to_keep(engine.pool)
        _INSTANCES.add(self)

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
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation += 1
        for kept in idle:
            _close(kept.conn)

    @property
    def kept(self) -> int:
        """How many connections are kept now, idle or lent."""
        with self._lock:
            return len(self._idle) + len(self._lent)

    def _take(self) -> _Kept | None:
        """An idle kept connection, a new one to keep, or None: take a pooled one."""
        with self._lock:
            kept: _Kept | None = None
            if self._idle:
                kept = self._idle.pop()
                self._lent.append(kept)
            elif len(self._lent) + self._connecting < self._keep:
                self._connecting += 1  # checked out below, outside the lock
            else:
                return None
            generation = self._generation
        if kept is not None:
            if time.monotonic() - kept.checked_out_at <= RENEW_AFTER:
                return kept
            with self._lock:  # too old: a fresh one in its place
                _remove(self._lent, kept)
                self._connecting += 1
            _close(kept.conn)
        try:
            conn = self.engine.connect()
            if self.autocommit:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            elif self.transaction_isolation is not None:
                conn = conn.execution_options(isolation_level=self.transaction_isolation)
        except BaseException:
            with self._lock:
                self._connecting -= 1
            raise
        fresh = _Kept(conn, time.monotonic(), generation, os.getpid())
        with self._lock:
            self._connecting -= 1
            self._lent.append(fresh)
        return fresh

    def _give_back(self, kept: _Kept, *, broken: bool) -> None:
        if kept.pid != os.getpid():
            return  # lent in the parent before a fork: the parent's, left alone
        with self._lock:
            _remove(self._lent, kept)
            keep = not broken and kept.generation == self._generation
            if keep:
                self._idle.append(kept)
        if not keep:
            _close(kept.conn)

    def _after_fork_in_child(self) -> None:
        """Leave every connection the parent kept, idle or lent, and start afresh.

        Run in the child right after the fork, while it has one thread.
        """
        self._inherited += [kept.conn for kept in (*self._idle, *self._lent)]
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        self._idle, self._lent, self._connecting = [], [], 0
        self._generation += 1

    @contextmanager
    def _pooled(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT") if self.autocommit else conn


def _close(conn: Connection) -> None:
    # Closing returns it to the pool, whose reset may fail on a broken
    # connection; the borrower's own error is the one to report.
    with contextlib.suppress(Exception):
        conn.close()


def _remove(kept_list: list[_Kept], kept: _Kept) -> None:
    """Take ``kept`` itself (not an equal one) out of ``kept_list``."""
    for index, other in enumerate(kept_list):
        if other is kept:
            del kept_list[index]
            return


def how_many_to_keep(pool: Pool) -> int:
    """How many connections to keep out of ``pool``: `KEEP`, fewer where it is small.

    The application's sessions, and a worker's LISTEN connection, must still
    find one: a pool of at most three connections lends one, and a pool of
    one none.
    """
    if not isinstance(pool, QueuePool):
        return KEEP
    overflow = getattr(pool, "_max_overflow", 0)
    if overflow < 0:
        return KEEP
    total = pool.size() + overflow
    return 0 if total < 2 else 1 if total < 4 else KEEP


def _after_fork_in_child() -> None:
    for instance in list(_INSTANCES):
        instance._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["KEEP", "KeptConnection", "how_many_to_keep"]
