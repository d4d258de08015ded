"""`EventLoopBridge`: the queue's synchronous database calls, run where an async engine's connections live.

Every claim strategy is written once, against SQLAlchemy's synchronous API.
An `AsyncEngine` is a synchronous `Engine` (its ``sync_engine``) whose driver
calls are awaited from inside a greenlet; SQLAlchemy's ``greenlet_spawn``
runs a synchronous function that way on an event loop.  So rather than a
second, async copy of every strategy, the queue keeps the synchronous ones
and the bridge runs each database call in a greenlet on the event loop that
owns the engine's connections, while the calling thread (a worker slot, the
heartbeat, the application's own thread) waits for the answer.  The
thread-based `Worker`, with its slots, heartbeat, watchdog and outage
handling, then works on an async engine unchanged.

Three rules keep that safe:

- **One loop per engine.**  asyncpg and aiomysql connections belong to the
  loop that opened them.  An engine's queue calls run on one loop: the loop
  ``run_worker_async`` was awaited on while it runs, otherwise a loop of the
  bridge's own, in a daemon thread.  The pool still serves the application
  too, maybe from another loop: a connection checked out on a loop other than
  the one that opened it is closed and replaced (SQLAlchemy's disconnect
  handling on checkout), so no connection is ever used from two loops.
  Queues sharing an engine share its own loop, and so its connections.
- **One queue call at a time per loop.**  The strategies hold
  ``threading.Lock`` s (an advisory claim's connection, for one)
  around I/O.  Two greenlets on one loop thread contending for such a lock
  would block the thread that should wake the holder: a deadlock.  An
  `asyncio.Lock` per loop lets one queue greenlet run at a time.  They are
  single short statements; the application's own coroutines are not held up.
- **Never from the loop's own thread.**  A synchronous call made there would
  wait for the loop it blocks; it raises `SyncCallOnEventLoop` instead,
  saying to use ``await asyncio.to_thread(...)``.

For a synchronous engine the bridge is a plain call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar

from sqlalchemy import Engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from sa_taskqueue.backends import loop_bound_drivers

T = TypeVar("T")

#: Where a connection record keeps (a weak reference to) the loop that opened it.
_OPENED_ON = "sa_taskqueue_opened_on_loop"


def asyncio_extension() -> ModuleType | None:
    """``sqlalchemy.ext.asyncio`` if something imported it, else None.

    Without that module no `AsyncEngine` or `AsyncSession` can exist, so the
    queue need not import it (it needs greenlet, an optional dependency) to
    tell whether it was given one.
    """
    return sys.modules.get("sqlalchemy.ext.asyncio")


class SyncCallOnEventLoop(RuntimeError):
    """A synchronous queue method was called from the thread running its engine's event loop."""


class EventLoopBridge:
    """Runs synchronous database calls for one engine: directly, or in a greenlet on the engine's loop.

    ``is_async`` says whether ``engine`` is an `AsyncEngine`'s ``sync_engine``.
    """

    def __init__(self, engine: Engine, *, is_async: bool) -> None:
        self.engine = engine
        self.is_async = is_async
        self._mutex = threading.Lock()
        self._attached: asyncio.AbstractEventLoop | None = None
        if is_async:
            _guard_loops(engine)

    # Where calls run ---------------------------------------------------------

    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this engine's calls run on: the attached one, else the bridge's own (started now)."""
        with self._mutex:
            if self._attached is not None:
                return self._attached
        return _own_loop(self.engine)

    @contextlib.contextmanager
    def attached(self, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
        """Run calls on ``loop`` (the application's) for the duration of the block."""
        with self._mutex:
            if self._attached is not None and self._attached is not loop:
                raise RuntimeError(
                    "this queue already runs a worker on another event loop: an async engine's "
                    "connections belong to one loop"
                )
            previous, self._attached = self._attached, loop
        try:
            yield
        finally:
            with self._mutex:
                self._attached = previous

    def on_loop_thread(self) -> bool:
        """Whether the calling thread is running this engine's loop (where a blocking call would deadlock)."""
        if not self.is_async:
            return False
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return False
        with self._mutex:
            if self._attached is not None:
                return running is self._attached
        with _OWN_LOOPS_MUTEX:
            own = _OWN_LOOPS.get(self.engine)
        return own is not None and running is own.loop

    # Calls ----------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, here for a sync engine, else in a greenlet on the engine's loop; waits for it."""
        if not self.is_async:
            return fn()
        if self.on_loop_thread():
            raise SyncCallOnEventLoop(
                "a synchronous TaskQueue method was called on the event loop that runs the queue's "
                "async engine, which it would block forever: call it as "
                "`await asyncio.to_thread(queue.method, ...)`, or use the async API "
                "(`await task.enqueue(async_session, ...)`, `await queue.run_worker_async(...)`)"
            )
        return asyncio.run_coroutine_threadsafe(self.call_async(fn), self.loop()).result()

    async def call_async(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a greenlet on the running loop, one queue call at a time on that loop."""
        from sqlalchemy.util import greenlet_spawn

        loop = asyncio.get_running_loop()
        with _OWN_LOOPS_MUTEX:
            serialiser = _SERIALISERS.get(loop)
            if serialiser is None:
                serialiser = _SERIALISERS[loop] = asyncio.Lock()
        async with serialiser:
            return await greenlet_spawn(fn)

    async def call_from_any_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` awaited from any running loop: on this one if calls run here, else on theirs.

        The caller's loop is never blocked: it awaits the answer of the loop
        that owns the engine's connections.
        """
        target = self.loop()
        if target is asyncio.get_running_loop():
            return await self.call_async(fn)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.call_async(fn), target))


