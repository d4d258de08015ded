"""Transactional tasks: a task's own writes and its completion, committed in one transaction.

A task registered with ``transactional=True`` takes a session as its first
parameter.  The worker opens a connection on the queue's engine, begins a
transaction on it (with the backend's ``write_begin`` where it has one:
SQLite's BEGIN IMMEDIATE, so that a task that reads before it writes waits for
the write lock instead of failing on it), and binds the session to that
connection in ``create_savepoint`` mode: the task's own ``commit()`` only
releases a savepoint, never the transaction.  When the task returns, its
session is flushed and the completion (status COMPLETED, result, finished_at)
is written on the same connection by the strategy's fenced UPDATE
(`LeaseWrites.complete_on`), and the transaction commits only if that UPDATE
found the row still held by this claim.  Otherwise (the lease ran out and
another worker took the task, or the worker gave the task back) the whole
transaction rolls back: the task's writes are never seen.  A failure rolls
back too, and is recorded by the ordinary fail path in a transaction of its
own.  So the task's writes on that session happen exactly once, together with
the one completion, however often workers die midway.

A run whose own connection is cut (the server restarted, the connection was
killed) says so in ``cut``: its transaction ended on the server with the
connection, its writes with it, through no fault of the task's, and the worker
gives the task back rather than count the attempt.

Only the writes made through the given session are covered: anything else
the task does (another database, an HTTP call, a mail) is at least once.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from sa_taskqueue.backends import backend_for
from sa_taskqueue.backends.write_gate import Passage

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    from sa_taskqueue.core.claimed import ClaimedTask
    from sa_taskqueue.core.registered import RegisteredTask

logger = logging.getLogger("sa_taskqueue")


def check_transactional(func: Callable[..., Any], task_name: str, *, queue_is_async: bool) -> None:
    """Refuse, at registration, a transactional function the worker could not give a session to.

    It needs a first positional parameter for the session, and a session of
    the kind its queue's engine can open: an ``async def`` an `AsyncSession`
    (a queue on an `AsyncEngine`), a plain ``def`` a `Session` (a queue on an
    `Engine`).  A plain ``def`` on an async engine is refused rather than run
    in a greenlet on the engine's loop, where it would hold up every other
    call of the queue (lease renewals included) for as long as it runs.
    """
    if session_parameter(func) is None:
        raise TypeError(
            f"transactional task {task_name!r} must take the session as its first positional "
            "parameter, e.g. `def task(session, **params)`: the worker passes it"
        )
    is_async = inspect.iscoroutinefunction(func)
    if is_async and not queue_is_async:
        raise TypeError(
            f"transactional task {task_name!r} is an async def, but its queue is on a sync Engine: "
            "build the queue on an AsyncEngine (the task then gets an AsyncSession on it), "
            "or make the task a plain def (it then gets a Session)"
        )
    if not is_async and queue_is_async:
        raise TypeError(
            f"transactional task {task_name!r} is a plain def, but its queue is on an AsyncEngine: "
            "make it an async def (it then gets an AsyncSession on that engine)"
        )


class TransactionalQueue(Protocol):
    """What running a transactional task needs of its queue."""

    @property
    def engine(self) -> Engine:
        """The engine the task's session and its completion share a connection of."""

    @property
    def task_names(self) -> list[str]:
        """The names registered."""

    def registered(self, name: str) -> RegisteredTask[Any, Any] | None:
        """The task registered under ``name``, or None."""

    def complete_in(self, conn: Connection, claimed: ClaimedTask, result: Any = None) -> bool:
        """Write the completion in ``conn``'s open transaction if the claim still holds the task."""


