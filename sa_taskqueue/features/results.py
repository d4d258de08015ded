"""Waiting for a task's result: read the row until it is finished, woken by NOTIFY where there is one.

A wait is a loop of reads of the task's row.  Between two reads it sleeps,
and what ends the sleep depends on the database:

- On PostgreSQL one `FinishedListener` per queue LISTENs on a connection of
  its own, however many wait in the process, and holds there a shared
  advisory lock per task waited for.  A write of a final status finding
  that lock held sends the task's id on the table's finished channel in the
  same transaction (`sa_taskqueue.core.finished.announcing`); the listener wakes
  the waiters of the ids announced, and each reads its row again.  The
  waiters still read every ``poll_interval`` seconds, so a notification
  lost while the listener reconnects costs one poll, never a hang.
- Elsewhere (MySQL, MariaDB, SQLite, Oracle) there is no channel: the reads
  back off exponentially from a few milliseconds up to ``poll_interval``.

A task that failed an attempt and is queued again to retry is not finished:
the wait goes on until a final status (COMPLETED, FAILED, CANCELLED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, Table, select

from sa_taskqueue.core import validation
from sa_taskqueue.core.exceptions import ResultTimeout, TaskCancelled, TaskFailed, TaskNotFound
from sa_taskqueue.core.finished import finished_channel_name, wait_key, wait_namespace
from sa_taskqueue.core.model import FINISHED_STATUSES, TaskStatus
from sa_taskqueue.core.notify import _sync_listening_engine, can_listen
from sa_taskqueue.features.ports import QueueContext

logger = logging.getLogger("sa_taskqueue")

#: The first pause between two reads of a task not yet finished, in seconds.
FIRST_POLL = 0.005
#: The default longest pause between two reads, in seconds.
DEFAULT_POLL_INTERVAL = 0.5
#: How long a listener with no waiter left keeps its connection, for the next wait.
LISTENER_LINGER = 30.0
#: How often, in seconds, the listener takes the locks of new waits between notifications.
LOCKS_EVERY = 0.05


@dataclass(frozen=True)
class TaskOutcome:
    """What a read of a task's row says about its result."""

    task_id: int
    status: TaskStatus
    result: Any
    last_error: str | None
    attempts: int

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def value(self) -> Any:
        """The result of a completed task; raises for a failed or cancelled one."""
        if self.status == TaskStatus.FAILED:
            raise TaskFailed(self.task_id, attempts=self.attempts, last_error=self.last_error)
        if self.status == TaskStatus.CANCELLED:
            raise TaskCancelled(self.task_id, attempts=self.attempts)
        return self.result


def read_outcome(engine: Engine, table: Table, task_id: int) -> TaskOutcome:
    """The task's row as it is now; `TaskNotFound` if there is none."""
    query = select(table.c.status, table.c.result, table.c.last_error, table.c.attempts).where(
        table.c.id == task_id
    )
    with engine.connect() as conn:
        row = conn.execute(query).first()
    if row is None:
        raise TaskNotFound(task_id)
    return TaskOutcome(task_id, TaskStatus(row[0]), row[1], row[2], row[3])


