"""`Batch`: the handle ``queue.batch(...)`` returns, and how a queue turns callbacks into stored specs.

A batch's SQL and its exactly-once finish are `sa_taskqueue.features.workflows.batches`';
this module is what the application holds: the batch's id and the session
it adds members in.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sqlalchemy import Engine, Table, inspect
from sqlalchemy.orm import Session, scoped_session

from sa_taskqueue.core import validation
from sa_taskqueue.core.batch_members import check_batch_id
from sa_taskqueue.core.exceptions import BatchNotFound
from sa_taskqueue.core.model import TaskMixin
from sa_taskqueue.core.registered import RegisteredTask, TaskCall, TaskWithOptions
from sa_taskqueue.core.unawaited import EnqueueCoroutine
from sa_taskqueue.features.workflows import batches as batch_rows
from sa_taskqueue.features.workflows.batches import BATCH_PARAM, BatchState, CallbackSpec, Outcome
from sa_taskqueue.queue.enqueuing import Enqueuing
from sa_taskqueue.queue.parts import QueueParts
from sa_taskqueue.queue.sessions import in_async_session, is_async_session

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session

T = TypeVar("T")

#: A batch's callback: a registered task, the same with options (``task.using(queue="ops")``),
#: or either with extra params: ``task.call(channel="#ops")`` or ``(task, {"channel": "#ops"})``.
Callback = (
    RegisteredTask[Any, Any]
    | TaskWithOptions
    | TaskCall
    | tuple[RegisteredTask[Any, Any] | TaskWithOptions, Mapping[str, Any]]
)


class Batch:
    """A batch of tasks, bound to the session it was opened in: add members, then close it.

    ``b.enqueue(task, **params)`` (or ``task.enqueue(session, ..., batch=b)``)
    adds a member in the session's transaction; members may be added over
    several transactions until ``b.close()``.  ``with queue.batch(session,
    ...) as b:`` closes it when the block ends without an error.  Nothing is
    committed here: the caller commits, as with every enqueue.

    With an `AsyncSession`, every method returns a coroutine to await.
    """

    def __init__(self, queue: BatchOperations, session: Any, batch_id: int, name: str | None) -> None:
        self._queue = queue
        #: The session members are added in (the one the batch was opened or fetched with).
        self.session = session
        #: The batch's id: what ``sa-taskqueue batch ID``, the dashboard and `TaskQueue.batch_state` take.
        self.id = batch_id
        self.name = name

    def enqueue(self, task: RegisteredTask[Any, Any] | TaskWithOptions | str, /, **params: Any) -> Any:
        """Add a run of ``task`` with ``params`` to the batch (a task object, flushed, not committed).

        ``task`` is a registered task, one with options (``task.using(...)``)
        or a registered name.  `BatchClosed` once the batch is closed, with
        nothing written.
        """
        name, options = _task_and_options(task)
        return self._queue.enqueue(self.session, name, params, **options, batch=self.id)

    def enqueue_many(
        self,
        task: RegisteredTask[Any, Any] | TaskWithOptions | str,
        params_list: Iterable[dict[str, Any] | None],
        /,
        *,
        chunk_size: int = 1000,
    ) -> Any:
        """Add one run of ``task`` per params dict to the batch, as `TaskQueue.enqueue_many` writes them.

        The batch counts them with one UPDATE, whatever their number.
        """
        name, options = _task_and_options(task)
        return self._queue.enqueue_many(
            self.session, name, params_list, **options, chunk_size=chunk_size, batch=self.id
        )

    def add(self, row: TaskMixin) -> Any:
        """Add a task row the application built (``Task(name=..., params=...)``) to the batch and flush it.

        The row's ``batch_id`` is set to this batch's; a row already in
        another batch is refused.
        """
        if not isinstance(row, TaskMixin):
            raise TypeError(f"add takes a task row (a TaskMixin), got {type(row).__name__}")
        if inspect(row).persistent:
            raise ValueError(f"task {row.id} is already enqueued: a task joins a batch when it is enqueued")
        current = row.batch_id
        if current is not None and current != self.id:
            raise ValueError(f"this task row is already in batch {current}, not batch {self.id}")
        row.batch_id = self.id

        def add(session: Session) -> TaskMixin:
            session.add(row)
            session.flush()
            return row

        return self._queue._in_session(self.session, add, f"the add of a task to batch {self.id}")

    def close(self) -> Any:
        """Close the batch in the session's transaction: no more members; True if that finished it.

        When every member has already finished, the close finishes the batch
        and enqueues its callbacks, in the same transaction.  Closing a closed
        batch changes nothing (and returns False).
        """
        queue = self._queue
        return queue._in_session(
            self.session, lambda s: queue._close_batch(s, self.id), f"the close of batch {self.id}"
        )

    def state(self) -> Any:
        """The batch's counts and times as this session sees them (its uncommitted members included)."""
        queue = self._queue
        return queue._in_session(
            self.session, lambda s: queue._read_batch(s, self.id), f"the read of batch {self.id}"
        )

    def __enter__(self) -> Batch:
        if is_async_session(self.session):
            # A plain ``with`` cannot await the close: the batch would stay open, its callbacks never run.
            raise TypeError("a batch opened on an AsyncSession closes with `async with`, not `with`")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()

    async def __aenter__(self) -> Batch:
        if not is_async_session(self.session):
            raise TypeError("a batch opened on a Session closes with `with`, not `async with`")
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            await self.close()

    def __repr__(self) -> str:
        named = f" {self.name!r}" if self.name is not None else ""
        return f"<Batch {self.id}{named}>"


