"""What the metrics integrations share: which events they hear, and the figures each event gives.

`EventMetrics` subscribes to a queue's event stream and turns each event
into a call of one of its hooks, with the figures already worked out (the
outcome's name, the queue wait in seconds); `PrometheusMetrics` and
`OpenTelemetryMetrics` record them, each in its own library's instruments.
So the two report the same metrics, under the same names and labels.

Only the kinds a metric needs are subscribed, so the worker builds no event
for the others (`EventStream.wants`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy import Engine, Table

from sa_taskqueue.core.events import EventKind, EventStream, StatementEvent, TaskEvent

#: The outcome label of each kind of finished task.
OUTCOMES = {
    EventKind.SUCCEEDED: "succeeded",
    EventKind.FAILED: "failed",
    EventKind.RETRIED: "retried",
    EventKind.CANCELLED: "cancelled",
}
#: The kinds a metrics integration hears.  Not CLAIMED: a run's queue wait is heard with its outcome
#: (the claimed task's ``started_at - run_at``), which spares the worker an event a task.
HEARD_KINDS = (EventKind.ENQUEUED, *OUTCOMES, EventKind.STATEMENT)

#: Buckets in seconds: a task's run, from milliseconds to minutes.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: A task's wait from due to claimed, from milliseconds (a busy queue kept up with) to an hour behind.
WAIT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)
#: A claim or outcome statement: a fraction of a millisecond on a local database, seconds when it waits.
STATEMENT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ObservedQueue(Protocol):
    """What a metrics integration needs of a `TaskQueue`."""

    events: EventStream
    engine: Engine
    table: Table

    def clock(self) -> Any:
        """The queue's clock."""

    def run_sync(self, fn: Callable[[], Any], /) -> Any:
        """``fn()`` where the queue's engine may be used."""


class EventMetrics:
    """Hears a queue's events and calls the hook for each figure; subclasses record them.

    ``attach()`` subscribes (once), ``detach()`` unsubscribes; both return
    at once.  The hooks are called in the emitting thread: a worker's slot
    or writer thread, or the application's thread at an enqueue's commit.
    """

    def __init__(self, queue: ObservedQueue) -> None:
        self.queue = queue
        self._unsubscribe: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def attach(self) -> None:
        """Start hearing the queue's events."""
        with self._lock:
            if self._unsubscribe is None:
                events = self.queue.events
                # One subscriber a kind, so that no event is dispatched twice.
                unsubscribe = [
                    events.subscribe(self._hear_enqueued, [EventKind.ENQUEUED]),
                    events.subscribe(self._hear_finished, list(OUTCOMES)),
                    events.subscribe(self._hear_statement, [EventKind.STATEMENT]),
                ]

                def unsubscribe_all() -> None:
                    for each in unsubscribe:
                        each()

                self._unsubscribe = unsubscribe_all

    def detach(self) -> None:
        """Stop hearing them."""
        with self._lock:
            if self._unsubscribe is not None:
                self._unsubscribe()
                self._unsubscribe = None

    def _hear_enqueued(self, event: TaskEvent) -> None:
        self.enqueued(event.queue, event.task_name)

    def _hear_finished(self, event: TaskEvent) -> None:
        task = event.task
        if task is not None:
            # The wait of the run that ended, heard with its outcome: one event a task, not two.
            wait = (task.started_at - task.run_at).total_seconds()
            self.claimed(event.queue, event.task_name, wait if wait > 0.0 else 0.0)
        self.finished(event.queue, event.task_name, OUTCOMES[event.kind], event.duration)

    def _hear_statement(self, event: StatementEvent) -> None:
        self.statement(event.operation, event.seconds, event.error is None)

    # The hooks --------------------------------------------------------------

    def enqueued(self, queue: str, task: str) -> None:
        """A task was enqueued (its transaction committed)."""

    def claimed(self, queue: str, task: str, wait: float) -> None:
        """A run whose outcome is written was claimed ``wait`` seconds after its task was due."""

    def finished(self, queue: str, task: str, outcome: str, duration: float | None) -> None:
        """A task's outcome was written; ``duration`` is its run's, None for a cancel."""

    def statement(self, operation: str, seconds: float, ok: bool) -> None:
        """A claim or outcome statement returned after ``seconds`` (``ok``: without an error)."""


__all__ = [
    "DURATION_BUCKETS",
    "HEARD_KINDS",
    "OUTCOMES",
    "STATEMENT_BUCKETS",
    "WAIT_BUCKETS",
    "EventMetrics",
    "ObservedQueue",
]