def wait_seconds(timeout: timedelta | float | None, argument: str = "timeout") -> float | None:
    """``timeout`` as seconds, checked: None (for ever), or zero or more."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise ValueError(f"{argument} must be None or seconds (a number or timedelta) >= 0, got {timeout!r}")
    return float(seconds)


#: The longest ``poll_interval``: a day.  Longer pauses would overflow the platform's timed waits.
MAX_POLL_INTERVAL = 86_400.0


def poll_seconds(poll_interval: float) -> float:
    """``poll_interval`` checked: a positive number of seconds, at most `MAX_POLL_INTERVAL`."""
    if (
        isinstance(poll_interval, bool)
        or not isinstance(poll_interval, int | float)
        or not 0 < poll_interval <= MAX_POLL_INTERVAL
    ):
        raise ValueError(
            f"poll_interval must be a number of seconds above 0 and at most {MAX_POLL_INTERVAL:.0f} (a day), "
            f"got {poll_interval!r}"
        )
    return float(poll_interval)


class Pauses:
    """The pauses between reads: doubling from `FIRST_POLL` up to ``cap``, bounded by what remains.

    Where a notification wakes the waiter (``listening``), it need not look
    often: it pauses ``cap`` straight away.
    """

    def __init__(self, timeout: float | None, cap: float) -> None:
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.cap = cap
        self._next = min(FIRST_POLL, cap)

    def waited(self) -> float:
        return time.monotonic() - self.started

    def next(self, *, listening: bool) -> float | None:
        """The next pause, or None when the time is up."""
        pause = self.cap if listening else self._next
        self._next = min(self._next * 2, self.cap)
        if self.deadline is None:
            return pause
        remaining = self.deadline - time.monotonic()
        return None if remaining <= 0 else min(pause, remaining)


def timed_out(outcome: TaskOutcome, pauses: Pauses) -> ResultTimeout:
    return ResultTimeout(outcome.task_id, pauses.waited(), outcome.status.value)


def wait_for_result(
    read: Callable[[], TaskOutcome],
    listener: FinishedListener,
    task_id: int,
    timeout: float | None,
    cap: float,
) -> Any:
    """Read the task's row until it is finished (or the time is up), pausing between reads; its result."""
    pauses = Pauses(timeout, cap)
    woken = threading.Event()
    with listener.registered(task_id, woken.set):
        while True:
            woken.clear()  # before the read: a notification from here on ends the next pause
            outcome = read()
            if outcome.finished:
                return outcome.value()
            listening = listener.armed(task_id)
            pause = pauses.next(listening=listening)
            if pause is None:
                raise timed_out(outcome, pauses)
            with listener.parking() if listening else contextlib.nullcontext():
                woken.wait(pause)


async def wait_for_result_async(
    read: Callable[[], Awaitable[TaskOutcome]],
    listener: FinishedListener,
    task_id: int,
    timeout: float | None,
    cap: float,
) -> Any:
    """`wait_for_result` on the running event loop: the reads are awaited, the pauses never block it."""
    loop = asyncio.get_running_loop()
    pauses = Pauses(timeout, cap)
    woken = asyncio.Event()

    def wake() -> None:
        # From the listener's thread; the loop may be closing as the wait ends.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(woken.set)

    with listener.registered(task_id, wake):
        while True:
            woken.clear()
            outcome = await read()
            if outcome.finished:
                return outcome.value()
            listening = listener.armed(task_id)
            pause = pauses.next(listening=listening)
            if pause is None:
                raise timed_out(outcome, pauses)
            parked = listener.parking() if listening else contextlib.nullcontext()
            with parked, contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), pause)