#: How long a stopping loop gives its pending tasks to finish once cancelled, in seconds.
_FINISH_PENDING_SECONDS = 5.0


class LoopThread:
    """An event loop running in a daemon thread of its own until stopped."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._pid = os.getpid()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()
        self._finish_pending()

    def _finish_pending(self) -> None:
        # Tasks still pending when the loop stops (a cancelled task's cleanup,
        # an ``async with`` exit giving back a connection) are cancelled and
        # run to their end, bounded, rather than destroyed while pending.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            if not task.cancelling():  # one cancelled already is running its cleanup: leave it be
                task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=_FINISH_PENDING_SECONDS))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())

    def usable(self) -> bool:
        # A forked child has the loop object but not the thread that ran it.
        return self._pid == os.getpid() and self._thread.is_alive()

    def stop(self, *, close: bool = True) -> None:
        """Stop the loop and its thread; ``close`` the loop too, unless connections may outlive it."""
        if not self.usable():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=_FINISH_PENDING_SECONDS + 5)
        if close and not self._thread.is_alive():
            self.loop.close()


#: The loop each async engine's queue calls run on when no application loop is attached, in a
#: daemon thread that ends when the engine is collected.
_OWN_LOOPS: weakref.WeakKeyDictionary[Engine, LoopThread] = weakref.WeakKeyDictionary()
#: One queue call at a time on each loop (see the module's docstring).
_SERIALISERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
_OWN_LOOPS_MUTEX = threading.Lock()


def _own_loop(engine: Engine) -> asyncio.AbstractEventLoop:
    with _OWN_LOOPS_MUTEX:
        own = _OWN_LOOPS.get(engine)
        if own is None or not own.usable():
            own = _OWN_LOOPS[engine] = LoopThread("sa_taskqueue-loop")
            # Left open: the pool's connections may be collected after it
            # stops, and closing their transports needs a loop that is not closed.
            weakref.finalize(engine, own.stop, close=False)
        return own.loop


def _guard_loops(engine: Engine) -> None:
    """Make the pool replace, rather than use, a connection opened on another event loop."""
    if not event.contains(engine, "connect", _remember_loop):
        event.listen(engine, "connect", _remember_loop)
        event.listen(engine, "checkout", _same_loop_only)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _remember_loop(_dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    loop = _running_loop()
    if loop is not None:
        record.info[_OPENED_ON] = weakref.ref(loop)


def _same_loop_only(
    dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: PoolProxiedConnection
) -> None:
    opened_on = record.info.get(_OPENED_ON)
    current = _running_loop()
    if opened_on is None or current is None or opened_on() is current:
        return
    # SQLAlchemy's adapter classes live in a module named after the driver.
    if type(dbapi_connection).__module__.rpartition(".")[2] in _LOOP_BOUND_DRIVERS:
        # Closing it gracefully would await its old loop's futures on this
        # one: its socket is cut instead, and the pool's close then finds it
        # closed.  (aiosqlite and psycopg close from any loop.)
        force_close = getattr(dbapi_connection, "_terminate_force_close", None)
        if force_close is not None:
            with contextlib.suppress(Exception):
                force_close()
    raise DisconnectionError("the pooled connection was opened on another event loop")


#: Drivers whose connections wait on futures of the loop that opened them (`Backend.loop_bound_drivers`).
_LOOP_BOUND_DRIVERS = loop_bound_drivers()


__all__ = ["EventLoopBridge", "LoopThread", "SyncCallOnEventLoop", "asyncio_extension"]
