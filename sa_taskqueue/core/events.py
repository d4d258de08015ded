"""One typed stream of lifecycle events: what logs, hooks, metrics, traces and dashboards subscribe to.

Each fact is emitted once, where it becomes true: a task's success after
the commit that records it, a retry after the write that queues it again,
an enqueue after the application's commit.  Subscribers are called in the
emitting thread, in the order they subscribed; one that raises is logged
and the others still hear the event, so a broken metrics exporter never
stops a worker.

An event nobody listens to costs one set lookup: emitting code asks
`EventStream.wants` before it builds an event, and a stream with no
subscriber for a kind builds nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from sa_taskqueue.core.claimed import ClaimedTask

logger = logging.getLogger("sa_taskqueue")


class EventKind(StrEnum):
    """What happened.  Task events carry a `TaskEvent`, the others a `WorkerEvent`."""

    #: A task written by the queue's enqueue, after the application's transaction committed it.
    #: (A row an application adds itself, ``session.add(Task(...))``, is not the queue's to announce.)
    ENQUEUED = "enqueued"
    #: A worker holds the task's lease (the claim committed); it has not started yet.
    CLAIMED = "claimed"
    #: The task's function is about to be called.
    STARTED = "started"
    #: The task's success is written: it will not run again.
    SUCCEEDED = "succeeded"
    #: The task's failure is written and no attempt is left (or retry was refused).
    FAILED = "failed"
    #: The task's failure is written and it is queued again for a later attempt.
    RETRIED = "retried"
    #: The task was cancelled before it ran (`TaskQueue.cancel`), after that commit.
    CANCELLED = "cancelled"
    #: The worker's lease on a running task ended or was taken over: the outcome is not its to write.
    LEASE_LOST = "lease_lost"
    #: A task claimed or running was queued again at shutdown, its attempt not counted.
    GIVEN_BACK = "given_back"
    #: A worker passed its self-test and begins to claim.
    WORKER_STARTED = "worker_started"
    #: A worker returned from `Worker.run`.
    WORKER_STOPPED = "worker_stopped"
    #: A worker renewed the leases of the tasks it runs.
    WORKER_HEARTBEAT = "worker_heartbeat"
    #: A background service of a worker (retention, schedules, LISTEN, lease renewal) or its database failed.
    SERVICE_ERROR = "service_error"
    #: A queue's enqueue is about to write its tasks (an `EnqueueEvent`): subscribers may add the
    #: ``headers`` the tasks carry (a trace context), and hear of the write's end.
    ENQUEUING = "enqueuing"
    #: A worker's claim or outcome statement returned (a `StatementEvent`): its operation and latency.
    STATEMENT = "statement"


TASK_EVENTS = frozenset(
    {
        EventKind.ENQUEUED,
        EventKind.CLAIMED,
        EventKind.STARTED,
        EventKind.SUCCEEDED,
        EventKind.FAILED,
        EventKind.RETRIED,
        EventKind.CANCELLED,
        EventKind.LEASE_LOST,
        EventKind.GIVEN_BACK,
    }
)


@dataclass(frozen=True)
class TaskEvent:
    """A fact about one task.

    ``task`` is the claimed task for the events a worker emits (its params,
    attempt and lease), None for an enqueue or a cancel, which know only the
    row's fields.  ``duration`` is the run's wall time in seconds, from its
    start to its outcome; ``error`` the failure's exception, or its text when
    the exception is not at hand; ``result`` a success's return value.
    """

    kind: EventKind
    #: None only for an ``enqueue_many`` on a database that returns no ids from it (MySQL, MariaDB).
    task_id: int | None
    task_name: str
    queue: str
    attempt: int
    at: datetime
    worker_id: str | None = None
    task: ClaimedTask | None = None
    duration: float | None = None
    result: Any = None
    error: BaseException | str | None = None

    @classmethod
    def of(cls, kind: EventKind, task: ClaimedTask, at: datetime, worker_id: str, **fields: Any) -> TaskEvent:
        """The event ``kind`` of a task a worker holds."""
        if cls is not TaskEvent or not fields.keys() <= _OPTIONAL_FIELDS:
            return cls(kind, task.id, task.name, task.queue, task.attempts, at, worker_id, task, **fields)
        # A frozen dataclass's __init__ sets each field through object.__setattr__: about 2.5 µs
        # for these eleven, paid for every event a worker emits while anyone listens.  The
        # instance __init__ would build is built here directly, as `ClaimedTask.from_row` does.
        event = object.__new__(cls)
        event.__dict__.update(
            kind=kind,
            task_id=task.id,
            task_name=task.name,
            queue=task.queue,
            attempt=task.attempts,
            at=at,
            worker_id=worker_id,
            task=task,
            duration=fields.get("duration"),
            result=fields.get("result"),
            error=fields.get("error"),
        )
        return event


_OPTIONAL_FIELDS = frozenset({"duration", "result", "error"})


@dataclass(frozen=True, slots=True)
class WorkerEvent:
    """A fact about one worker: started, stopped, a heartbeat, or a service's error."""

    kind: EventKind
    worker_id: str
    at: datetime
    #: Tasks the worker held when the event happened.
    running: int = 0
    #: For a service error: which service ("retention", "schedules", "listen", "heartbeat", "claim").
    service: str | None = None
    error: BaseException | None = None
    #: Counters at the event: tasks done, failed and given back since the worker started.
    counts: dict[str, int] = field(default_factory=dict)