class FinishedListener:
    """One LISTEN connection per queue on the finished channel, waking whoever waits for the ids announced.

    Started by the first waiter; it stops after `LISTENER_LINGER` seconds
    with nobody waiting (or at `close`), and the next waiter starts it again.
    Waiters register a ``wake`` callable per task id.  On its connection the
    listener holds a shared advisory lock per id waited for, which is what
    makes a finishing write announce that id (`sa_taskqueue.core.finished.announcing`);
    once the lock is held the id is `armed`.  ``wake`` is called from the
    listener's thread on every notification naming the id, and when the id
    is armed (a write that committed before then announced nothing: the row
    is read again).
    """

    def __init__(self, engine: Engine, table: Table) -> None:
        self.engine = engine
        self.table = table
        self.channel = finished_channel_name(table)
        self.namespace = wait_namespace(table)
        self.enabled = can_listen(engine)
        #: Set while the LISTEN is in place.
        self.listening = threading.Event()
        #: How many waiters sit in a pause only a notification (or their poll interval) ends.
        self.parked = 0
        self._mutex = threading.Lock()
        self._waiters: dict[int, dict[int, Callable[[], None]]] = {}
        self._armed: set[int] = set()  # ids whose lock the current connection holds
        self._to_unlock: set[int] = set()  # armed ids nobody waits for any more
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._idle_since = time.monotonic()

    def armed(self, task_id: int) -> bool:
        """Whether a write finishing ``task_id`` from now on announces it to this listener."""
        with self._mutex:
            return task_id in self._armed

    @contextmanager
    def registered(self, task_id: int, wake: Callable[[], None]) -> Iterator[None]:
        """Call ``wake`` whenever ``task_id`` may have finished, for the duration of the block."""
        if not self.enabled:
            yield
            return
        token = id(wake)
        with self._mutex:
            self._waiters.setdefault(task_id, {})[token] = wake
            self._to_unlock.discard(task_id)
            self._ensure_running()
        try:
            yield
        finally:
            with self._mutex:
                wakes = self._waiters.get(task_id, {})
                wakes.pop(token, None)
                if not wakes:
                    self._waiters.pop(task_id, None)
                    if task_id in self._armed:
                        self._to_unlock.add(task_id)
                if not self._waiters:
                    self._idle_since = time.monotonic()

    @contextmanager
    def parking(self) -> Iterator[None]:
        """Count a waiter as parked (waiting on a notification) for the block."""
        with self._mutex:
            self.parked += 1
        try:
            yield
        finally:
            with self._mutex:
                self.parked -= 1

    def _ensure_running(self) -> None:
        # Called with the mutex held.  A forked child has the object but not the thread.
        if self._pid != os.getpid():
            self._pid, self._thread = os.getpid(), None
            self.listening = threading.Event()
            self._armed.clear()
            self._to_unlock.clear()
        if self._thread is not None and self._thread.is_alive() and not self._stop.is_set():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self._stop,), name="sa_taskqueue-results", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop listening (waiters keep polling; the next wait starts the listener again).

        Returns at once: the thread sees the stop between two short waits
        for notifications, and closes its connection then.
        """
        with self._mutex:
            self._stop.set()
            # Nothing announces an id from now on: waiters parked on a
            # notification go back to polling at once, not after their interval.
            self._armed.clear()
            self._to_unlock.clear()
            wakes = [wake for waiting in self._waiters.values() for wake in waiting.values()]
        for wake in wakes:
            wake()

    def _wake(self, ids: set[int]) -> None:
        with self._mutex:
            wakes = [wake for task_id in ids for wake in self._waiters.get(task_id, {}).values()]
        for wake in wakes:
            wake()

    def _idle_too_long(self, stop: threading.Event) -> bool:
        with self._mutex:
            if not self._waiters and time.monotonic() - self._idle_since > LISTENER_LINGER:
                stop.set()  # under the mutex: a waiter arriving now starts a new thread
                return True
        return False

    def _run(self, stop: threading.Event) -> None:
        listening = self.listening
        backoff = 0.5
        engine = _sync_listening_engine(self.engine) if self.engine.dialect.is_async else self.engine
        try:
            while not stop.is_set():
                try:
                    self._listen(engine, stop, listening)
                except Exception as error:  # noqa: BLE001 - reconnect on any failure; waiters poll meanwhile
                    logger.warning("LISTEN for finished tasks lost; again in %.1fs: %s", backoff, error)
                    stop.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
                else:
                    backoff = 0.5
        finally:
            listening.clear()
            self._forget_locks()
            if engine is not self.engine:
                engine.dispose()

    def _listen(self, engine: Engine, stop: threading.Event, listening: threading.Event) -> None:
        raw = engine.raw_connection()
        driver: Any = raw.driver_connection
        # Detached from the pool at once: the LISTEN connection is held as long
        # as anyone waits, and must not keep a slot of the application's pool.
        # It was opened as the pool opens any (URL, connect_args, events).
        raw.detach()
        try:
            driver.autocommit = True
            driver.execute(f"LISTEN {self.engine.dialect.identifier_preparer.quote(self.channel)}")
            listening.set()
            while not stop.is_set() and not self._idle_too_long(stop):
                self._update_locks(driver)
                for notification in driver.notifies(timeout=LOCKS_EVERY):
                    self._wake(_ids(notification.payload))
        finally:
            listening.clear()
            self._forget_locks()  # the locks go with the connection
            raw.close()  # detached: closed, not returned to the pool

    def _forget_locks(self) -> None:
        """Forget the ids armed on this thread's connection, unless a newer listener thread owns them now."""
        with self._mutex:
            if self._thread is threading.current_thread():
                self._armed.clear()
                self._to_unlock.clear()

    def _update_locks(self, driver: Any) -> None:
        """Lock the ids newly waited for and wake their waiters; unlock those nobody waits for any more."""
        with self._mutex:
            wanted = sorted(set(self._waiters) - self._armed)
            unwanted = sorted(self._to_unlock)
            self._to_unlock.clear()
        if unwanted:
            self._locks(driver, "pg_advisory_unlock_shared", unwanted)
            with self._mutex:
                # One waited for again meanwhile is locked again on the next round.
                self._armed.difference_update(unwanted)
        if wanted:
            # Waits briefly if a write finishing one of them holds it: until it commits.
            self._locks(driver, "pg_advisory_lock_shared", wanted)
            with self._mutex:
                self._armed.update(wanted)
                self._to_unlock.update(task_id for task_id in wanted if task_id not in self._waiters)
            self._wake(set(wanted))

    def _locks(self, driver: Any, function: str, ids: list[int]) -> None:
        for start in range(0, len(ids), 500):  # a SELECT list takes at most 1,664 entries
            chunk = ids[start : start + 500]
            calls = ", ".join(f"{function}(%s, %s)" for _ in chunk)
            driver.execute(
                f"SELECT {calls}", [key for task_id in chunk for key in (self.namespace, wait_key(task_id))]
            )


