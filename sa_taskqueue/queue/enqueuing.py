"""`Enqueuing`: a registered task's rows, checked in full, then added to the caller's session.

Every argument is checked before anything touches the database; the rows
go into the caller's transaction (one ORM object for `enqueue`, multi-row
INSERTs or COPY for `enqueue_many`) and exist exactly when it commits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from sqlalchemy.orm import Session

from sa_taskqueue.core import validation
from sa_taskqueue.core.at_commit import emit_at_commit
from sa_taskqueue.core.batch_members import count_finished_at_insert, count_members, uncount_members
from sa_taskqueue.core.bulk_insert import insert_rows
from sa_taskqueue.core.events import EnqueueEvent, EventKind, EventStream, TaskEvent
from sa_taskqueue.core.exceptions import BatchClosed, BatchNotFound, ParentNotFound, missing_table_errors
from sa_taskqueue.core.model import TaskMixin, check_parents
from sa_taskqueue.core.notify import notify_enqueued
from sa_taskqueue.core.registered import RegisteredTask
from sa_taskqueue.core.task_rows import TaskRows
from sa_taskqueue.features import unique
from sa_taskqueue.features.workflows import dependencies
from sa_taskqueue.queue.parts import QueueParts

P = ParamSpec("P")
R = TypeVar("R")


def _schema_missing_named(
    write: Callable[Concatenate[Enqueuing, P], R],
) -> Callable[Concatenate[Enqueuing, P], R]:
    """``write``, raising `SchemaMissing` (with the migrate hint) when the task table is not there.

    Every enqueue writes through `Enqueuing.add` or `Enqueuing.insert`, so
    each path (``enqueue``, a task's ``.enqueue``, ``enqueue_many``, their
    async forms) says the same thing, and never the driver's own error.
    """

    @functools.wraps(write)
    def writing(self: Enqueuing, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with missing_table_errors(self._parts.engine, self._parts.table):
            return write(self, *args, **kwargs)

    return writing


logger = logging.getLogger("sa_taskqueue")


class Enqueuing:
    """Builds and writes the rows of one queue's enqueues; the registrations are the queue's."""

    def __init__(
        self,
        parts: QueueParts,
        model: type[TaskMixin],
        tasks: Mapping[str, RegisteredTask[Any, Any]],
        events: EventStream,
    ) -> None:
        self._parts = parts
        self._model = model
        self._tasks = tasks
        self._events = events

    @_schema_missing_named
    def add(self, session: Session, values: dict[str, Any]) -> TaskMixin:
        """One task row added to ``session`` and flushed (a held unique key returns the task holding it)."""
        announced = self._enqueuing(values["name"], values["queue"], 1)
        if announced is not None and announced.headers and "headers" not in values:
            values["headers"] = dict(announced.headers)
        try:
            if "unique_key" in values:
                task, new = unique.add_or_find(session, self._model, values)
            else:
                # The mixin declares no constructor; the mapped subclass gets the declarative one.
                task = cast("Callable[..., TaskMixin]", self._model)(**values)
                session.add(task)
                try:
                    session.flush()  # which checks the row again and sends its NOTIFY (core.session_events)
                except (ParentNotFound, BatchClosed, BatchNotFound):
                    # Refused before any SQL of its own: the session goes on without it.
                    session.expunge(task)
                    raise
                new = True
        except BaseException as error:
            _tell(announced, None, error)
            raise
        _tell(announced, [task.id], None)
        if new and self._events.wants(EventKind.ENQUEUED):
            self._enqueued_at_commit(session, [(task.id, values)])
        return task

    @_schema_missing_named
    def insert(
        self,
        session: Session,
        rows: Sequence[Mapping[str, Any]],
        chunk_size: int,
        depends_on: list[TaskMixin | int] | None = None,
        on_parent_failure: str | None = None,
    ) -> list[int] | None:
        """Many rows in the session's transaction, without ORM objects; their ids where the database says.

        With ``depends_on``, every row depends on those parents
        (`dependencies.insert_dependents`), and the ids are always returned.
        """
        if not rows:
            return []
        table = self._parts.table
        ids: list[int] | None
        if self._events.wants(EventKind.ENQUEUING):
            first = rows[0]
            announced = self._enqueuing(first["name"], first["queue"], len(rows))
            if announced is not None and announced.headers and "headers" not in first:
                rows = _with_headers(rows, announced.headers)
        else:
            announced = None
        batch_id = rows[0].get("batch_id")  # (one batch for all rows of a call)
        counted = False
        try:
            if batch_id is not None:
                # Counted into the batch first: a closed batch refuses them before any row is written.
                count_members(
                    session.connection(bind_arguments={"clause": table}), table, {batch_id: len(rows)}
                )
                counted = True
            if "unique_key" in rows[0]:  # (a key for one row is a key for all: unique_key or unique_by)
                ids, new = unique.add_many_or_find(session, table, rows)
            elif depends_on:
                ids, status = dependencies.insert_dependents(
                    session, table, rows, depends_on, on_parent_failure, self._parts.clock(), chunk_size
                )
                if status.value == "queued":
                    notify_enqueued(session, table, {row["queue"] for row in rows})
                elif batch_id is not None:
                    # Cancelled at once (a parent failed): no final write will count them.
                    count_finished_at_insert(session.connection(), table, batch_id, status, len(rows))
                new = list(range(len(rows)))
            else:
                ids = insert_rows(session.connection(), table, rows, chunk_size=chunk_size)
                queues = (
                    rows.distinct("queue") if isinstance(rows, TaskRows) else {row["queue"] for row in rows}
                )
                notify_enqueued(session, table, queues)
                new = list(range(len(rows)))
        except BaseException as error:
            if counted and batch_id is not None:
                # A transaction a failed INSERT leaves usable (MySQL, SQLite) must not keep the count.
                with contextlib.suppress(Exception):
                    uncount_members(session.connection(), table, batch_id, len(rows))
            _tell(announced, None, error)
            raise
        _tell(announced, [None] * len(rows) if ids is None else ids, None)
        if self._events.wants(EventKind.ENQUEUED):
            self._enqueued_at_commit(session, [(None if ids is None else ids[i], rows[i]) for i in new])
        return ids

    def _enqueuing(self, name: str, queue: str, count: int) -> EnqueueEvent | None:
        """``ENQUEUING`` emitted, if anyone listens, before the rows are written: with what was added."""
        if not self._events.wants(EventKind.ENQUEUING):
            return None
        event = EnqueueEvent(EventKind.ENQUEUING, name, queue, count, self._parts.clock())
        self._events.emit(event)
        return event

    def _enqueued_at_commit(
        self, session: Session, written: list[tuple[int | None, Mapping[str, Any]]]
    ) -> None:
        """One ``ENQUEUED`` event per new row, emitted once the caller's transaction commits."""
        clock = self._parts.clock

        def build() -> list[TaskEvent]:
            at = clock()
            return [
                TaskEvent(EventKind.ENQUEUED, task_id, row["name"], row["queue"], 0, at)
                for task_id, row in written
            ]

        emit_at_commit(session, self._events, build)

    def task_values(
        self,
        name: str,
        params: dict[str, Any] | None,
        queue: str | None,
        priority: int | None,
        run_at: datetime | None,
        max_attempts: int | None,
        unique_key: str | None = None,
        depends_on: Any = None,
        on_parent_failure: str | None = None,
    ) -> dict[str, Any]:
        """A registered task's row: the call's values, else the registration's defaults, all checked.

        Params are checked against the task function's signature too.  A
        ``unique_key`` column is there only for a keyed task; ``depends_on``
        (checked) only for a dependent one, with its ``on_parent_failure``.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        registered = self._tasks.get(name)
        if registered is None:
            known = ", ".join(repr(n) for n in sorted(self._tasks)) or "none"
            raise ValueError(f"name: no task registered under {name!r} (registered: {known})")
        options = registered.options
        values = validation.task_values(
            name,
            {} if params is None else params,
            queue=options.queue if queue is None else queue,
            priority=options.priority if priority is None else priority,
            max_attempts=options.max_attempts if max_attempts is None else max_attempts,
            run_at=run_at,
            now=self._parts.clock(),
            limits=self._parts.limits,
        )
        values = self._with_params(registered, values, values["params"], unique_key)
        parents = check_dependencies(depends_on, on_parent_failure, values)
        if parents:
            values["depends_on"] = parents
            if on_parent_failure is not None:
                values["on_parent_failure"] = on_parent_failure
        return values

    def many_task_values(
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
        first = self.task_values(name, params_list[0], queue, priority, run_at, max_attempts, unique_key)
        registered = self._tasks[name]
        # Only params and the keys made from them differ from row to row.
        varying: dict[str, list[Any]] = {
            column: [first.pop(column)]
            for column in ("params", "concurrency_key", "unique_key")
            if column in first
        }
        for params in params_list[1:]:
            params = validation.storable_params({} if params is None else params)
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
        key = unique.key_of(unique_key, options.unique_by, params, registered.name, self._parts.limits)
        if key is not None:
            values["unique_key"] = key
        return values


def check_dependencies(
    depends_on: Any, on_parent_failure: str | None, values: Mapping[str, Any]
) -> list[TaskMixin | int] | None:
    """``depends_on`` (None or empty: none) and ``on_parent_failure`` checked; refused with a unique key."""
    dependencies.check_policy(on_parent_failure)
    if depends_on is None:
        if on_parent_failure is not None:
            raise ValueError(
                "on_parent_failure is given without depends_on: it says what a parent's failure does"
            )
        return None
    parents = check_parents(depends_on)
    if parents and "unique_key" in values:
        raise ValueError(
            "a task with a unique key cannot have depends_on: its key is held only while it is queued "
            "or running, and a waiting task released later could clash with another holding it"
        )
    return parents


def _tell(
    announced: EnqueueEvent | None, ids: Sequence[int | None] | None, error: BaseException | None
) -> None:
    """Call the `Written` callbacks an ``ENQUEUING`` event's subscribers left, each once; none may raise."""
    if announced is None:
        return
    for written in announced.written:
        try:
            written(ids, error)
        except Exception:
            logger.exception("an enqueue subscriber's callback raised")


def _with_headers(
    rows: Sequence[Mapping[str, Any]], headers: Mapping[str, str]
) -> Sequence[Mapping[str, Any]]:
    """``rows`` carrying ``headers``: held once for all rows of a bulk enqueue."""
    if isinstance(rows, TaskRows):
        return TaskRows({**rows.shared, "headers": dict(headers)}, rows.varying)
    return [{**row, "headers": dict(headers)} for row in rows]


__all__ = ["Enqueuing"]