#: What an enqueue's subscribers hear when its rows are in the session: their ids (None where the
#: database returns none), or the error that stopped the write.
Written = Callable[[Sequence[int | None] | None, BaseException | None], None]


@dataclass(frozen=True, slots=True)
class EnqueueEvent:
    """An enqueue about to write ``count`` tasks of one name to one queue (`EventKind.ENQUEUING`).

    Emitted before the rows are built into the session, so that a
    subscriber may add to ``headers``: what the tasks carry beside their
    params, stored in their ``headers`` column (a tracer puts the enqueuing
    code's trace context there).  A subscriber that wants to know how the
    write ended appends a `Written` callback to ``written``; each is called
    once, with the tasks' ids, or with the error that stopped the write.
    (The tasks exist only once the caller commits: ``ENQUEUED`` says so.)
    """

    kind: EventKind
    task_name: str
    queue: str
    count: int
    at: datetime
    headers: dict[str, str] = field(default_factory=dict)
    written: list[Written] = field(default_factory=list)


@dataclass(frozen=True)
class StatementEvent:
    """One claim or outcome statement a worker sent (`EventKind.STATEMENT`).

    ``operation`` is ``"claim"``, ``"complete"``, ``"fail"`` or
    ``"complete_and_claim"`` (a completion and the next claim committed
    together); ``seconds`` its latency, from sending to its rows back, as
    the worker measured it; ``rows`` how many tasks it claimed or wrote;
    ``error`` what it raised, if it did.
    """

    kind: EventKind
    operation: str
    seconds: float
    rows: int
    at: datetime
    worker_id: str
    error: BaseException | None = None

    @classmethod
    def of(
        cls,
        operation: str,
        seconds: float,
        rows: int,
        at: datetime,
        worker_id: str,
        error: BaseException | None,
    ) -> StatementEvent:
        """A ``STATEMENT`` event, built without the frozen __init__'s cost (as `TaskEvent.of`)."""
        event = object.__new__(cls)
        event.__dict__.update(
            kind=EventKind.STATEMENT,
            operation=operation,
            seconds=seconds,
            rows=rows,
            at=at,
            worker_id=worker_id,
            error=error,
        )
        return event


Event = TaskEvent | WorkerEvent | EnqueueEvent | StatementEvent
Subscriber = Callable[[Any], None]


class EventStream:
    """Where events are emitted and heard.  Every `TaskQueue` has one, ``queue.events``.

    ``subscribe(callback, kinds)`` calls ``callback(event)`` for each event
    of those kinds (every kind when none are named) and returns a function
    that unsubscribes it.  Safe to use from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Copied on write: emitting reads the current tuple without a lock.
        self._by_kind: dict[EventKind, tuple[Subscriber, ...]] = {}

    def wants(self, kind: EventKind) -> bool:
        """Whether anyone listens for ``kind``: ask before building an event."""
        return kind in self._by_kind

    def subscribe(self, callback: Subscriber, kinds: Iterable[EventKind] | None = None) -> Callable[[], None]:
        """Hear ``kinds`` (every kind when None); returns the unsubscribe function."""
        chosen = tuple(EventKind) if kinds is None else tuple(EventKind(kind) for kind in kinds)
        with self._lock:
            for kind in chosen:
                self._by_kind[kind] = (*self._by_kind.get(kind, ()), callback)

        def unsubscribe() -> None:
            with self._lock:
                for kind in chosen:
                    left = tuple(s for s in self._by_kind.get(kind, ()) if s is not callback)
                    if left:
                        self._by_kind[kind] = left
                    else:
                        self._by_kind.pop(kind, None)

        return unsubscribe

    def emit(self, event: Event) -> None:
        """Call each subscriber of the event's kind; one that raises is logged and the rest still run."""
        for subscriber in self._by_kind.get(event.kind, ()):
            try:
                subscriber(event)
            except Exception:
                name = getattr(subscriber, "__name__", subscriber)
                logger.exception("an event subscriber (%s) raised", name)


__all__ = [
    "TASK_EVENTS",
    "EnqueueEvent",
    "Event",
    "EventKind",
    "EventStream",
    "StatementEvent",
    "Subscriber",
    "TaskEvent",
    "WorkerEvent",
    "Written",
]
