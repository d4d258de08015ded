"""Running one task's function: in the worker's thread, or in a child process of its own.

A child process is the stronger wall: a segfault, ``os._exit`` or a leak in a
task ends that child alone, and a timeout can be enforced by killing it.  A
thread shares the worker's fate; its timeout can only be noticed afterwards.
An ``async def`` task runs on an event loop instead of in the slot's thread
(the slot's thread waits for it), and there its timeout cancels it; in a
child process it runs on a loop of the child's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import inspect
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, overload

from sa_taskqueue.core.current_task import CancellationRequested, TaskContext, current_task
from sa_taskqueue.core.exceptions import TaskQueueError


class TaskTimeout(TaskQueueError):
    """A task ran longer than the timeout set on ``@queue.task``."""


class TaskProcessDied(TaskQueueError):
    """A task's child process ended without reporting (a crash, ``os._exit``, a signal)."""


class TaskRaised(TaskQueueError):
    """A task raised in its child process; the message carries the child's traceback."""

    def __init__(self, type_name: str, message: str, formatted: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.formatted = formatted


class GivenBack(Exception):
    """The worker gave the task back (shutting down) and killed its process: nothing to record."""


@dataclass
class Outcome:
    """What running a task came to: a result, or an error to record."""

    result: Any = None
    error: BaseException | None = None
    error_text: str | None = None  # a child's formatted traceback, kept verbatim
    #: A transactional task's: True when its completion committed with its writes (nothing left
    #: to record), False when they were rolled back for a lost lease (nothing to record either).
    committed: bool | None = None
    #: A transactional task's: its own connection was cut (a server restart, a connection killed)
    #: while it ran or committed; its writes went with it.  The database failed, not the task.
    connection_cut: bool = False
    #: A transactional task's: a Galera cluster rolled its transaction back for another node's
    #: on the same rows (a certification conflict); its writes went with it.  Nobody failed.
    certification_conflict: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def run_in_thread(func: Callable[..., Any], params: dict[str, Any], timeout: float | None) -> Outcome:
    """Call ``func`` here.  A timeout is cooperative: a late return is recorded as a failure."""
    started = time.monotonic()
    try:
        result = func(**params)
    except BaseException as error:  # noqa: BLE001 - a task's failure is data, whatever it is
        return Outcome(error=error)
    elapsed = time.monotonic() - started
    if timeout is not None and elapsed > timeout:
        late = TaskTimeout(
            f"ran {elapsed:.1f}s, over its {timeout:g}s timeout "
            "(thread isolation cannot stop a task; use isolation='process' to enforce it)"
        )
        return Outcome(error=late)
    return Outcome(result=result)


def run_on_loop(
    func: Callable[..., Any],
    params: dict[str, Any],
    timeout: float | None,
    loop: asyncio.AbstractEventLoop,
    started: Callable[[Future[Outcome]], bool] | None = None,
) -> Outcome:
    """Run the coroutine function ``func`` on ``loop`` (another thread's), waiting here for its outcome.

    ``started`` is given the run's future as soon as it is scheduled, so a
    worker giving the task back can cancel it (unlike a thread, a coroutine
    can be stopped); it returns False if the task was given back already,
    and the run is then cancelled at once.

    A timeout is enforced: the coroutine is cancelled at its next ``await``
    once the time has passed, and fails with `TaskTimeout`.  (Code that
    blocks the loop without awaiting cannot be cancelled, and holds up every
    coroutine on that loop: async tasks must await their I/O.)
    """

    # Cancelling the run's concurrent future marks it cancelled at once, while
    # the coroutine only stops at its next await, its cleanup (an ``async
    # with`` exit, a ``finally`` that writes) still to come.  The slot waits
    # for that too, so a task given back is not run elsewhere while its
    # coroutine still runs here.  A coroutine cancelled before it began never
    # runs at all: ``state`` tells the two apart without a race.
    state = _RunState()

    async def attempt() -> Outcome:
        if not state.begin():
            return Outcome(error=asyncio.CancelledError())
        try:
            return await guarded()
        finally:
            state.finished.set()

    async def guarded() -> Outcome:
        try:
            async with asyncio.timeout(timeout) as scope:
                result = await func(**params)
        except TimeoutError as error:
            if scope.expired():
                return Outcome(error=TaskTimeout(f"cancelled after its {timeout:g}s timeout"))
            return Outcome(error=error)
        except BaseException as error:  # noqa: BLE001 - a task's failure is data, whatever it is
            return Outcome(error=error)
        return Outcome(result=result)

    future = asyncio.run_coroutine_threadsafe(attempt(), loop)
    if started is not None and not started(future):
        future.cancel()
    try:
        return future.result()
    except BaseException as error:  # noqa: BLE001 - the loop cancelled it (stopping): recorded as a failure
        if state.abandon():
            state.finished.wait(CANCELLED_CLEANUP_WAIT)
        return Outcome(error=error)


#: How long a slot waits for a cancelled coroutine to run its cleanup, in seconds.
CANCELLED_CLEANUP_WAIT = 30.0


class _RunState:
    """Whether a coroutine run on another loop began, so that waiting for its end cannot hang."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._begun = False
        self._abandoned = False
        self.finished = threading.Event()

    def begin(self) -> bool:
        """On the loop: False if the waiting side has given up already (the coroutine must not run)."""
        with self._lock:
            if self._abandoned:
                return False
            self._begun = True
            return True

    def abandon(self) -> bool:
        """On the waiting side: True if the coroutine began, so its end is worth waiting for."""
        with self._lock:
            self._abandoned = True
            return self._begun


def _call(func: Callable[..., Any], params: dict[str, Any]) -> Any:
    """``func(**params)``; an ``async def`` runs to its end on an event loop of this (child) process."""
    if inspect.iscoroutinefunction(func):
        return asyncio.run(func(**params))
    return func(**params)


#: The tag of a progress report on a task process's pipe; the outcome's are "ok" and "error".
PROGRESS = "progress"


class ChildProcess:
    """One task run in a forked child, reporting back through a pipe.

    The pipe carries the task's progress reports, ``(PROGRESS, progress,
    note)``, each handed to ``progress`` as it arrives, and then one outcome,
    tagged "ok" or "error", the last message the child sends.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        params: dict[str, Any],
        after_fork: Callable[[], None],
        progress: Callable[[float, Any], None] | None = None,
    ) -> None:
        context = multiprocessing.get_context("fork")
        # One fork at a time: a child forked by another slot between this
        # Pipe() and close() would inherit our sending end, and our child's
        # death would then not close the pipe.
        with _FORK_LOCK:
            self._receive, send = context.Pipe(duplex=False)
            self._process = context.Process(
                target=_child_main, args=(send, func, params, after_fork, os.getpid()), daemon=True
            )
            self._process.start()
            send.close()
        self._started = time.monotonic()
        self._progress = progress
        self.killed = False

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def request_cancel(self) -> None:
        """Ask the child to stop: SIGUSR1 raises `CancellationRequested` in it (see `_child_main`)."""
        pid = self._process.pid
        if pid is not None and self._process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)

    def kill(self) -> None:
        """Stop the child now (shutdown or timeout)."""
        self.killed = True
        if self._process.is_alive():
            self._process.kill()

    @overload
    def wait(self, timeout: float | None) -> Outcome: ...
    @overload
    def wait(self, timeout: float | None, until: Callable[[], float]) -> Outcome | None: ...
    def wait(self, timeout: float | None, until: Callable[[], float] | None = None) -> Outcome | None:
        """Wait for the child's report, killing it once ``timeout`` has passed since it started.

        With ``until``, None as soon as the monotonic time it returns comes
        first, the child still running: the caller decides what becomes of
        it, and may wait again.  ``until`` is read at every step, so what it
        returns may move on meanwhile (a lease renewed).
        """
        deadline = None if timeout is None else self._started + timeout
        message: tuple[Any, ...] | None = None
        while True:
            now = time.monotonic()
            wake = now + 0.2 if deadline is None else min(now + 0.2, deadline)
            if until is not None:
                stop = until()
                if now >= stop:
                    return None
                wake = min(wake, stop)
            # The pipe also turns readable when the child dies: recv then
            # raises EOFError, since the child held the only sending end.
            if self._receive.poll(max(0.0, wake - now)):
                try:
                    message = self._receive.recv()
                except EOFError:
                    message = None
                if message is None or message[0] != PROGRESS:
                    break
                if self._progress is not None:
                    self._progress(message[1], message[2])
                message = None  # (a report, not the outcome: wait on, the timeout still counting)
            elif not self._process.is_alive() and not self._receive.poll():
                break  # gone without a word (belt and braces: the pipe should have said so)
            if deadline is not None and time.monotonic() >= deadline:
                self.kill()
                self._process.join()
                self._receive.close()
                return Outcome(error=TaskTimeout(f"killed after its {timeout:g}s timeout"))
        self._process.join()
        self._receive.close()
        if self.killed:
            return Outcome(error=GivenBack())
        if message is None:
            return Outcome(error=TaskProcessDied(_describe_exit(self._process.exitcode)))
        if message[0] == "ok":
            return Outcome(result=message[1])
        _, type_name, text, formatted = message
        return Outcome(error=TaskRaised(type_name, text, formatted), error_text=formatted)


