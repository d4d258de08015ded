"""What a running task can learn of its own run: `current_task`, its cancellation and its progress.

A worker sets the context before it calls the task's function (on the
slot's thread, inside the coroutine of an ``async def`` task, and, copied by
the fork, in a task process), so that code deep inside a task can ask
whether it was cancelled, or report its progress, without the worker
passing anything down.  In a task process the reports go to the worker
through the process's pipe (`sa_taskqueue.worker.execution`), and are
written there like any other.
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Callable
from typing import Any

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.validation import check_result


class CancellationRequested(BaseException):
    """Someone cancelled the running task: raised by `TaskContext.raise_if_cancelled`.

    A `BaseException`, as `asyncio.CancelledError` is, so that a task's own
    ``except Exception`` (a retry loop, a logger) does not swallow it: the
    task stops and is recorded CANCELLED.
    """

    def __init__(self, task_id: int) -> None:
        super().__init__(f"task {task_id} was cancelled while it ran")
        self.task_id = task_id


#: Writes a progress report: (task, progress, note); it must not block the task.
ProgressSink = Callable[[ClaimedTask, float, Any], None]
#: Reads the results of a task's parents, by parent id (`TaskQueue.parent_results`).
ParentResults = Callable[[int], dict[int, Any]]


class TaskContext:
    """The running task's view of its own run, from `current_task`.

    ``cancel_requested`` turns True once the worker has learnt of a cancel
    (within one heartbeat, at once on PostgreSQL); a loop checks it, or
    calls `raise_if_cancelled`, between steps.
    """

    def __init__(
        self, task: ClaimedTask, progress: ProgressSink | None, parents: ParentResults | None = None
    ) -> None:
        self.task = task
        self._cancelled = threading.Event()
        self._progress = progress
        self._parents = parents

    @property
    def task_id(self) -> int:
        return self.task.id

    @property
    def cancel_requested(self) -> bool:
        """Whether the task was cancelled while it runs: it should stop soon."""
        return self._cancelled.is_set()

    def request_cancel(self) -> None:
        """The worker's side: the task was cancelled."""
        self._cancelled.set()

    def raise_if_cancelled(self) -> None:
        """Raise `CancellationRequested` if the task was cancelled: a cooperative check for loops."""
        if self._cancelled.is_set():
            raise CancellationRequested(self.task.id)

    def report(self, progress: float, note: Any = None) -> None:
        """Record how far the task has come (0 to 1) and an optional JSON ``note``; it returns at once.

        The worker writes the last report of each task at most once a second,
        in the background, and only while it still holds the task's lease:
        a report never holds up the task, and one from a run that lost its
        task is never written.
        """
        if isinstance(progress, bool) or not isinstance(progress, (int, float)):
            raise TypeError(f"progress must be a number from 0 to 1, got {progress!r}")
        if math.isnan(progress) or not 0.0 <= progress <= 1.0:
            raise ValueError(f"progress must be from 0 to 1, got {progress!r}")
        check_result(note, "progress note")
        if self._progress is None:
            raise RuntimeError(f"task {self.task.id}: progress cannot be reported here (no worker writes it)")
        self._progress(self.task, float(progress), note)

    def parent_results(self) -> dict[int, Any]:
        """The results of the tasks this one was enqueued to wait for (``depends_on``), by their ids.

        Read from the database when asked (one SELECT), so a task that never
        asks pays nothing.  A parent that failed or was cancelled (the task
        then runs only under ``on_parent_failure="run"``) has None.  Empty
        for a task without parents.  A blocking call: an ``async def`` task
        calls it through ``await asyncio.to_thread(...)``.
        """
        if self._parents is None:
            raise RuntimeError(f"task {self.task.id}: its parents' results cannot be read here (no worker)")
        return self._parents(self.task.id)

    def parent_result(self) -> Any:
        """The result of this task's one parent: a chain step's input (`TaskQueue.chain`).

        `ValueError` if the task has no parent or several (read them with `parent_results`).
        """
        results = self.parent_results()
        if len(results) != 1:
            raise ValueError(
                f"task {self.task.id} has {len(results)} parents; parent_result() reads the one parent "
                "of a chain step: use parent_results() for several"
            )
        return next(iter(results.values()))

    def send_progress_to(self, progress: ProgressSink | None) -> None:
        """Reports go to ``progress`` from now on (a task process: to the pipe back to its worker)."""
        self._progress = progress


_CURRENT: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar(
    "sa_taskqueue_current_task", default=None
)


def current_task() -> TaskContext:
    """The running task's `TaskContext`; `RuntimeError` outside a task a worker runs."""
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError("current_task() is only available inside a task run by a worker")
    return context


def set_current(context: TaskContext | None) -> contextvars.Token[TaskContext | None]:
    """Make ``context`` the current task's (the worker, before it calls the task)."""
    return _CURRENT.set(context)


def reset_current(token: contextvars.Token[TaskContext | None]) -> None:
    _CURRENT.reset(token)


__all__ = [
    "CancellationRequested",
    "ParentResults",
    "ProgressSink",
    "TaskContext",
    "current_task",
    "reset_current",
    "set_current",
]
