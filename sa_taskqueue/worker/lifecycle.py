"""The worker's side of the event stream: emitting its events, and its log lines and hooks as subscribers.

Every event is built only when `EventStream.wants` its kind, so a worker
nobody listens to pays one set lookup per fact.  The task lifecycle log
lines (started, done, failed, given back) and the ``on_start``,
``on_success`` and ``on_failure`` hooks are subscribers like any other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.error_text import error_message
from sa_taskqueue.core.events import EventKind, EventStream, StatementEvent, TaskEvent, WorkerEvent
from sa_taskqueue.core.log_fields import task_fields
from sa_taskqueue.core.redaction import Redactor
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.worker.slots import WorkerState, ids

logger = logging.getLogger("sa_taskqueue")

#: The kinds the log subscriber turns into lines, and the level of each line.
LOG_LEVELS = {
    EventKind.STARTED: logging.INFO,
    EventKind.SUCCEEDED: logging.INFO,
    EventKind.FAILED: logging.WARNING,
    EventKind.RETRIED: logging.WARNING,
    EventKind.GIVEN_BACK: logging.INFO,
}
LOGGED_KINDS = tuple(LOG_LEVELS)


# Which worker's event is being emitted on this thread: a worker's log lines
# and hooks hear only its own events (two workers of one process share a
# queue's stream, and a worker id).
_emitting = threading.local()


def emitted_by(state: WorkerState) -> bool:
    """Whether the event being heard on this thread was emitted by the worker whose state this is."""
    return getattr(_emitting, "state", None) is state


class Emitter:
    """Emits one worker's events on its queue's stream, each built only if someone listens."""

    def __init__(
        self, events: EventStream, state: WorkerState, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.events = events
        self.state = state
        #: What an event's ``at`` is read from: the queue's clock.
        self.clock = clock

    def task(self, kind: EventKind, task: ClaimedTask, **fields: Any) -> None:
        if self.events.wants(kind):
            self._emit(TaskEvent.of(kind, task, self.clock(), self.state.worker_id, **fields))

    def worker(
        self, kind: EventKind, *, service: str | None = None, error: BaseException | None = None
    ) -> None:
        if self.events.wants(kind):
            state = self.state
            event = WorkerEvent(
                kind, state.worker_id, self.clock(), len(state.running), service, error, state.counts()
            )
            self._emit(event)

    def statement(
        self, operation: str, sent_at: float, rows: int, error: BaseException | None = None
    ) -> None:
        """A claim or outcome statement sent at ``sent_at`` (``time.monotonic()``) has returned."""
        if self.events.wants(EventKind.STATEMENT):
            seconds = time.monotonic() - sent_at
            # (Heard by no hook of a worker's own: emitted without `emitted_by`'s bookkeeping.)
            self.events.emit(
                StatementEvent.of(operation, seconds, rows, self.clock(), self.state.worker_id, error)
            )

    def timed(self, operation: str, write: Callable[[], set[int]]) -> Callable[[], set[int]]:
        """``write`` (an outcome statement), its latency emitted if anyone listens; else ``write`` itself."""
        if not self.events.wants(EventKind.STATEMENT):
            return write

        def timed_write() -> set[int]:
            sent_at = time.monotonic()
            try:
                written = write()
            except BaseException as error:
                self.statement(operation, sent_at, 0, error)
                raise
            self.statement(operation, sent_at, len(written))
            return written

        return timed_write

    def _emit(self, event: TaskEvent | WorkerEvent | StatementEvent) -> None:
        before = getattr(_emitting, "state", None)
        _emitting.state = self.state
        try:
            self.events.emit(event)
        finally:
            _emitting.state = before


def subscribe_log(
    events: EventStream, state: WorkerState, redactor: Redactor | None = None
) -> Callable[[], None]:
    """Log this worker's task lifecycle lines from its events; returns the unsubscribe function.

    Subscribed only for the kinds whose lines the logger writes as the run
    starts, so that a worker whose task lines are off builds no event for
    them (each line is checked again as it is logged).  An error's text is
    scrubbed by ``redactor`` (the queue's database URL's secrets), as the
    stored ``last_error`` is.
    """

    def log_task_event(event: TaskEvent) -> None:
        if emitted_by(state):
            log_line(event, redactor)

    kinds = [kind for kind in LOGGED_KINDS if logger.isEnabledFor(LOG_LEVELS[kind])]
    if not kinds:
        return lambda: None
    return events.subscribe(log_task_event, kinds)


def log_line(event: TaskEvent, redactor: Redactor | None = None) -> None:
    """The task lifecycle log line of an event (its fields built only for a line logged)."""
    task = event.task
    if task is None or event.worker_id is None:
        return
    kind = event.kind
    if kind is EventKind.STARTED:
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "task %d %s attempt %d started",
                *ids(task),
                task.attempts,
                extra=task_fields(task, event.worker_id),
            )
    elif kind is EventKind.SUCCEEDED:
        if logger.isEnabledFor(logging.INFO):
            duration = event.duration or 0.0
            logger.info(
                "task %d %s attempt %d done in %.3fs",
                *ids(task),
                task.attempts,
                duration,
                extra=task_fields(task, event.worker_id, duration=duration),
            )
    elif kind is EventKind.FAILED or kind is EventKind.RETRIED:
        if logger.isEnabledFor(logging.WARNING):
            duration = event.duration or 0.0
            error = event.error
            text = error_message(error) if isinstance(error, BaseException) else str(error)
            if redactor is not None:
                text = redactor.text(text)
            logger.warning(
                "task %d %s attempt %d failed after %.3fs: %s",
                *ids(task),
                task.attempts,
                duration,
                text,
                extra=task_fields(task, event.worker_id, duration=duration, error=text),
            )
    elif kind is EventKind.GIVEN_BACK and logger.isEnabledFor(logging.INFO):
        # A run given back has a duration; a task that never started has none.
        how = "unstarted" if event.duration is None else "unfinished"
        logger.info("task %d %s attempt %d given back %s", *ids(task), task.attempts, how)


def call_hook(hook: Callable[..., None], *args: Any) -> None:
    """Call a user's hook; an exception in it is logged and ignored."""
    try:
        hook(*args)
    except Exception:
        logger.exception("the %s hook raised", getattr(hook, "__name__", "worker"))


