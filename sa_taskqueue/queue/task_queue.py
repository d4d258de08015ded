"""`TaskQueue`: enqueue, claim, complete, fail, cancel.  The only caller of the claim strategies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeGuard, TypeVar, cast, overload
from zoneinfo import ZoneInfo

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core import validation
from sa_taskqueue.core.bulk_insert import insert_rows
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.claimed_params import decode_params, json_loads
from sa_taskqueue.core.concurrency import ConcurrencyLimit, KeySpec, fitted
from sa_taskqueue.core.error_text import format_error
from sa_taskqueue.core.event_loop_bridge import EventLoopBridge, asyncio_extension
from sa_taskqueue.core.events import EventStream
from sa_taskqueue.core.exceptions import translate_database_errors
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.model import Task, TaskMixin, TaskStatus
from sa_taskqueue.core.notify import notify_enqueued
from sa_taskqueue.core.registered import (
    DEFAULT_RETRY_DELAY,
    RegisteredTask,
    TaskOptions,
    retry_delay,
    signature_to_check,
)
from sa_taskqueue.core.task_rows import TaskRows
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.core.unawaited import EnqueueCoroutine
from sa_taskqueue.features import retention as retention_rows
from sa_taskqueue.features import unique
from sa_taskqueue.features.admin import cancel_queued
from sa_taskqueue.features.pausing import PausedQueues, read_paused, set_paused
from sa_taskqueue.features.results import (
    DEFAULT_POLL_INTERVAL,
    FinishedListener,
    TaskOutcome,
    poll_seconds,
    read_outcome,
    wait_for_result,
    wait_for_result_async,
    wait_seconds,
)
from sa_taskqueue.features.schedules import EnqueuedSlot, PeriodicTask, Schedule, enqueue_due
from sa_taskqueue.features.transactional import check_transactional
from sa_taskqueue.health import HealthThresholds, TableHealth, measure_table_health
from sa_taskqueue.health.explain import explain
from sa_taskqueue.health.self_test import FootingReport, check_footing
from sa_taskqueue.strategies import registry
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.lease import LEASE_EXPIRED_ERROR
from sa_taskqueue.strategies.limited import Limits

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_scoped_session, async_sessionmaker

    from sa_taskqueue.worker.worker import Worker

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


logger = logging.getLogger("sa_taskqueue")

DEFAULT_LEASE = timedelta(minutes=5)
DEFAULT_MAX_RETRY_DELAY = timedelta(hours=1)


class TaskQueue:
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
        self.engine, is_async = _engine_of(bind)
        #: Where the database calls run: here for a sync engine, on the engine's loop for an async one.
        self._bridge = EventLoopBridge(self.engine, is_async=is_async)
        self.model = model
        table = getattr(model, "__table__", None)
        if not isinstance(table, Table):
            raise TypeError(f"model must be a mapped TaskMixin class, got {model!r}")
        self.table: Table = table
        #: What the table's columns hold: every enqueue is checked against it.
        self._limits = ColumnLimits.of(table)
        if not isinstance(lease, timedelta) or lease <= timedelta(0):
            raise ValueError(f"lease must be a positive timedelta, got {lease!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning an aware datetime, got {clock!r}")
        sample = clock()
        if not isinstance(sample, datetime) or sample.utcoffset() is None:
            raise TypeError(f"clock must return an aware datetime, got {sample!r}")
        #: How long finished tasks are kept, per status; workers delete older ones (`features.retention`).
        self.retention = retention_rows.check_retention({} if retention is None else retention)
        #: How often a worker looks for expired tasks: by default a tenth of the shortest age.
        self.retention_interval: timedelta | None = None
        if retention_interval is not None:
            self.retention_interval = retention_rows.check_interval(retention_interval)
        elif self.retention:
            self.retention_interval = retention_rows.default_interval(self.retention)
        self.lease = lease
        self.max_retry_delay = max_retry_delay
        #: What the queue reads the time from: run_at, leases, retries and recovery all
        #: follow it.  Tests pass a clock they move; applications keep the default.
        self.clock = clock
        self._tasks: dict[str, RegisteredTask[Any, Any]] = {}
        self._periodic: dict[str, PeriodicTask] = {}
        # The concurrency limits of each set of names claimed, worked out once per registration.
        self._limits_of_names: dict[tuple[str, ...] | None, Limits | None] = {}
        #: Until when (monotonic) claims leave the limited claim out, after one found nothing.
        self._limited_idle_until = 0.0
        self._strategy: ClaimStrategy | None = None
        self._strategy_lock = threading.Lock()
        self._requested_strategy = strategy
        self._next_recovery: datetime | None = None
        self._worker_id: tuple[int, str] | None = None
        self._async_worker_running = False
        #: The paused queues as last read: what claims leave out (`sa_taskqueue.features.pausing`).
        self.paused = PausedQueues()
        #: Wakes `result` waiters when their task finishes (PostgreSQL); started by the first wait.
        self.finished_listener = FinishedListener(self.engine, self.table)
        #: The lifecycle events of this queue's tasks and workers in this process: subscribe here.
        self.events = EventStream()
        if strategy is not None:
            registry.check_requested(strategy, self.engine.dialect)
        backend_for(self.engine.dialect).configure_engine(self.engine)

    # Strategy --------------------------------------------------------------

    @property
    def strategy(self) -> ClaimStrategy:
        """The claim strategy in use; resolved (connecting once if needed) on first access."""
        if self._strategy is None:
            with self._strategy_lock:
                if self._strategy is None:
                    self._strategy = self._bridge.call(self._resolve_strategy)
        return self._strategy

    @property
    def is_async(self) -> bool:
        """Whether the queue was given an async engine (its database calls then run on that engine's loop)."""
        return self._bridge.is_async

    def _resolve_strategy(self) -> ClaimStrategy:
        with self._database_errors():
            # The server version is known only after a first connect.
            with self.engine.connect():
                pass
            backend_for(self.engine.dialect).prepare_database(self.engine)
        strategy = registry.choose(self._requested_strategy, self.engine.dialect)
        with self._database_errors():
            strategy.prepare(self.engine)
        return strategy

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
    ) -> RegisteredTask[P, R] | Callable[[Callable[P, R]], RegisteredTask[P, R]]:
        """Register a function as a task; usable as ``@queue.task`` or ``@queue.task("name", ...)``.

        The name defaults to ``module.qualname``.  Registering a second
        function under a taken name is an error: rows would run the wrong code.

        ``concurrency_limit=N`` lets at most N runs sharing a concurrency key
        run at once, across every worker: the key is the task's name, or
        ``concurrency_key`` names the params (one, or a tuple) whose values
        make it, or is a function of the params returning a string.

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
        if not isinstance(transactional, bool):
            raise TypeError(f"transactional must be True or False, got {transactional!r}")
        validation.check_queue_name(queue, self._limits)
        validation.check_priority(priority, self._limits)
        validation.check_max_attempts(max_attempts, self._limits)
        validation.check_retry_delay(retry_delay)
        options = TaskOptions(queue, priority, max_attempts, retry_delay, validation.timeout_seconds(timeout))

        if concurrency_limit is None and concurrency_key is not None:
            raise ValueError("concurrency_key needs a concurrency_limit")

        def register(func: Callable[P, R]) -> RegisteredTask[P, R]:
            task_name = name if name is not None else f"{func.__module__}.{func.__qualname__}"
            if not isinstance(task_name, str) or not task_name:
                raise ValueError(f"task name must be a non-empty string, got {task_name!r}")
            validation.check_task_name(task_name, self._limits)
            if transactional:
                check_transactional(func, task_name, queue_is_async=self.is_async)
            task_options = replace(
                options,
                unique_by=unique.check_unique_by(unique_by, func, task_name),
                transactional=transactional,
            )
            if concurrency_limit is not None:
                limit = ConcurrencyLimit.of(task_name, func, concurrency_limit, concurrency_key)
                task_options = replace(task_options, concurrency=limit)
            existing = self._tasks.get(task_name)
            if existing is not None and existing.func is not func:
                raise ValueError(f"a task is already registered under {task_name!r}: {existing.func!r}")
            registered = RegisteredTask(self, func, task_name, task_options)
            self._tasks[task_name] = registered
            self._limits_of_names.clear()
            return registered

        return register

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
        run_params: dict[str, Any] = {} if params is None else params
        validation.check_params(run_params)
        run_params = dict(run_params)

        def register_periodic(func: Callable[P, R]) -> RegisteredTask[P, R]:
            signature = signature_to_check(func)
            if signature is not None:
                try:
                    signature.bind(**run_params)
                except TypeError as error:  # before registering: nothing half-done
                    raise TypeError(f"params do not fit periodic task {func!r}: {error}") from None
            registered = register(func)
            self._periodic[registered.name] = PeriodicTask(registered, schedule, run_params)
            return registered

        return register_periodic

    @property
    def periodic_tasks(self) -> list[PeriodicTask]:
        """The periodic tasks registered with this queue, by name."""
        return [self._periodic[name] for name in sorted(self._periodic)]

    def enqueue_due_schedules(self) -> list[EnqueuedSlot]:
        """Enqueue each periodic task's latest due slot that no one enqueued yet; return what this call did.

        Workers call it on their own at every slot and every poll interval;
        a cron job or a test may call it too.  However many processes call it
        at once, each slot is enqueued once (see `sa_taskqueue.features.schedules`).
        """
        return enqueue_due(self, self.periodic_tasks)

    def registered(self, name: str) -> RegisteredTask[Any, Any] | None:
        """The task registered under ``name`` in this process, or None."""
        return self._tasks.get(name)

    @property
    def task_names(self) -> list[str]:
        """The names of every task registered with this queue, sorted."""
        return sorted(self._tasks)

    # Enqueue ---------------------------------------------------------------

    @overload
    def enqueue(
        self,
        session: Session | scoped_session[Any],
        name: str,
        params: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
    ) -> TaskMixin: ...

    @overload
    def enqueue(
        self,
        session: AsyncSession | async_scoped_session[Any],
        name: str,
        params: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
    ) -> Coroutine[Any, Any, TaskMixin]: ...

    def enqueue(
        self,
        session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any],
        name: str,
        params: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
    ) -> TaskMixin | Coroutine[Any, Any, TaskMixin]:
        """Add a task to the caller's ``session`` and flush it; the caller commits.

        The task exists exactly when the caller's transaction commits.  Every
        argument is checked before anything touches the database.  With an
        `AsyncSession` (or an `async_scoped_session`) it returns a coroutine
        to await (``task = await queue.enqueue(async_session, ...)``); the
        checks have run, and raised, before it is returned.  One dropped
        without being awaited adds nothing, and logs an ERROR that says so.

        With a ``unique_key`` (or one derived from the task's ``unique_by``),
        while a task of this name and key is queued or running nothing is
        written and that task is returned, loaded in ``session``
        (`sa_taskqueue.features.unique`).
        """
        values = self._task_values(name, params, queue, priority, run_at, max_attempts, unique_key)
        if _is_async_session(session):
            return EnqueueCoroutine(
                _in_async_session(session, lambda sync_session: self._add(sync_session, values)),
                f"the enqueue of task {name!r}",
            )
        return self._add(cast("Session", session), values)

    def _add(self, session: Session, values: dict[str, Any]) -> TaskMixin:
        if "unique_key" in values:
            return unique.add(session, self.model, values)
        # The mixin declares no constructor; the mapped subclass gets the declarative one.
        task = cast("Callable[..., TaskMixin]", self.model)(**values)
        session.add(task)
        session.flush()  # which checks the row again and sends its NOTIFY (sa_taskqueue.core.session_events)
        return task

    @overload
    def enqueue_many(
        self,
        session: Session | scoped_session[Any],
        name: str,
        params_list: Iterable[dict[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        chunk_size: int = 1000,
        unique_key: str | None = None,
    ) -> list[int] | None: ...

    @overload
    def enqueue_many(
        self,
        session: AsyncSession | async_scoped_session[Any],
        name: str,
        params_list: Iterable[dict[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        chunk_size: int = 1000,
        unique_key: str | None = None,
    ) -> Coroutine[Any, Any, list[int] | None]: ...

    def enqueue_many(
        self,
        session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any],
        name: str,
        params_list: Iterable[dict[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        chunk_size: int = 1000,
        unique_key: str | None = None,
    ) -> list[int] | Coroutine[Any, Any, list[int] | None] | None:
        """Add one task per params dict in the caller's transaction; the caller commits.

        One multi-row INSERT per ``chunk_size`` tasks, without ORM objects;
        on PostgreSQL with psycopg 3, from ``bulk_insert.COPY_THRESHOLD``
        tasks, one ``COPY`` for them all, which SQLAlchemy's cursor events do
        not see (see `sa_taskqueue.core.bulk_insert`).
        Every argument is checked before the first row is sent.  Returns the
        new ids in order, or None where the database cannot return them from
        a multi-row INSERT (MySQL).  With an `AsyncSession` it returns a
        coroutine to await, once every row has been checked.

        Rows with a unique key (``unique_key``, or the task's ``unique_by``)
        go one INSERT each, as ``enqueue`` writes them; a row whose key is
        held, by an earlier row of the call or by a queued or running task,
        gets that task's id.
        """
        validation.check_positive_int("chunk_size", chunk_size)
        params_list = list(params_list)
        if unique_key is not None and len(params_list) > 1:
            # One key for every row would keep the first row and drop the
            # rest: almost surely not what was meant.
            raise ValueError(
                f"unique_key gives {len(params_list)} rows one key, so all but the first would be dropped; "
                "register the task with unique_by=(...) to key each row by its params"
            )
        rows = self._many_task_values(name, params_list, queue, priority, run_at, max_attempts, unique_key)
        if _is_async_session(session):
            return EnqueueCoroutine(
                _in_async_session(session, lambda sync: self._insert(sync, rows, chunk_size)),
                f"the enqueue_many of {len(rows)} run(s) of task {name!r}",
            )
        return self._insert(cast("Session", session), rows, chunk_size)

    def _insert(
        self, session: Session, rows: Sequence[Mapping[str, Any]], chunk_size: int
    ) -> list[int] | None:
        if not rows:
            return []
        if "unique_key" in rows[0]:  # (a key for one row is a key for all: unique_key or unique_by)
            return unique.add_many(session, self.table, rows)
        ids = insert_rows(session.connection(), self.table, rows, chunk_size=chunk_size)
        queues = rows.distinct("queue") if isinstance(rows, TaskRows) else {row["queue"] for row in rows}
        notify_enqueued(session, self.table, queues)
        return ids

    def _task_values(
        self,
        name: str,
        params: dict[str, Any] | None,
        queue: str | None,
        priority: int | None,
        run_at: datetime | None,
        max_attempts: int | None,
        unique_key: str | None = None,
    ) -> dict[str, Any]:
        """A registered task's row: the call's values, else the registration's defaults, all checked.

        Params are checked against the task function's signature too.  A
        ``unique_key`` column is there only for a keyed task.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        registered = self._tasks.get(name)
        if registered is None:
            known = ", ".join(repr(n) for n in self.task_names) or "none"
            raise ValueError(f"name: no task registered under {name!r} (registered: {known})")
        options = registered.options
        values = validation.task_values(
            name,
            {} if params is None else params,
            queue=options.queue if queue is None else queue,
            priority=options.priority if priority is None else priority,
            max_attempts=options.max_attempts if max_attempts is None else max_attempts,
            run_at=run_at,
            now=self.clock(),
            limits=self._limits,
        )
        return self._with_params(registered, values, values["params"], unique_key)

    def _many_task_values(
        self,
        name: str,
        params_list: list[dict[str, Any] | None],
        queue: str | None,
        priority: int | None,
        run_at: datetime | None,
        max_attempts: int | None,
        unique_key: str | None,
    ) -> Sequence[Mapping[str, Any]]:
        """The rows of one ``enqueue_many``, every one checked before any is written.

        The options all rows share (name, queue, priority, run_at, max_attempts,
        and the call's time as created_at) are checked once, with the first
        row; each row's params are checked on their own, as ``enqueue`` checks them.
        """
        if not params_list:
            return []
        first = self._task_values(name, params_list[0], queue, priority, run_at, max_attempts, unique_key)
        registered = self._tasks[name]
        # Only params and the keys made from them differ from row to row.
        varying: dict[str, list[Any]] = {
            column: [first.pop(column)]
            for column in ("params", "concurrency_key", "unique_key")
            if column in first
        }
        for params in params_list[1:]:
            params = {} if params is None else params
            validation.check_params(params)
            for column, value in self._with_params(registered, {}, params, unique_key).items():
                varying[column].append(value)
        return TaskRows(first, varying)

    def _with_params(
        self,
        registered: RegisteredTask[Any, Any],
        values: dict[str, Any],
        params: dict[str, Any],
        unique_key: str | None,
    ) -> dict[str, Any]:
        """``values`` with ``params`` (already checked as JSON), checked against the task and keyed."""
        options = registered.options
        registered.check_params(params)
        values["params"] = params
        if options.concurrency is not None:
            values["concurrency_key"] = options.concurrency.key_of(params)
        key = unique.key_of(unique_key, options.unique_by, params, registered.name, self._limits)
        if key is not None:
            values["unique_key"] = key
        return values

    # Claim and finish ------------------------------------------------------

    def default_worker_id(self) -> str:
        """``host:pid:token``, new in each process that uses this queue (a fork gets its own)."""
        pid = os.getpid()
        if self._worker_id is None or self._worker_id[0] != pid:
            self._worker_id = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}")
        return self._worker_id[1]

    def claim(
        self,
        *,
        limit: int = 1,
        queues: Sequence[str] | None = None,
        worker_id: str | None = None,
        names: Sequence[str] | None = None,
        limited_recheck: float = 0.0,
    ) -> list[ClaimedTask]:
        """Take up to ``limit`` due tasks for ``worker_id`` in one short transaction of its own.

        With tasks that have a concurrency limit among the names, a claim
        takes those first, in a transaction of their own.  ``limited_recheck``
        (seconds; a worker passes `LIMITED_RECHECK_SECONDS`) lets the claims
        that follow one which found no limited task to take leave that
        transaction out for as long, until `recheck_limited` is called.

        Each is marked RUNNING with ``attempts`` incremented and a lease of
        ``self.lease``; the claim commits before this returns.  The snapshots
        come in claim order: priority, then run_at, then id.  ``names``, when
        given, takes only tasks of those names (a worker passes the names it
        has functions for).
        """
        planned = self._plan_claim(limit, queues, worker_id, names)
        if planned is None:
            return []
        strategy, request, limited = planned
        if limited is not None:
            rows = self._claim_limited(strategy, request, limited, limited_recheck)
        else:
            with self._database_errors():
                rows = self._bridge.call(lambda: strategy.claim(self.engine, self.table, request))
        return self._claimed_tasks(rows)

    def complete_many_and_claim(
        self,
        claimed: Sequence[ClaimedTask],
        results: Sequence[Any] | None = None,
        *,
        limit: int = 1,
        queues: Sequence[str] | None = None,
        worker_id: str | None = None,
        names: Sequence[str] | None = None,
        limited_recheck: float = 0.0,
    ) -> tuple[set[int], list[ClaimedTask]]:
        """`complete_many`, then `claim`: the ids written, and the tasks claimed.

        What a worker loop does once a batch is done.  Where the strategy
        commits both at once (`ClaimStrategy.completes_and_claims_at_once`:
        `skip_locked` on PostgreSQL in one statement, on MySQL and MariaDB in
        one transaction; `conditional_update` on SQLite in one transaction)
        either both happen or neither does; elsewhere one after the other.
        The arguments are those of `complete_many` and `claim`; the
        completion is checked in full before anything is sent, and if it
        raises nothing is claimed.  Tasks with a concurrency limit among the
        names are claimed by their own transaction, after the completion.
        """
        tasks, values = self._checked_completions(claimed, results)
        planned = self._plan_claim(limit, queues, worker_id, names)
        if planned is None or planned[2] is not None:
            # Nothing to claim, or limited tasks to claim first: each on its own.
            written = self.complete_many(tasks, values)
            return written, self.claim(
                limit=limit, queues=queues, worker_id=worker_id, names=names, limited_recheck=limited_recheck
            )
        strategy, request, _limited = planned
        with self._database_errors():
            written, rows = self._bridge.call(
                lambda: strategy.complete_and_claim(
                    self.engine, self.table, tasks, values, request.now, request
                )
            )
        return written, self._claimed_tasks(rows)

    def _plan_claim(
        self, limit: int, queues: Sequence[str] | None, worker_id: str | None, names: Sequence[str] | None
    ) -> tuple[ClaimStrategy, ClaimRequest, Limits | None] | None:
        """A claim's arguments checked, recovery run if due, paused queues read: its request.

        None when there is nothing to claim (no queue or name asked for, or
        every queue asked for paused).  With the limits of the limited names
        among those asked for, if any.
        """
        validation.check_positive_int("limit", limit)
        queue_names: tuple[str, ...] | None = None
        if queues is not None:
            if isinstance(queues, str):
                raise TypeError("queues must be a sequence of queue names, not a single string")
            queue_names = tuple(queues)
            for queue_name in queue_names:
                validation.check_queue_name(queue_name)
            if not queue_names:
                return None
        task_names: tuple[str, ...] | None = None
        if names is not None:
            if isinstance(names, str):
                raise TypeError("names must be a sequence of task names, not a single string")
            task_names = tuple(names)
            for task_name in task_names:
                if not isinstance(task_name, str):
                    raise TypeError(f"names must hold task names (strings), got {task_name!r}")
            if not task_names:
                return None
        strategy = self.strategy
        self._recover_if_due(strategy)
        paused = self._paused_now()
        excluded: tuple[str, ...] | None = None
        if paused and queue_names is not None:
            queue_names = tuple(name for name in queue_names if name not in paused)
            if not queue_names:
                return None  # every queue asked for is paused: nothing to claim, no query
        elif paused:
            excluded = tuple(sorted(paused))
        worker = worker_id or self.default_worker_id()
        request = self._request(limit, queue_names, worker, task_names, excluded)
        return strategy, request, self._concurrency_limits(task_names)

    def _claimed_tasks(self, rows: list[dict[str, Any]]) -> list[ClaimedTask]:
        loads = json_loads(self.engine.dialect)
        return sorted((ClaimedTask.from_row(row, loads) for row in rows), key=lambda t: t.sort_key)

    def recheck_limited(self) -> None:
        """Let the next claim look for limited tasks again (tasks were enqueued, or a slot was freed).

        After a claim with ``limited_recheck`` finds no limited task it can
        take, claims leave the limited claim out for that long; a worker
        calls this when a NOTIFY says tasks arrived and when one of its
        limited tasks leaves its slot, so neither waits that long.
        """
        self._limited_idle_until = 0.0

    def _concurrency_limits(self, names: tuple[str, ...] | None) -> Limits | None:
        """The limits of the claimable names that have one; None when none has (the plain claim alone)."""
        try:
            return self._limits_of_names[names]
        except KeyError:
            pass
        if len(self._limits_of_names) >= 64:  # callers claiming ever new sets of names
            self._limits_of_names.clear()
        found = self._limits_of_names[names] = self._find_limits(names)
        return found

    def _find_limits(self, names: tuple[str, ...] | None) -> Limits | None:
        candidates = self._tasks if names is None else names
        limits: dict[str, int] = {}
        for task_name in candidates:
            registered = self._tasks.get(task_name)
            if registered is not None and registered.options.concurrency is not None:
                limits[task_name] = registered.options.concurrency.limit
        if not limits:
            return None
        loads = json_loads(self.engine.dialect)

        def key_of(task_name: str, params_text: Any) -> str:
            # A row enqueued before its task had a limit: its key as an enqueue now would make it.
            limit = self._tasks[task_name].options.concurrency
            assert limit is not None
            try:
                params, malformed = decode_params(params_text, loads)
                return limit.key_of(params if malformed is None else {})
            except Exception:  # noqa: BLE001 - a key function failing on these params: the task's own key
                return fitted(task_name, task_name)

        return Limits(limits, key_of)

    def _claim_limited(
        self, strategy: ClaimStrategy, request: ClaimRequest, limits: Limits, recheck_after: float
    ) -> list[dict[str, Any]]:
        # Limited names first, each into a slot of its key; the rest of the
        # limit goes to the plain claim of the other names, unchanged.  With
        # no names given, the plain claim takes the registered names only: a
        # row of a name unknown here could be a limited task of another release.
        plain = tuple(name for name in (request.names or self.task_names) if name not in limits.limits)
        rows: list[dict[str, Any]] = []
        if time.monotonic() >= self._limited_idle_until:
            limited = replace(request, names=limits.names)
            with self._database_errors():
                rows = self._bridge.call(
                    lambda: strategy.claim_limited(self.engine, self.table, limited, limits)
                )
            if not rows and recheck_after > 0:
                # Nothing limited was due, or every due key was full: leave the
                # limited claim out for a moment rather than pay its
                # transaction on every claim of plain tasks meanwhile.
                self._limited_idle_until = time.monotonic() + recheck_after
        if plain and len(rows) < request.limit:
            rest = replace(request, limit=request.limit - len(rows), names=plain)
            with self._database_errors():
                rows += self._bridge.call(lambda: strategy.claim(self.engine, self.table, rest))
        return rows

    def explain_claim(self, *, limit: int = 10, queues: Sequence[str] | None = None) -> str:
        """The database's plan for the statement a claim runs to find its rows (nothing is claimed).

        For checking that the claim walks its index, however many finished
        rows the table holds.
        """
        request = self._request(limit, tuple(queues) if queues is not None else None, "explain")
        statement = self.strategy.finding_statement(self.engine.dialect, self.table, request)
        with self._database_errors():
            return self._bridge.call(lambda: explain(self.engine, statement, request.params()))

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
        with self._database_errors():
            return self._bridge.call(
                lambda: measure_table_health(self.engine, self.table, now=moment, thresholds=thresholds)
            )

    def _request(
        self,
        limit: int,
        queues: tuple[str, ...] | None,
        worker_id: str,
        names: tuple[str, ...] | None = None,
        paused: tuple[str, ...] | None = None,
    ) -> ClaimRequest:
        now = self.clock()
        return ClaimRequest(
            limit=limit,
            queues=queues,
            worker_id=worker_id,
            now=now,
            lease_until=now + self.lease,
            names=names,
            paused=paused,
        )

    def recover(self) -> int:
        """Give back tasks whose worker is gone (lease expired, or advisory lock free); return how many."""
        strategy = self.strategy
        with self._database_errors():
            now = self.clock()
            recovered = self._bridge.call(lambda: strategy.recover(self.engine, self.table, now))
        if recovered:
            logger.warning("recovered %d task(s) from workers that are gone", recovered)
        return recovered

    def _recover_if_due(self, strategy: ClaimStrategy) -> None:
        # Recovery is a query of its own; running it on every claim would add a
        # round trip to the hot path, so it runs at most once per interval.
        # (A wall clock stepped back by more than an interval runs it at once.)
        now = self.clock()
        interval = strategy.recovery_interval(self.lease)
        if self._next_recovery is not None and self._next_recovery - interval <= now < self._next_recovery:
            return
        self._next_recovery = now + interval
        self.recover()

    def complete(self, claimed: ClaimedTask, result: Any = None) -> bool:
        """Mark the task COMPLETED with ``result``; False if ``claimed`` no longer holds it."""
        validation.check_result(result)
        now = self.clock()
        values = {
            "status": TaskStatus.COMPLETED,
            "finished_at": now,
            "locked_until": None,
            "result": result,
        }
        return self._finish(claimed, values, now)

    def complete_many(self, claimed: Sequence[ClaimedTask], results: Sequence[Any] | None = None) -> set[int]:
        """Mark many tasks COMPLETED in one statement; return the ids of those still held (and so written).

        ``results`` pairs with ``claimed`` (all None if omitted).  Every result
        is checked before anything is written.  A worker finishing tasks faster
        than one statement each can write them uses this.
        """
        tasks, values = self._checked_completions(claimed, results)
        if not tasks:
            return set()
        now = self.clock()
        strategy = self.strategy
        with self._database_errors():
            return self._bridge.call(
                lambda: strategy.complete_many(self.engine, self.table, tasks, values, now)
            )

    @staticmethod
    def _checked_completions(
        claimed: Sequence[ClaimedTask], results: Sequence[Any] | None
    ) -> tuple[list[ClaimedTask], list[Any]]:
        """``claimed`` and ``results`` (all None if omitted) as lists, each task and result checked."""
        tasks = list(claimed)
        values = [None] * len(tasks) if results is None else list(results)
        if len(values) != len(tasks):
            raise ValueError(f"results has {len(values)} entries for {len(tasks)} tasks")
        for task, result in zip(tasks, values, strict=True):
            _check_claimed(task)
            if result is not None:  # (its message is built only for a result to check)
                validation.check_result(result, f"result of task {task.id}")
        return tasks, values

    def fail(self, claimed: ClaimedTask, error: BaseException | str, *, retry: bool = True) -> bool:
        """Record ``error``; retry later with backoff while attempts remain, else mark FAILED.

        ``retry=False`` marks it FAILED now, whatever attempts remain, and so
        does a ``malformed`` task, which no attempt could ever run.  The error
        is stored as `format_error` leaves it: storable, and bounded in length.
        False if ``claimed`` no longer holds the task (its outcome is then
        someone else's to write).
        """
        now = self.clock()
        return self._finish(claimed, self._failure_values(claimed, error, now, retry=retry), now)

    def fail_many(
        self,
        claimed: Sequence[ClaimedTask],
        errors: Sequence[BaseException | str],
        *,
        retry: bool = True,
    ) -> set[int]:
        """Record many failures in one statement, each as `fail` records one; return the ids still held.

        ``errors`` pairs with ``claimed``.  Each task still held (and so
        written) is retried later with its own backoff while it has attempts
        left, else marked FAILED; the others are left alone, their ids not
        returned.  A worker whose tasks fail together writes them this way.
        """
        if isinstance(errors, str | bytes):
            raise TypeError("errors must be a sequence with one error per task, not a single string")
        tasks = list(claimed)
        texts = list(errors)
        if len(texts) != len(tasks):
            raise ValueError(f"errors has {len(texts)} entries for {len(tasks)} tasks")
        for task, error in zip(tasks, texts, strict=True):
            _check_claimed(task)
            if not isinstance(error, BaseException | str):
                kind = type(error).__name__
                raise TypeError(f"the error of task {task.id} must be an exception or a string, got {kind}")
        if not tasks:
            return set()
        now = self.clock()
        values = [
            self._failure_values(task, error, now, retry=retry)
            for task, error in zip(tasks, texts, strict=True)
        ]
        strategy = self.strategy
        with self._database_errors():
            return self._bridge.call(lambda: strategy.fail_many(self.engine, self.table, tasks, values, now))

    def _failure_values(
        self, claimed: ClaimedTask, error: BaseException | str, now: datetime, *, retry: bool
    ) -> dict[str, Any]:
        """What a failure writes: queued again after its backoff while attempts remain, else FAILED."""
        values: dict[str, Any] = {"last_error": format_error(error), "locked_until": None}
        if retry and claimed.malformed is None and claimed.attempts < claimed.max_attempts:
            values.update(status=TaskStatus.QUEUED, run_at=now + self.retry_delay(claimed))
        else:
            values.update(status=TaskStatus.FAILED, finished_at=now)
        _give_up_slot(claimed, values)
        return values

    def release(self, claimed: ClaimedTask) -> bool:
        """Give a task back unrun (shutting down): QUEUED again, the attempt not counted."""
        values = {
            "status": TaskStatus.QUEUED,
            "attempts": self.table.c.attempts - 1,
            "locked_until": None,
        }
        _give_up_slot(claimed, values)
        return self._finish(claimed, values, self.clock())

    def complete_in(self, conn: Connection, claimed: ClaimedTask, result: Any = None) -> bool:
        """In ``conn``'s open transaction, mark the task COMPLETED if ``claimed`` still holds it; True if so.

        A transactional task's completion, written beside its own writes:
        the caller commits when this returns True, and rolls everything back
        when it returns False (the task is no longer this claim's).  The
        finished-task notification goes out with that commit.
        """
        _check_claimed(claimed)
        validation.check_result(result)
        now = self.clock()
        values = {"status": TaskStatus.COMPLETED, "finished_at": now, "locked_until": None, "result": result}
        with self._database_errors():
            # (The fenced UPDATE announces the finished task itself, where the
            # database has a channel: `LeaseWrites.write_if_held`.)
            return self.strategy.complete_on(conn, self.table, claimed, values, now)

    def let_go(self, claimed: ClaimedTask) -> None:
        """A transactional task's transaction has ended: drop what the strategy still holds for it."""
        strategy = self.strategy
        with self._database_errors():
            self._bridge.call(lambda: strategy.settled(claimed))

    def outcome_written(self, claimed: ClaimedTask, *, completed: bool) -> bool:
        """Whether this claim's own outcome is in the row: completed, or else failed or set to retry.

        For a write whose answer was lost with its connection: the write may
        have committed, and its retry then finds the task no longer held.
        Only this claim can have written it while the row still carries the
        claim's identity, but for lease recovery, whose error text says so.
        """
        _check_claimed(claimed)
        strategy = self.strategy
        with self._database_errors():
            found = self._bridge.call(lambda: strategy.claim_outcome(self.engine, self.table, claimed))
        if found is None:
            return False
        status, last_error = found
        if completed:
            return status == TaskStatus.COMPLETED
        return status in (TaskStatus.QUEUED, TaskStatus.FAILED) and last_error != LEASE_EXPIRED_ERROR

    def extend_leases(self, claimed: Sequence[ClaimedTask]) -> set[int]:
        """Renew the lease of each task still held; return the ids renewed (the worker's heartbeat)."""
        if not claimed:
            return set()
        now = self.clock()
        strategy = self.strategy
        with self._database_errors():
            return self._bridge.call(
                lambda: strategy.extend(self.engine, self.table, claimed, now + self.lease, now)
            )

    def _finish(self, claimed: ClaimedTask, values: dict[str, Any], now: datetime) -> bool:
        _check_claimed(claimed)
        strategy = self.strategy
        with self._database_errors():
            return self._bridge.call(lambda: strategy.finish(self.engine, self.table, claimed, values, now))

    def retry_delay(self, claimed: ClaimedTask) -> timedelta:
        """``retry_delay * 2**(attempts-1)``, plus up to 25% jitter, capped at ``max_retry_delay``."""
        registered = self._tasks.get(claimed.name)
        base = registered.options.retry_delay if registered else DEFAULT_RETRY_DELAY
        return retry_delay(base, claimed.attempts, self.max_retry_delay)

    def cancel(self, task_id: int) -> bool:
        """Cancel a queued task so that it is never claimed; False if it is not queued."""
        strategy = self.strategy
        now = self.clock()

        def cancel() -> bool:
            with strategy.transaction(self.engine) as conn:
                return cancel_queued(conn, self.table, task_id, now)

        with self._database_errors():
            return self._bridge.call(cancel)

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
        validation.check_task_id(task_id)
        seconds = wait_seconds(timeout)
        cap = poll_seconds(poll_interval)

        def read() -> TaskOutcome:
            with self._database_errors():
                return self._bridge.call(lambda: read_outcome(self.engine, self.table, task_id))

        return wait_for_result(read, self.finished_listener, task_id, seconds, cap)

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
        validation.check_task_id(task_id)
        seconds = wait_seconds(timeout)
        cap = poll_seconds(poll_interval)

        def read_row() -> TaskOutcome:
            return read_outcome(self.engine, self.table, task_id)

        async def read() -> TaskOutcome:
            with self._database_errors():
                if self.is_async:
                    return await self._bridge.call_from_any_loop(read_row)
                return await asyncio.to_thread(read_row)

        return await wait_for_result_async(read, self.finished_listener, task_id, seconds, cap)

    # Paused queues ---------------------------------------------------------

    def pause(self, name: str) -> None:
        """Stop every worker claiming tasks of queue ``name`` until `resume`; tasks running go on.

        Stored in the database and committed at once, so it holds for every
        worker of this table on every machine: each honours it within a
        second or its poll interval (at once on PostgreSQL, notified at
        commit).  Pausing a paused queue changes nothing.
        """
        self._set_paused(name, paused=True)

    def resume(self, name: str) -> None:
        """Let workers claim tasks of queue ``name`` again; resuming a queue not paused changes nothing."""
        self._set_paused(name, paused=False)

    def paused_queues(self) -> list[str]:
        """The queues paused now, sorted, read from the database."""
        with self._database_errors():
            paused = self._bridge.call(lambda: read_paused(self.engine, self.table))
        self.paused.store(paused)
        return sorted(paused)

    def _set_paused(self, name: str, *, paused: bool) -> None:
        validation.check_queue_name(name, self._limits)
        now = self.clock()
        with self._database_errors():
            self._bridge.call(lambda: set_paused(self.engine, self.table, name, paused, now))
        self.paused.invalidate()

    def _paused_now(self) -> frozenset[str]:
        """The paused queues as kept, read again when older than their maximum age."""

        def read() -> frozenset[str]:
            with self._database_errors():
                return self._bridge.call(lambda: read_paused(self.engine, self.table))

        return self.paused.current(read)

    # Retention -------------------------------------------------------------

    def delete_expired(
        self,
        *,
        batch_size: int = retention_rows.DEFAULT_BATCH_SIZE,
        holder: str | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Delete finished tasks older than ``retention`` says, in batches; return how many.

        What workers run every ``retention_interval``; a test or a cron job
        may call it too.  One caller at a time deletes (a lease in the
        control table): while another holds it this returns 0 at once.
        ``finished_at`` is compared with the queue's clock.  Each batch of at
        most ``batch_size`` rows commits on its own.
        """
        validation.check_positive_int("batch_size", batch_size)
        if not self.retention:
            return 0
        # Each run holds the lease under a name of its own: two workers of one
        # process (or a worker and a direct call) share a worker id, and a
        # lease its holder may renew would let both delete at once.
        who = f"{(holder or self.default_worker_id())[:240]}:{secrets.token_hex(4)}"
        with self._database_errors():
            return self._bridge.call(
                lambda: retention_rows.delete_expired(
                    self.engine,
                    self.table,
                    self.retention,
                    holder=who,
                    clock=self.clock,
                    batch_size=batch_size,
                    stop=stop,
                )
            )

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
        # The start and the end of this call close the connections the
        # strategy keeps, advisory locks included: a second worker of this
        # queue object running meanwhile would lose its locks, and its tasks
        # could run twice.  (Set before the first await, so two calls on one
        # loop cannot both pass.)
        if self._async_worker_running:
            raise RuntimeError(
                "this TaskQueue already runs a worker through run_worker_async: raise its concurrency, "
                "or give the second worker a TaskQueue of its own (on the same engine if you like)"
            )
        self._async_worker_running = True
        try:
            return await self._run_attached(worker, loop)
        finally:
            self._async_worker_running = False

    async def _run_attached(self, worker: Worker, loop: asyncio.AbstractEventLoop) -> Worker:
        """`run_worker_async`'s body: ``worker`` in a thread, the queue's calls on ``loop`` meanwhile."""
        attached: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.is_async:
            # Connections this queue keeps were opened on the engine's own
            # loop; they go back to the pool before calls move to this loop.
            await asyncio.to_thread(self.close)
            attached = self._bridge.attached(loop)
        with attached:
            done: asyncio.Future[None] = loop.create_future()

            def settle(error: BaseException | None) -> None:
                if done.done():
                    return
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)

            def run() -> None:
                try:
                    worker.run()
                except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
                    loop.call_soon_threadsafe(settle, error)
                else:
                    loop.call_soon_threadsafe(settle, None)

            threading.Thread(target=run, name="sa_taskqueue-worker", daemon=True).start()
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                worker.stop()
                # The drain runs its database calls on this loop: it must keep
                # running meanwhile, and this call must not return while the
                # worker still runs, even when cancelled again: its remaining
                # calls would go to a loop it is no longer attached to.
                while not done.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(done)
                error = done.exception()
                if error is not None:
                    raise error from None
                raise
            finally:
                if self.is_async and self._strategy is not None:
                    await self._bridge.call_async(self._strategy.close)
        return worker

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop an async engine's calls run on: ``run_worker_async``'s while it runs, else its own.

        Raises `TypeError` for a queue on a sync engine, which needs none.
        """
        if not self.is_async:
            raise TypeError("a TaskQueue on a sync Engine runs its database calls in the calling thread")
        return self._bridge.loop()

    def check_footing(self, *, listen: bool = True) -> FootingReport:
        """The self-test a worker runs at start (`health.self_test`), for ``doctor`` and monitoring.

        Proves on two connections of its own that what the strategy relies on
        holds through this engine's URL (SKIP LOCKED honoured, advisory locks
        kept per session, one winner of a compare-and-set) and, with
        ``listen``, that a NOTIFY reaches a LISTENing connection.  Returns
        the checks; `FootingReport.raise_if_failed` turns failures into a
        `FootingError`.
        """
        return check_footing(self, listen=listen)

    def close(self) -> None:
        """Release what the strategy holds: its kept connections and any advisory locks.

        The connection listening for finished tasks is closed too (a later wait opens it again).
        """
        self.finished_listener.close()
        if self._strategy is not None:
            self._bridge.call(self._strategy.close)

    def run_sync(self, fn: Callable[[], T], /) -> T:
        """``fn()``, where this queue's ``engine`` may be used: for your own admin or maintenance queries.

        A queue on a sync Engine calls it here.  On an AsyncEngine, ``engine``
        is its sync_engine, which works only inside SQLAlchemy's greenlet on
        the engine's event loop (elsewhere: MissingGreenlet); this runs ``fn``
        there and waits for it.  Call it from outside that loop (from the
        loop, ``await asyncio.to_thread(queue.run_sync, fn)``).
        """
        return self._bridge.call(fn)

    # Errors ----------------------------------------------------------------

    def _database_errors(self) -> AbstractContextManager[None]:
        return translate_database_errors(self.engine, self.table)


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


def _is_async_session(session: object) -> TypeGuard[AsyncSession | async_scoped_session[Any]]:
    ext = asyncio_extension()
    return ext is not None and isinstance(session, ext.AsyncSession | ext.async_scoped_session)


async def _in_async_session(
    session: AsyncSession | async_scoped_session[Any], work: Callable[[Session], T]
) -> T:
    """``work(sync_session)`` in the async session's greenlet, on the caller's loop and connection.

    The same code as a sync enqueue, so a task added this way is checked,
    flushed and announced (NOTIFY) exactly as one added with a `Session`.
    """
    # An async_scoped_session proxies to the AsyncSession of the current scope.
    ext = asyncio_extension()
    assert ext is not None  # an async session exists, so its module was imported
    target = cast("AsyncSession", session() if isinstance(session, ext.async_scoped_session) else session)
    return await target.run_sync(work)


def _give_up_slot(claimed: ClaimedTask, values: dict[str, Any]) -> None:
    """Clear the slot of a limited task going back to the queue (or to FAILED, which can be retried).

    The slot stops counting as the row leaves RUNNING anyway; cleared, it
    cannot come back with a later claim that gives no slot (a release of the
    task without the limit), where it could clash with the slot's new holder.
    """
    if claimed.concurrency_slot is not None:
        values["concurrency_slot"] = None


def _check_claimed(claimed: Any) -> None:
    if not isinstance(claimed, ClaimedTask):
        raise TypeError(f"expected the ClaimedTask returned by claim(), got {claimed!r}")