class BatchOperations:
    """`TaskQueue`'s batches: open one, fetch one, read their state (this class is not used on its own)."""

    table: Table
    engine: Engine
    clock: Callable[[], datetime]
    _parts: QueueParts
    _enqueuing: Enqueuing
    #: The queue's own enqueues (`TaskQueue.enqueue`, `TaskQueue.enqueue_many`), which members go through.
    enqueue: Callable[..., Any]
    enqueue_many: Callable[..., Any]

    def batch(
        self,
        session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any],
        name: str | None = None,
        *,
        on_success: Callback | None = None,
        on_failure: Callback | None = None,
        on_complete: Callback | None = None,
    ) -> Batch | Coroutine[Any, Any, Batch]:
        """Open a batch in the caller's transaction: add members, close it, and its callbacks run once.

        ``on_success`` is enqueued when every member completed,
        ``on_failure`` when the batch finished with any member failed or
        cancelled, ``on_complete`` either way: each is a registered task,
        ``task.using(...)`` (its queue, priority, max_attempts, delay) or
        ``(task, {params})``, and is given one more param, ``batch``: the
        batch's id, name and counts (a `BatchSummary` where the function
        annotates it so, else a dict).  Callbacks are checked here.

        Returns a `Batch` bound to ``session``: ``b.enqueue(task, **params)``
        adds a member, ``b.close()`` closes it (``with queue.batch(...) as b:``
        closes it at the end of the block).  The batch exists when the
        caller's transaction commits.  With an `AsyncSession`, a coroutine to
        await for the `Batch`.  See `sa_taskqueue.features.workflows.batches`
        for what is exact and why.
        """
        name = check_name(name)
        specs = callback_specs(
            {"success": on_success, "failure": on_failure, "complete": on_complete},
            self._enqueuing.task_values,
        )
        now = self.clock()

        def create(sync_session: Session) -> Batch:
            connection = sync_session.connection(bind_arguments={"clause": self.table})
            with self._parts.database_errors():
                batch_id = batch_rows.create(connection, self.table, name, specs, now)
            return Batch(self, session, batch_id, name)

        return cast("Batch | Coroutine[Any, Any, Batch]", self._in_session(session, create, "the batch"))

    def get_batch(
        self, session: Session | scoped_session[Any] | AsyncSession | async_scoped_session[Any], batch_id: int
    ) -> Batch | Coroutine[Any, Any, Batch]:
        """A handle on batch ``batch_id`` bound to ``session``: to add members later, or close it.

        `BatchNotFound` if there is no such batch.
        """
        batch_id = check_batch_id(batch_id)

        def fetch(sync_session: Session) -> Batch:
            state = self._read_batch(sync_session, batch_id)
            return Batch(self, session, batch_id, state.name)

        return cast("Batch | Coroutine[Any, Any, Batch]", self._in_session(session, fetch, "the batch"))

    def batch_state(self, batch_id: int) -> BatchState:
        """Batch ``batch_id`` as committed now: counts, pending members, times, status, callbacks.

        `BatchNotFound` if there is no such batch.
        """
        batch_id = check_batch_id(batch_id)

        def read() -> BatchState | None:
            with self.engine.connect() as connection:
                return batch_rows.read(connection, self.table, batch_id)

        with self._parts.database_errors():
            state = self._parts.call(read)
        if state is None:
            raise BatchNotFound(batch_id)
        return state

    def batches(
        self, *, limit: int = 50, before: int | None = None, unfinished: bool = False
    ) -> list[BatchState]:
        """Up to ``limit`` batches, newest first: ids below ``before``; ``unfinished``: not finished yet."""
        validation.check_positive_int("limit", limit)
        below = None if before is None else check_batch_id(before)

        def read() -> list[BatchState]:
            with self.engine.connect() as connection:
                return batch_rows.listing(
                    connection, self.table, limit=limit, before=below, unfinished=unfinished
                )

        with self._parts.database_errors():
            return self._parts.call(read)

    def _in_session(self, session: Any, work: Callable[[Session], T], what: str) -> Any:
        """``work(sync_session)`` in the caller's session: now, or as a coroutine for an async session."""
        if is_async_session(session):
            return EnqueueCoroutine(in_async_session(session, work), what)
        return work(cast("Session", session))

    def _close_batch(self, session: Session, batch_id: int) -> bool:
        connection = session.connection(bind_arguments={"clause": self.table})
        with self._parts.database_errors():
            return batch_rows.close(connection, self.table, batch_id, self.clock())

    def _read_batch(self, session: Session, batch_id: int) -> BatchState:
        connection = session.connection(bind_arguments={"clause": self.table})
        with self._parts.database_errors():
            state = batch_rows.read(connection, self.table, batch_id)
        if state is None:
            raise BatchNotFound(batch_id)
        return state


