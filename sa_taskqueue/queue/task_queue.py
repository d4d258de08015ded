"""`TaskQueue`: enqueue, claim, complete, fail, cancel.  The only caller of the claim strategies."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast, overload
from zoneinfo import ZoneInfo

from sqlalchemy import URL, Engine, Table
from sqlalchemy.orm import Session, sessionmaker

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.concurrency import KeySpec
from sa_taskqueue.core.event_loop_bridge import asyncio_extension
from sa_taskqueue.core.events import EventStream
from sa_taskqueue.core.exceptions import FootingReport
from sa_taskqueue.core.model import Task, TaskMixin, TaskStatus
from sa_taskqueue.core.registered import DEFAULT_RETRY_DELAY, RegisteredTask
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features import retention as retention_rows
from sa_taskqueue.features.concurrency import ConcurrencyClaims
from sa_taskqueue.features.live_workers import LiveWorkers
from sa_taskqueue.features.pausing import QueuePauses
from sa_taskqueue.features.results import DEFAULT_POLL_INTERVAL, Results
from sa_taskqueue.features.retention import Retention
from sa_taskqueue.features.schedules import EnqueuedSlot, PeriodicTask, Schedule, Schedules
from sa_taskqueue.health import HealthThresholds, TableHealth, measure_table_health
from sa_taskqueue.health.self_test import check_footing
from sa_taskqueue.queue.attached import run_attached
from sa_taskqueue.queue.batching import BatchOperations
from sa_taskqueue.queue.cancelling import RunningTaskControl
from sa_taskqueue.queue.claiming import Claims
from sa_taskqueue.queue.claims_and_outcomes import ClaimsAndOutcomes
from sa_taskqueue.queue.enqueue_methods import EnqueueMethods
from sa_taskqueue.queue.enqueuing import Enqueuing
from sa_taskqueue.queue.live import LiveWorkersListing
from sa_taskqueue.queue.outcomes import Outcomes
from sa_taskqueue.queue.parts import QueueParts
from sa_taskqueue.queue.registrations import Registrations
from sa_taskqueue.strategies import registry
from sa_taskqueue.strategies.base import ClaimStrategy

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

    from sa_taskqueue.worker.worker import Worker

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


logger = logging.getLogger("sa_taskqueue")

DEFAULT_LEASE = timedelta(minutes=5)
DEFAULT_MAX_RETRY_DELAY = timedelta(hours=1)


class TaskQueue(EnqueueMethods, ClaimsAndOutcomes, LiveWorkersListing, RunningTaskControl, BatchOperations):
    """A task queue on one table of one database.

    ``bind`` is an `Engine` or a `sessionmaker` bound to one, or an
    `AsyncEngine` or an `async_sessionmaker` bound to one.  With an async
    engine, ``engine`` is its ``sync_engine``, and every database call of the
    queue runs in a greenlet on the event loop that owns the engine's
    connections (see `sa_taskqueue.core.event_loop_bridge`): the same strategies,
    and the same thread-based `Worker`, serve both kinds.  The claim
    strategy is picked from the dialect and server version on first use,
    unless ``strategy`` names one (``"skip_locked"``, ``"conditional_update"``,
    ``"advisory_lock"``) or is a `ClaimStrategy` instance.  ``lease`` is how
    long a claim holds a task before another worker may take it again; a
    running worker renews it.  ``clock`` returns the current time as an aware
    datetime (UTC by default); every time the queue writes or compares is read
    from it.

    The queue validates what it is given, resolves the strategy and turns
    database errors into `TaskQueueError` subclasses; the SQL is the
    strategy's, and what differs between databases is the backend's.
    """

    def __init__(
        self,
        bind: Engine | sessionmaker[Session] | AsyncEngine | async_sessionmaker[AsyncSession],
        *,
        model: type[TaskMixin] = Task,
        strategy: str | ClaimStrategy | None = None,
        lease: timedelta = DEFAULT_LEASE,
        max_retry_delay: timedelta = DEFAULT_MAX_RETRY_DELAY,
        clock: Callable[[], datetime] = utcnow,
        retention: Mapping[str | TaskStatus, timedelta] | None = None,
        retention_interval: timedelta | None = None,
    ) -> None:
        engine, is_async = _engine_of(bind)
        self.model = model
        table = getattr(model, "__table__", None)
        if not isinstance(table, Table):
            raise TypeError(f"model must be a mapped TaskMixin class, got {model!r}")
        if not isinstance(lease, timedelta) or lease <= timedelta(0):
            raise ValueError(f"lease must be a positive timedelta, got {lease!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning an aware datetime, got {clock!r}")
        sample = clock()
        if not isinstance(sample, datetime) or sample.utcoffset() is None:
            raise TypeError(f"clock must return an aware datetime, got {sample!r}")
        #: What every part and feature of the queue shares (`sa_taskqueue.features.ports.QueueContext`).
        self._parts = parts = QueueParts(
            engine, is_async=is_async, table=table, clock=clock, lease=lease, strategy=strategy
        )
        self.engine = engine
        self.table: Table = table
        #: How long a claim holds a task before another worker may take it again.
        self.lease = lease
        #: What the queue reads the time from: run_at, leases, retries and recovery all follow it.
        self.clock = clock
        self.max_retry_delay = max_retry_delay
        self._tasks: dict[str, RegisteredTask[Any, Any]] = {}
        self._async_worker_running = False
        # The features, each owning its state: what the queue's methods hand their work to.
        self._retention = Retention(parts, retention, retention_interval)
        if strategy is not None:
            registry.check_requested(strategy, engine.dialect)
        self._pauses = QueuePauses(parts)
        self._concurrency = ConcurrencyClaims(parts, self._tasks)
        self._schedules = Schedules(parts, self._periodic_values)
        self._results = Results(parts)
        self.live_workers = LiveWorkers(parts)
        #: The lifecycle events of this queue's tasks and workers in this process: subscribe here.
        self.events = EventStream()
        self._enqueuing = Enqueuing(parts, model, self._tasks, self.events)
        self._claims = Claims(parts, self._pauses, self._concurrency, lambda: self.recover())
        self._outcomes = Outcomes(parts, self._tasks, lambda: self.max_retry_delay)
        self._registrations = Registrations(self, parts, self._tasks, self._concurrency, self._schedules)
        #: How long finished tasks are kept, per status; workers delete older ones (`features.retention`).
        self.retention = self._retention.ages
        #: How often a worker looks for expired tasks: by default a tenth of the shortest age.
        self.retention_interval = self._retention.interval
        #: The paused queues as last read: what claims leave out (`sa_taskqueue.features.pausing`).
        self.paused = self._pauses.kept
        #: Wakes `result` waiters when their task finishes (PostgreSQL); started by the first wait.
        self.finished_listener = self._results.listener
        backend_for(engine.dialect).configure_engine(engine)

    # Strategy --------------------------------------------------------------

    @property
    def strategy(self) -> ClaimStrategy:
        """The claim strategy in use; resolved (connecting once if needed) on first access."""
        return self._parts.strategy

    @property
    def is_async(self) -> bool:
        """Whether the queue was given an async engine (its database calls then run on that engine's loop)."""
        return self._parts.is_async

    # Registration ----------------------------------------------------------

    @overload
    def task(self, name: Callable[P, R], /) -> RegisteredTask[P, R]: ...

    @overload
    def task(
        self,
        name: str | None = None,
        *,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 3,
        retry_delay: timedelta = DEFAULT_RETRY_DELAY,
        timeout: timedelta | float | None = None,
        concurrency_limit: int | None = None,
        concurrency_key: KeySpec = None,
        unique_by: Sequence[str] | None = None,
        transactional: bool = False,
        rate_limit: str | Sequence[str] | None = None,
        rate_key: KeySpec = None,
    ) -> Callable[[Callable[P, R]], RegisteredTask[P, R]]: ...

    def task(
        self,
        name: str | Callable[P, R] | None = None,
        *,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 3,
        retry_delay: timedelta = DEFAULT_RETRY_DELAY,
        timeout: timedelta | float | None = None,
        concurrency_limit: int | None = None,
        concurrency_key: KeySpec = None,
        unique_by: Sequence[str] | None = None,
        transactional: bool = False,
        rate_limit: str | Sequence[str] | None = None,
        rate_key: KeySpec = None,
    ) -> RegisteredTask[P, R] | Callable[[Callable[P, R]], RegisteredTask[P, R]]:
        """Register a function as a task; usable as ``@queue.task`` or ``@queue.task("name", ...)``.

        The name defaults to ``module.qualname``.  Registering a second
        function under a taken name is an error: rows would run the wrong code.

        ``concurrency_limit=N`` lets at most N runs sharing a concurrency key
        run at once, across every worker: the key is the task's name, or
        ``concurrency_key`` names the params (one, or a tuple) whose values
        make it, or is a function of the params returning a string.
        ``rate_limit="100/s"``: at most N starts in any window, per ``rate_key`` made the same way.

        ``unique_by`` names params whose values make each enqueue's unique
        key (`sa_taskqueue.features.unique.derive_key`): while a task with the same
        values is queued or running, another enqueue returns it instead.

        ``transactional=True``: the function takes a session as its first
        parameter (a `Session`, or an `AsyncSession` for an ``async def`` on
        a queue on an `AsyncEngine`), which the worker opens on the queue's
        engine; what the task writes through it commits in one transaction
        with its completion, or not at all (`sa_taskqueue.features.transactional`).
        Params never include the session.
        """
        if callable(name):
            return self.task()(name)
        return self._registrations.decorator(
            name,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            retry_delay=retry_delay,
            timeout=timeout,
            concurrency_limit=concurrency_limit,
            concurrency_key=concurrency_key,
            unique_by=unique_by,
            transactional=transactional,
            rate_limit=rate_limit,
            rate_key=rate_key,
        )

    def periodic(
        self,
        cron: str | None = None,
        *,
        every: timedelta | None = None,
        tz: str | ZoneInfo = "UTC",
        params: dict[str, Any] | None = None,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 3,
        retry_delay: timedelta = DEFAULT_RETRY_DELAY,
        timeout: timedelta | float | None = None,
        concurrency_limit: int | None = None,
        concurrency_key: KeySpec = None,
    ) -> Callable[[Callable[P, R]], RegisteredTask[P, R]]:
        """Register a task run on a schedule: ``@queue.periodic("*/5 * * * *", tz="Europe/Paris")``.

        ``concurrency_limit=1`` keeps a run that outlasts its interval from
        overlapping the next slot's (each slot is a task of its own).

        Exactly one of ``cron`` (a cron expression read in ``tz``, an IANA
        name or a `ZoneInfo`) and ``every`` (a fixed interval, its slots
        counted from the Unix epoch).  Each slot is enqueued once, by
        whichever worker gets there first, with ``params``; the task is an
        ordinary one otherwise (the other options are `task`'s).  Everything is
        checked here, when the module is imported.  See `sa_taskqueue.features.schedules`.
        """
        schedule = Schedule.of(cron, every, tz)
        register = self.task(
            name,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            retry_delay=retry_delay,
            timeout=timeout,
            concurrency_limit=concurrency_limit,
            concurrency_key=concurrency_key,
        )
        return self._registrations.periodic_decorator(schedule, params, register)

    @property
    def periodic_tasks(self) -> list[PeriodicTask]:
        """The periodic tasks registered with this queue, by name."""
        return self._schedules.tasks

    def enqueue_due_schedules(self) -> list[EnqueuedSlot]:
        """Enqueue each periodic task's latest due slot that no one enqueued yet; return what this call did.

        Workers call it on their own at every slot and every poll interval;
        a cron job or a test may call it too.  However many processes call it
        at once, each slot is enqueued once (see `sa_taskqueue.features.schedules`).
        """
        return self._schedules.enqueue_due()

    def _periodic_values(self, name: str, params: dict[str, Any], run_at: datetime) -> dict[str, Any]:
        return self._enqueuing.task_values(name, params, None, None, run_at, None)

    def registered(self, name: str) -> RegisteredTask[Any, Any] | None:
        """The task registered under ``name`` in this process, or None."""
        return self._tasks.get(name)

    @property
    def task_names(self) -> list[str]:
        """The names of every task registered with this queue, sorted."""
        return sorted(self._tasks)

    def explain_claim(self, *, limit: int = 10, queues: Sequence[str] | None = None) -> str:
        """The database's plan for the statement a claim runs to find its rows (nothing is claimed).

        For checking that the claim walks its index, however many finished
        rows the table holds.
        """
        return self._claims.explain(limit, queues)

    def table_health(
        self, *, now: datetime | None = None, thresholds: HealthThresholds | None = None
    ) -> TableHealth:
        """What slows this queue's table now, for monitoring: figures, findings with advice, and ``ok``.

        Dead row versions and the transactions holding back their cleanup on
        PostgreSQL, InnoDB's history list and oldest transactions on MySQL
        and MariaDB, the WAL file on SQLite (`sa_taskqueue.health`).  Ages
        are counted to ``now``, by default the queue's clock; ``thresholds``
        replaces the default limits for this call.  Nothing is written.
        """
        moment = self.clock() if now is None else now
        with self._parts.database_errors():
            return self._parts.call(
                lambda: measure_table_health(self.engine, self.table, now=moment, thresholds=thresholds)
            )

    # Results ---------------------------------------------------------------

    def result(
        self,
        task_id: int,
        timeout: timedelta | float | None = None,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
    ) -> Any:
        """Wait until task ``task_id`` is finished and return its result, as stored (JSON).

        Raises `TaskFailed` (with the task's ``last_error``) if it failed for
        good, `TaskCancelled` if it was cancelled, `TaskNotFound` if there is
        no such task (or retention deleted it), and `ResultTimeout` (a
        `TimeoutError`) if it has not finished after ``timeout`` seconds;
        None waits for ever.  A task queued again to retry is not finished.
        On PostgreSQL a notification sent when the task finishes wakes the
        wait at once, and the row is read again every ``poll_interval``
        seconds in case one is lost; elsewhere the reads back off from a few
        milliseconds up to ``poll_interval`` (`sa_taskqueue.features.results`).
        """
        return self._results.wait(task_id, timeout, poll_interval)

    async def result_async(
        self,
        task_id: int,
        timeout: timedelta | float | None = None,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
    ) -> Any:
        """`result` for a coroutine: the wait and the reads never block the running event loop.

        On an async engine each read runs on the loop that owns the engine's
        connections; on a sync engine, in a thread.
        """
        return await self._results.wait_async(task_id, timeout, poll_interval)

    # Paused queues ---------------------------------------------------------

    def pause(self, name: str) -> None:
        """Stop every worker claiming tasks of queue ``name`` until `resume`; tasks running go on.

        Stored in the database and committed at once, so it holds for every
        worker of this table on every machine: each honours it within a
        second or its poll interval (at once on PostgreSQL, notified at
        commit).  Pausing a paused queue changes nothing.
        """
        self._pauses.set(name, paused=True)

    def resume(self, name: str) -> None:
        """Let workers claim tasks of queue ``name`` again; resuming a queue not paused changes nothing."""
        self._pauses.set(name, paused=False)

    def paused_queues(self) -> list[str]:
        """The queues paused now, sorted, read from the database."""
        return self._pauses.read()

    # Retention -------------------------------------------------------------

    def delete_expired(
        self,
        *,
        batch_size: int = retention_rows.DEFAULT_BATCH_SIZE,
        holder: str | None = None,
        stop: threading.Event | None = None,
        queues: Sequence[str] | None = None,
    ) -> int:
        """Delete finished tasks older than ``retention`` says, in batches; return how many.

        What workers run every ``retention_interval``, on the queues each
        serves; a test or a cron job may call it too.  Given ``queues``, only
        tasks of those queues are deleted (None: of every queue in the
        table).  One caller at a time deletes (a lease in the control
        table): while another holds it this returns 0 at once.
        ``finished_at`` is compared with the queue's clock.  Each batch of at
        most ``batch_size`` rows commits on its own.
        """
        return self._retention.delete_expired(batch_size=batch_size, holder=holder, stop=stop, queues=queues)

    # Worker ----------------------------------------------------------------

    def run_worker(
        self,
        *,
        concurrency: int = 1,
        queues: Sequence[str] | None = None,
        burst: bool = False,
        poll_interval: float = 1.0,
        **options: Any,
    ) -> Worker:
        """Run a `Worker` in this thread until stopped (or, with ``burst``, until nothing is due).

        ``options`` are the rest of `Worker`'s arguments (``isolation``,
        ``shutdown_timeout``, ``on_start``, ...).
        """
        from sa_taskqueue.worker.worker import Worker

        worker = Worker(
            self, concurrency=concurrency, queues=queues, burst=burst, poll_interval=poll_interval, **options
        )
        worker.run()
        return worker

    async def run_worker_async(
        self,
        *,
        concurrency: int = 1,
        queues: Sequence[str] | None = None,
        burst: bool = False,
        poll_interval: float = 1.0,
        **options: Any,
    ) -> Worker:
        """Run a `Worker` from inside a running event loop (a FastAPI lifespan) without blocking it.

        The worker's claim loop, slots and heartbeat run in threads, as with
        `run_worker`; the loop stays free.  With an async engine the queue's
        database calls, and ``async def`` tasks, run on this loop for as long
        as the worker runs, so tasks share the application's engine and its
        connections.  With a sync engine, ``async def`` tasks run on this loop
        too.  Cancelling the awaiting task stops the worker gracefully, like
        `Worker.stop`: no more claims, running tasks get ``shutdown_timeout``
        seconds to finish, the rest are given back; the cancellation is
        re-raised once that is done.  Returns the worker once it has stopped
        (with ``burst``, once nothing is due).  Signals are left to the
        application.  ``options`` are the rest of `Worker`'s arguments.
        """
        from sa_taskqueue.worker.worker import Worker

        loop = asyncio.get_running_loop()
        options.setdefault("event_loop", loop)
        worker = Worker(
            self, concurrency=concurrency, queues=queues, burst=burst, poll_interval=poll_interval, **options
        )
        # The start and the end of this call close the connections the strategy keeps, advisory
        # locks included: a second worker of this queue object running meanwhile would lose its
        # locks, and its tasks could run twice.  (Set before the first await: no two calls pass.)
        if self._async_worker_running:
            raise RuntimeError(
                "this TaskQueue already runs a worker through run_worker_async: raise its concurrency, "
                "or give the second worker a TaskQueue of its own (on the same engine if you like)"
            )
        self._async_worker_running = True
        try:
            await run_attached(worker, loop, self._parts.bridge, self.close, self._parts.close_strategy_async)
        finally:
            self._async_worker_running = False
        return worker

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop an async engine's calls run on: ``run_worker_async``'s while it runs, else its own.

        Raises `TypeError` for a queue on a sync engine, which needs none.
        """
        if not self.is_async:
            raise TypeError("a TaskQueue on a sync Engine runs its database calls in the calling thread")
        return self._parts.bridge.loop()

    def check_footing(self, *, listen: bool = True, second_node: str | URL | None = None) -> FootingReport:
        """The self-test a worker runs at start (`health.self_test`), for ``doctor`` and monitoring.

        Proves on two connections of its own that what the strategy relies on
        holds through this engine's URL (SKIP LOCKED honoured, advisory locks
        kept per session, one winner of a compare-and-set) and, with
        ``listen``, that a NOTIFY reaches a LISTENing connection.  On a node
        of a MariaDB Galera cluster, ``second_node`` (another node's URL)
        proves a claim's exclusivity across the two nodes; without it, the
        report says what one node cannot prove.  Returns the checks;
        `FootingReport.raise_if_failed` turns failures into a `FootingError`.
        """
        return check_footing(self._parts, listen=listen, second_node=second_node)

    def close(self) -> None:
        """Release what the strategy holds: its kept connections and any advisory locks.

        The connection listening for finished tasks is closed too (a later wait opens it again).
        """
        self.finished_listener.close()
        strategy = self._parts.resolved_strategy
        if strategy is not None:
            self._parts.call(strategy.close)

    def run_sync(self, fn: Callable[[], T], /) -> T:
        """``fn()``, where this queue's ``engine`` may be used: for your own admin or maintenance queries.

        A queue on a sync Engine calls it here.  On an AsyncEngine, ``engine``
        is its sync_engine, which works only inside SQLAlchemy's greenlet on
        the engine's event loop (elsewhere: MissingGreenlet); this runs ``fn``
        there and waits for it.  Call it from outside that loop (from the
        loop, ``await asyncio.to_thread(queue.run_sync, fn)``).
        """
        return self._parts.call(fn)


def _engine_of(bind: object) -> tuple[Engine, bool]:
    """The synchronous engine the strategies run on, and whether it belongs to an `AsyncEngine`."""
    if isinstance(bind, Engine):
        return bind, False
    ext = asyncio_extension()  # None: no async object can exist, nothing imported it
    if ext is not None and isinstance(bind, ext.AsyncEngine):
        return bind.sync_engine, True
    makers: tuple[type, ...] = (sessionmaker,) if ext is None else (sessionmaker, ext.async_sessionmaker)
    if isinstance(bind, makers):
        engine = cast("Any", bind).kw.get("bind")
        if isinstance(engine, Engine):
            return engine, False
        if ext is not None and isinstance(engine, ext.AsyncEngine):
            return engine.sync_engine, True
        raise TypeError(f"the {type(bind).__name__} passed as bind is not bound to an engine")
    raise TypeError(
        "bind must be an Engine, an AsyncEngine, or a sessionmaker or async_sessionmaker bound to one, "
        f"got {type(bind).__name__}"
    )