def _ids(payload: str) -> set[int]:
    ids: set[int] = set()
    for part in payload.split(","):
        try:
            ids.add(int(part))
        except ValueError:
            continue
    return ids


class Results:
    """Waiting for a task's result: reads of its row, woken early by the finished channel if any."""

    def __init__(self, context: QueueContext) -> None:
        self._context = context
        #: Wakes waiters when their task finishes (PostgreSQL); started by the first wait.
        self.listener = FinishedListener(context.engine, context.table)

    def wait(self, task_id: int, timeout: timedelta | float | None, poll_interval: float) -> Any:
        """The result of task ``task_id`` once it is finished, as `TaskQueue.result` describes."""
        validation.check_task_id(task_id)
        seconds = wait_seconds(timeout)
        cap = poll_seconds(poll_interval)
        context = self._context

        def read() -> TaskOutcome:
            with context.database_errors():
                return context.call(lambda: read_outcome(context.engine, context.table, task_id))

        return wait_for_result(read, self.listener, task_id, seconds, cap)

    async def wait_async(self, task_id: int, timeout: timedelta | float | None, poll_interval: float) -> Any:
        """`wait` for a coroutine: the reads are awaited, the pauses never block the running loop."""
        validation.check_task_id(task_id)
        seconds = wait_seconds(timeout)
        cap = poll_seconds(poll_interval)
        context = self._context

        async def read() -> TaskOutcome:
            with context.database_errors():
                return await context.call_async(lambda: read_outcome(context.engine, context.table, task_id))

        return await wait_for_result_async(read, self.listener, task_id, seconds, cap)


__all__ = [
    "DEFAULT_POLL_INTERVAL",
    "FIRST_POLL",
    "FinishedListener",
    "Pauses",
    "Results",
    "TaskOutcome",
    "poll_seconds",
    "read_outcome",
    "timed_out",
    "wait_for_result",
    "wait_for_result_async",
    "wait_seconds",
]