def check_no_transactional(queue: TransactionalQueue) -> None:
    """Refuse to start a worker with ``isolation="process"`` on a queue with transactional tasks.

    The task's transaction must end with the completion the worker writes;
    a child process would have to open its own engine and report back before
    committing, and a child killed between the two would leave the outcome
    to chance.  Thread isolation runs them (and async tasks on the engine's loop).
    """
    names = [name for name in queue.task_names if _is_transactional(queue, name)]
    if names:
        raise ValueError(
            f"isolation='process' cannot run transactional tasks ({', '.join(names)}): "
            "run this queue's worker with isolation='thread'"
        )


def _is_transactional(queue: TransactionalQueue, name: str) -> bool:
    registered = queue.registered(name)
    return registered is not None and registered.options.transactional


def session_parameter(func: Callable[..., Any]) -> inspect.Parameter | None:
    """The first parameter of ``func`` if a positional argument can fill it, else None."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].kind not in positional:
        return None
    return parameters[0]


def out_of_autocommit(conn: Connection) -> Connection:
    """``conn``, out of AUTOCOMMIT if its engine is in it, so that ``begin`` begins a transaction.

    An engine made with ``isolation_level="AUTOCOMMIT"`` sends no BEGIN, and
    each write would commit on its own (MySQL and MariaDB even accept the
    session's SAVEPOINT then): the task's writes could never roll back with
    its completion.  The level applies to this checkout only.
    """
    if in_autocommit(conn):
        conn.execution_options(isolation_level=_transaction_level(conn.dialect))
    return conn


def in_autocommit(conn: Connection) -> bool:
    """Whether ``conn`` is in AUTOCOMMIT, set on it or its engine (`get_isolation_level` does not say)."""
    if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        return True
    detect = getattr(conn.dialect, "detect_autocommit_setting", None)
    return bool(detect(conn.connection.dbapi_connection)) if detect is not None else False


def _transaction_level(dialect: Dialect) -> str:
    """The isolation level the database gives a new connection, or READ COMMITTED if that is AUTOCOMMIT."""
    level = dialect.default_isolation_level
    return level if level and level != "AUTOCOMMIT" else "READ COMMITTED"


class SyncRun:
    """One run of a plain ``def`` transactional task: its connection, transaction and session.

    `call` (what the slot runs, and times) leaves the transaction open with
    the task's writes flushed; `settle` then commits it with the completion
    or rolls it back, and always closes the connection.
    """

    def __init__(self, queue: TransactionalQueue, func: Callable[..., Any]) -> None:
        self.queue = queue
        self.func = func
        self.conn: Connection | None = None
        #: The run's connection was found dead (SQLAlchemy invalidated it on a disconnect error).
        self.cut = False
        self.passage: Passage | None = None  # through the database's write gate, where it has one

    def pass_gate(self) -> None:
        """Wait at the database's write gate, where it has one (before the run, which is timed).

        A lease renewal goes ahead of a task waiting there
        (`sa_taskqueue.backends.write_gate`): on SQLite a transactional task
        holds the database's one write lock for its whole run, and other
        workers' renewals would starve behind it.  `discard` lets the next
        writer in.
        """
        self.passage = write_passage(self.queue.engine)

    def leave_gate(self) -> None:
        passage, self.passage = self.passage, None
        if passage is not None:
            passage.leave()

    def call(self, **params: Any) -> Any:
        conn: Connection | None = None
        try:
            conn = self.conn = self.queue.engine.connect()
            out_of_autocommit(conn)
            conn.begin()
            write_begin = backend_for(conn.dialect).write_begin
            if write_begin is not None:
                conn.exec_driver_sql(write_begin)
            session = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
            with session:
                result = self.func(session, **params)
                session.commit()  # flushes, and releases the savepoint: the transaction stays open
            return result
        except BaseException:
            self.cut = conn is not None and conn.invalidated
            self.discard()
            raise

    def settle(self, task: ClaimedTask, result: Any, *, commit: bool) -> bool:
        """Commit with the task's fenced completion (``commit``) or roll back; True if it committed.

        An error writing the completion (a result the database refuses, an
        outage) rolls back and is raised, for the ordinary fail path.
        """
        conn = self.conn
        if conn is None:
            self.discard()  # (the run failed before it had a connection: the gate is still to leave)
            return False
        try:
            if not commit or not self.queue.complete_in(conn, task, result):
                return False
            conn.commit()
            return True
        except BaseException:
            self.cut = conn.invalidated
            raise
        finally:
            self.discard()

    def discard(self) -> None:
        """Roll back whatever is still open, give the connection back, and let the next writer in."""
        conn, self.conn = self.conn, None
        try:
            if conn is not None:
                _close(conn)
        finally:
            self.leave_gate()


class AsyncRun:
    """As `SyncRun`, for an ``async def``: an `AsyncSession` on the queue's `AsyncEngine`, on its loop."""

    def __init__(self, queue: TransactionalQueue, func: Callable[..., Any]) -> None:
        self.queue = queue
        self.func = func
        self.conn: AsyncConnection | None = None
        self.cut = False
        self.passage: Passage | None = None

    def pass_gate(self) -> None:
        """As `SyncRun.pass_gate` (called on the slot's thread, not the loop: it blocks)."""
        self.passage = write_passage(self.queue.engine)

    def leave_gate(self) -> None:
        passage, self.passage = self.passage, None
        if passage is not None:
            passage.leave()

    async def call(self, **params: Any) -> Any:
        from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

        # The AsyncEngine proxying the queue's engine: same pool, same loop.
        engine = AsyncEngine._retrieve_proxy_for_target(self.queue.engine)
        conn: AsyncConnection | None = None
        try:
            conn = self.conn = await engine.connect()
            await conn.run_sync(out_of_autocommit)
            await conn.begin()
            write_begin = backend_for(conn.dialect).write_begin
            if write_begin is not None:
                await conn.exec_driver_sql(write_begin)
            session: AsyncSession = AsyncSession(
                bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False
            )
            async with session:
                result = await self.func(session, **params)
                await session.commit()
            return result
        except BaseException:
            self.cut = conn is not None and conn.invalidated
            await self.discard()
            raise

    async def settle(self, task: ClaimedTask, result: Any, *, commit: bool) -> bool:
        """As `SyncRun.settle`, on the engine's loop."""
        conn = self.conn
        if conn is None:
            await self.discard()
            return False
        try:
            if not commit:
                return False
            written = await conn.run_sync(lambda sync_conn: self.queue.complete_in(sync_conn, task, result))
            if not written:
                return False
            await conn.commit()
            return True
        except BaseException:
            self.cut = conn.invalidated
            raise
        finally:
            await self.discard()

    async def discard(self) -> None:
        try:
            await self._close()
        finally:
            self.leave_gate()

    async def _close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            if conn.in_transaction():
                await conn.rollback()
            await conn.close()
        except BaseException:
            logger.debug("closing a transactional task's connection failed; dropping it", exc_info=True)
            await conn.invalidate()
            await conn.close()
            raise


def write_passage(engine: Engine) -> Passage | None:
    """A writer's passage through ``engine``'s database's write gate, entered (it waits); None without one."""
    gate = backend_for(engine.dialect).write_gate(engine.url)
    if gate is None:
        return None
    passage = gate.writer()
    passage.enter()
    return passage


def _close(conn: Connection) -> None:
    """Roll back and close ``conn``; a connection that cannot even do that is dropped from the pool."""
    try:
        if conn.in_transaction():
            conn.rollback()
        conn.close()
    except Exception:
        logger.debug("closing a transactional task's connection failed; dropping it", exc_info=True)
        conn.invalidate()
        conn.close()


def log_lease_lost(task: ClaimedTask) -> None:
    logger.warning(
        "task %d %s attempt %d: rolled back its writes and its completion: its lease was lost "
        "(another worker may hold the task now)",
        task.id,
        task.name,
        task.attempts,
    )


__all__ = [
    "AsyncRun",
    "SyncRun",
    "check_no_transactional",
    "check_transactional",
    "session_parameter",
]
