"""`TaskQueue`'s enqueue methods: ``enqueue``, ``enqueue_many``, ``chain``, and the parents' results.

Gathered here apart from the rest of the queue; the rows are built and
written by the queue's `Enqueuing` part, dependencies by
`sa_taskqueue.features.workflows.dependencies`.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast, overload

from sqlalchemy.orm import Session, scoped_session

from sa_taskqueue.core import validation
from sa_taskqueue.core.batch_members import check_batch_id
from sa_taskqueue.core.model import TaskMixin
from sa_taskqueue.core.registered import TaskCall
from sa_taskqueue.core.task_rows import TaskRows
from sa_taskqueue.core.unawaited import EnqueueCoroutine
from sa_taskqueue.features.workflows.dependencies import parent_results
from sa_taskqueue.queue.batching import Batch
from sa_taskqueue.queue.enqueuing import Enqueuing, check_dependencies
from sa_taskqueue.queue.parts import QueueParts
from sa_taskqueue.queue.sessions import in_async_session as _in_async_session
from sa_taskqueue.queue.sessions import is_async_session as _is_async_session

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session


class EnqueueMethods:
    """`TaskQueue`'s enqueue methods (this class is not used on its own)."""

    _parts: QueueParts
    _enqueuing: Enqueuing

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
        depends_on: Iterable[TaskMixin | int] | None = None,
        on_parent_failure: str | None = None,
        batch: Batch | int | None = None,
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
        depends_on: Iterable[TaskMixin | int] | None = None,
        on_parent_failure: str | None = None,
        batch: Batch | int | None = None,
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
        depends_on: Iterable[TaskMixin | int] | None = None,
        on_parent_failure: str | None = None,
        batch: Batch | int | None = None,
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

        With ``depends_on`` (tasks, as enqueue returns them, or task ids) the
        task waits (status WAITING, never claimed) until every one of them
        has finished, then runs; a parent that fails or is cancelled cancels
        it, unless ``on_parent_failure="run"`` (see
        `sa_taskqueue.features.workflows.dependencies`).  A unique key and
        ``depends_on`` together are refused.

        With a ``batch`` (a `Batch` or its id), the task joins that open
        batch, which counts it in this transaction; a closed batch raises
        `BatchClosed` with nothing written.  A batch member cannot have a
        unique key.
        """
        values = self._enqueuing.task_values(
            name,
            params,
            queue,
            priority,
            run_at,
            max_attempts,
            unique_key,
            depends_on=depends_on,
            on_parent_failure=on_parent_failure,
        )
        if batch is not None:
            values["batch_id"] = _member_of(batch, "unique_key" in values)
        if _is_async_session(session):
            return EnqueueCoroutine(
                _in_async_session(session, lambda sync_session: self._enqueuing.add(sync_session, values)),
                f"the enqueue of task {name!r}",
            )
        return self._enqueuing.add(cast("Session", session), values)

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
        depends_on: Iterable[TaskMixin | int] | None = None,
        on_parent_failure: str | None = None,
        batch: Batch | int | None = None,
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
        depends_on: Iterable[TaskMixin | int] | None = None,
        on_parent_failure: str | None = None,
        batch: Batch | int | None = None,
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
        depends_on: Iterable[TaskMixin | int] | None = None,
        on_parent_failure: str | None = None,
        batch: Batch | int | None = None,
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

        With ``depends_on``, every row depends on those tasks, as in
        `enqueue`; the ids are then returned on every database (MySQL takes
        one INSERT per row for it).
        """
        validation.check_positive_int("chunk_size", chunk_size)
        params_list = list(params_list)
        if unique_key is not None and len(params_list) > 1:
            # One key for every row would keep the first row and drop the rest: not what was meant.
            raise ValueError(
                f"unique_key gives {len(params_list)} rows one key, so all but the first would be dropped; "
                "register the task with unique_by=(...) to key each row by its params"
            )
        rows = self._enqueuing.many_task_values(
            name, params_list, queue, priority, run_at, max_attempts, unique_key
        )
        if batch is not None and rows:
            rows = _in_batch(rows, _member_of(batch, "unique_key" in rows[0]))
        parents = check_dependencies(depends_on, on_parent_failure, rows[0] if rows else {})

        def insert(sync_session: Session) -> list[int] | None:
            return self._enqueuing.insert(sync_session, rows, chunk_size, parents, on_parent_failure)

        if _is_async_session(session):
            return EnqueueCoroutine(
                _in_async_session(session, insert),
                f"the enqueue_many of {len(rows)} run(s) of task {name!r}",
            )
        return insert(cast("Session", session))

    @overload
    def chain(
        self,
        session: Session | scoped_session[Any],
        /,
        *steps: TaskCall,
        on_parent_failure: str | None = None,
    ) -> list[TaskMixin]: ...

    @overload
    def chain(
        self,
        session: AsyncSession | async_scoped_session[Any],
        /,
        *steps: TaskCall,
        on_parent_failure: str | None = None,
    ) -> Coroutine[Any, Any, list[TaskMixin]]: ...

    def chain(
        self,
        session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any],
        /,
        *steps: TaskCall,
        on_parent_failure: str | None = None,
    ) -> list[TaskMixin] | Coroutine[Any, Any, list[TaskMixin]]:
        """Enqueue ``steps`` so that each runs once the one before it has completed; the rows, in order.

        ``queue.chain(session, fetch.call(url=u), parse.call(), store.using(queue="db").call())``:
        each step after the first depends on the one before (``depends_on``),
        and reads its result with ``current_task().parent_result()``.  A step
        that fails for good (or is cancelled) cancels the rest of the chain,
        unless ``on_parent_failure="run"`` (then every later step runs
        regardless).  Every step is checked before anything is written; the
        caller commits, as with `enqueue`.  A step after the first cannot
        have a unique key.
        """
        if not steps:
            raise ValueError("chain needs at least one step: task.call(**params)")
        values: list[dict[str, Any]] = []
        for index, step in enumerate(steps):
            if not isinstance(step, TaskCall):
                raise TypeError(
                    f"chain step {index + 1} must be task.call(**params) or task.using(...).call(**params), "
                    f"got {step!r}"
                )
            options = step.options()
            step_values = self._enqueuing.task_values(
                step.registered.name,
                step.params,
                options.get("queue"),
                options.get("priority"),
                options.get("run_at"),
                options.get("max_attempts"),
                options.get("unique_key"),
                depends_on=options.get("depends_on"),
                on_parent_failure=options.get("on_parent_failure"),
            )
            if index and "unique_key" in step_values:
                raise ValueError(
                    f"chain step {index + 1} has a unique key: a step after the first waits for the one "
                    "before it, and a waiting task cannot hold a unique key"
                )
            values.append(step_values)
        check_dependencies([], on_parent_failure, {})

        def enqueue_steps(sync_session: Session) -> list[TaskMixin]:
            rows: list[TaskMixin] = []
            for step_values in values:
                if rows:
                    parents = [rows[-1], *step_values.get("depends_on", [])]
                    step_values = {**step_values, "depends_on": parents}
                    if on_parent_failure is not None and "on_parent_failure" not in step_values:
                        step_values["on_parent_failure"] = on_parent_failure
                rows.append(self._enqueuing.add(sync_session, step_values))
            return rows

        if _is_async_session(session):
            return EnqueueCoroutine(
                _in_async_session(session, enqueue_steps), f"the chain of {len(steps)} step(s)"
            )
        return enqueue_steps(cast("Session", session))

    def parent_results(self, task_id: int) -> dict[int, Any]:
        """The results of task ``task_id``'s parents (``depends_on``), by parent id; None for one without.

        What a running task reads with ``current_task().parent_results()``.
        """
        validation.check_task_id(task_id)
        parts = self._parts
        with parts.database_errors():
            return parts.call(lambda: parent_results(parts.engine, parts.table, task_id))


def _member_of(batch: object, keyed: bool) -> int:
    """The id of the batch an enqueue joins (a `Batch` or an id); a keyed task cannot join one."""
    if keyed:
        raise ValueError(
            "a batch member cannot have a unique key: a held key would return a task outside the batch"
        )
    return batch.id if isinstance(batch, Batch) else check_batch_id(batch)


def _in_batch(rows: Sequence[Mapping[str, Any]], batch_id: int) -> Sequence[Mapping[str, Any]]:
    """``rows`` as members of batch ``batch_id`` (held once for all rows of a bulk enqueue)."""
    if isinstance(rows, TaskRows):
        return TaskRows({**rows.shared, "batch_id": batch_id}, rows.varying)
    return [{**row, "batch_id": batch_id} for row in rows]


__all__ = ["EnqueueMethods"]