def _child_main(
    send: Connection,
    func: Callable[..., Any],
    params: dict[str, Any],
    after_fork: Callable[[], None],
    parent: int,
) -> None:
    # A Ctrl+C or a service manager's SIGTERM reaches the whole process group;
    # the worker decides when its children stop (it kills them at the end of
    # its shutdown timeout), so the child ignores both.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, _cancelled_in_child)
    _die_with_parent(parent)
    after_fork()
    reports = _ProgressPipe(send)
    context = _current_or_none()
    if context is not None:
        context.send_progress_to(reports.report)
    try:
        result = _call(func, params)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, whatever it is
        outcome: tuple[Any, ...] = (
            "error",
            type(error).__qualname__,
            str(error),
            "".join(traceback.format_exception(error)),
        )
    else:
        outcome = ("ok", result)
    # A cancel now comes too late to stop anything, and its exception must
    # not cut the outcome's message in half.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with reports.closed():
        try:
            send.send(outcome)
        except Exception as error:  # noqa: BLE001 - an unpicklable result
            send.send(("error", type(error).__qualname__, f"result cannot be sent back: {error}", ""))
    send.close()


class _ProgressPipe:
    """A task process's progress reports, sent to its worker by a thread of their own, the last one winning.

    `report` only leaves the report and returns: the task is not held up by
    a full pipe, and SIGUSR1 (a cancel), which interrupts only the main
    thread, can never cut a message in half.  Reports left while one is
    being sent are coalesced (the worker writes only the last one anyway);
    the last report left is sent before the outcome.
    """

    def __init__(self, send: Connection) -> None:
        self._send = send
        self._lock = threading.Condition()
        self._sending = threading.Lock()  # one message on the pipe at a time, the outcome's included
        self._pending: tuple[float, Any] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def report(self, task: object, progress: float, note: Any) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending = (progress, note)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sa_taskqueue-progress", daemon=True)
                self._thread.start()
            self._lock.notify()

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """No report is left from now on; the last one not yet sent is, then the outcome, inside."""
        with self._lock:
            self._closed = True
            last, self._pending = self._pending, None
            self._lock.notify()
        with self._sending:
            if last is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._send.send((PROGRESS, *last))
            yield

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._pending is None and not self._closed:
                    self._lock.wait()
                pending, self._pending = self._pending, None
                if self._closed or pending is None:
                    return
                self._sending.acquire()
            try:
                self._send.send((PROGRESS, *pending))
            except (OSError, ValueError):
                return  # the worker has gone (the pipe is broken): no one to tell
            finally:
                self._sending.release()


_FORK_LOCK = threading.Lock()


def _cancelled_in_child(signum: int, frame: object) -> None:
    """SIGUSR1 in a task process: the task was cancelled; its context says so, and the run is interrupted."""
    context = _current_or_none()
    if context is not None:
        context.request_cancel()
    raise CancellationRequested(context.task_id if context is not None else 0)


def _current_or_none() -> TaskContext | None:
    try:
        return current_task()
    except RuntimeError:
        return None


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this child if the worker dies (Linux), so no task outlives its worker."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the lease covers a lost worker, a little later
    if os.getppid() != parent:  # the worker died before the guard was set
        os._exit(1)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the task's process vanished"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the task's process was killed by {name}"
    return f"the task's process exited with code {code} without reporting a result"