def _task_and_options(task: RegisteredTask[Any, Any] | TaskWithOptions | str) -> tuple[str, dict[str, Any]]:
    """The registered name and the per-call options an enqueue of ``task`` passes to the queue."""
    if isinstance(task, str):
        return task, {}
    if isinstance(task, RegisteredTask):
        return task.name, {}
    if isinstance(task, TaskWithOptions):
        return task.task.name, task.options()
    raise TypeError(
        f"a batch member is a registered task, task.using(...) or a name, got {type(task).__name__}"
    )


def callback_specs(
    callbacks: Mapping[Outcome, Callback | None],
    task_values: Callable[..., dict[str, Any]],
) -> list[CallbackSpec]:
    """Each callback's stored form, checked now: a bad one fails ``queue.batch``, not a worker.

    ``task_values`` is the queue's check of one enqueue (name, params,
    options); the params are checked with a ``batch`` param added, as the
    callback will be called.
    """
    specs: list[CallbackSpec] = []
    for on, callback in callbacks.items():
        if callback is None:
            continue
        what = f"on_{on}"
        params: Mapping[str, Any] = {}
        target: Any = callback
        if isinstance(callback, TaskCall):
            target, params = callback.task, callback.params
        elif isinstance(callback, tuple):
            if len(callback) != 2 or not isinstance(callback[1], Mapping):
                raise TypeError(
                    f"{what}: give a task, task.using(...), task.call(...) or (task, {{params}}), "
                    f"got {callback!r}"
                )
            target, params = callback
        if isinstance(target, RegisteredTask):
            task, options = target, None
        elif isinstance(target, TaskWithOptions):
            task, options = target.task, target
        else:
            raise TypeError(
                f"{what}: a callback is a registered task, task.using(...), task.call(...) "
                f"or (task, {{params}}), got {type(target).__name__}"
            )
        if BATCH_PARAM in params:
            raise ValueError(f"{what}: the param {BATCH_PARAM!r} is the batch's own (its id and counts)")
        if task.options.unique_by is not None or (options is not None and options.unique_key is not None):
            raise ValueError(
                f"{what}: task {task.name!r} has a unique key; a callback cannot: a held key would fail "
                "the completion of the batch's last member"
            )
        if options is not None and options.run_at is not None:
            raise ValueError(
                f"{what}: a callback runs when its batch finishes; give it a delay, not a run_at"
            )
        probe = {**dict(params), BATCH_PARAM: {}}
        values = task_values(
            task.name,
            probe,
            None if options is None else options.queue_name,
            None if options is None else options.priority,
            None,
            None if options is None else options.max_attempts,
        )
        stored = dict(values["params"])
        stored.pop(BATCH_PARAM, None)
        delay = None if options is None or options.delay is None else options.delay / timedelta(seconds=1)
        specs.append(
            CallbackSpec(
                on=on,
                name=task.name,
                queue=values["queue"],
                priority=values["priority"],
                max_attempts=values["max_attempts"],
                params=stored,
                delay=delay,
                concurrency_key=values.get("concurrency_key"),
                headers=values.get("headers"),
            )
        )
    return specs


def check_name(name: str | None) -> str | None:
    """A batch's name: None or a string of at most 255 characters."""
    if name is None:
        return None
    validation.check_text("name", name, 255)
    return name


__all__ = ["Batch", "BatchOperations", "Callback", "callback_specs", "check_name"]