def subscribe_hooks(
    events: EventStream,
    state: WorkerState,
    on_start: Callable[[ClaimedTask], None] | None,
    on_success: Callable[[ClaimedTask, Any], None] | None,
    on_failure: Callable[[ClaimedTask, BaseException], None] | None,
) -> list[Callable[[], None]]:
    """Subscribe the hooks to this worker's own task events; returns their unsubscribe functions.

    The worker emits STARTED before the run, SUCCEEDED once the success is
    written and FAILED or RETRIED once the failure is, each in the task's
    own thread when a hook is set: so each hook is called where and when it
    always was.
    """
    unsubscribe: list[Callable[[], None]] = []

    def own(event: TaskEvent) -> bool:
        return emitted_by(state)

    if on_start is not None:
        start_hook = on_start

        def started(event: TaskEvent) -> None:
            if own(event):
                assert event.task is not None
                call_hook(start_hook, event.task)

        unsubscribe.append(events.subscribe(started, [EventKind.STARTED]))
    if on_success is not None:
        success_hook = on_success

        def succeeded(event: TaskEvent) -> None:
            if own(event):
                assert event.task is not None
                call_hook(success_hook, event.task, event.result)

        unsubscribe.append(events.subscribe(succeeded, [EventKind.SUCCEEDED]))
    if on_failure is not None:
        failure_hook = on_failure

        def failed(event: TaskEvent) -> None:
            if own(event):
                assert event.task is not None
                call_hook(failure_hook, event.task, event.error)

        unsubscribe.append(events.subscribe(failed, [EventKind.FAILED, EventKind.RETRIED]))
    return unsubscribe


__all__ = [
    "LOGGED_KINDS",
    "LOG_LEVELS",
    "Emitter",
    "call_hook",
    "emitted_by",
    "log_line",
    "subscribe_hooks",
    "subscribe_log",
]
