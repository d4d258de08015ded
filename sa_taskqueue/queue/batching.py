"""`Batch`: the handle ``queue.batch(...)`` returns, and how a queue turns callbacks into stored specs.

A batch's SQL and its exactly-once finish are `sa_taskqueue.features.workflows.batches`';
this module is what the application holds: the batch's id and the session
it adds members in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import inspect
from sqlalchemy.orm import Session

from sa_taskqueue.core import validation
from sa_taskqueue.core.model import TaskMixin
from sa_taskqueue.core.registered import RegisteredTask, TaskWithOptions
from sa_taskqueue.features.workflows.batches import BATCH_PARAM, CallbackSpec, Outcome

if TYPE_CHECKING:
    from sa_taskqueue.queue.task_queue import TaskQueue

T = TypeVar("T")

#: A batch's callback: a registered task, the same with options (``task.using(queue="ops")``),
#: or either with extra params: ``(task, {"channel": "#ops"})``.
Callback = (
    RegisteredTask[Any, Any]
    | TaskWithOptions
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

    def __init__(self, queue: TaskQueue, session: Any, batch_id: int, name: str | None) -> None:
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
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()

    def __repr__(self) -> str:
        named = f" {self.name!r}" if self.name is not None else ""
        return f"<Batch {self.id}{named}>"


def _task_and_options(task: RegisteredTask[Any, Any] | TaskWithOptions | str) -> tuple[str, dict[str, Any]]:
    """The registered name and the per-call options an enqueue of ``task`` passes to the queue."""
    if isinstance(task, str):
        return task, {}
    if isinstance(task, RegisteredTask):
        return task.name, {}
    if isinstance(task, TaskWithOptions):
        return task.task.name, {
            "queue": task.queue_name,
            "priority": task.priority,
            "run_at": task.due(),
            "max_attempts": task.max_attempts,
            "unique_key": task.unique_key,
        }
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
        if isinstance(callback, tuple):
            if len(callback) != 2 or not isinstance(callback[1], Mapping):
                raise TypeError(
                    f"{what}: give a task, task.using(...), or (task, {{params}}), got {callback!r}"
                )
            target, params = callback
        if isinstance(target, RegisteredTask):
            task, options = target, None
        elif isinstance(target, TaskWithOptions):
            task, options = target.task, target
        else:
            raise TypeError(
                f"{what}: a callback is a registered task, task.using(...) or (task, {{params}}), "
                f"got {type(target).__name__}"
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


__all__ = ["Batch", "Callback", "callback_specs", "check_name"]
