"""`TaskQueue.cancel`, `cancel_task` and `progress`: the control of running work.

Kept apart from the queue's other methods; the work is done in
`sa_taskqueue.features.cancellation`, and by the worker holding a running
task (`sa_taskqueue.worker.cancelling`, `sa_taskqueue.worker.progress`).
"""

from __future__ import annotations

from sa_taskqueue.core.events import EventStream
from sa_taskqueue.features.cancellation import (
    DEFAULT_CANCELLED_BY,
    CancelResult,
    TaskProgress,
    read_progress,
)
from sa_taskqueue.features.cancellation import cancel as request_cancel
from sa_taskqueue.queue.parts import QueueParts


class RunningTaskControl:
    """`TaskQueue`'s cancels and progress reading (this class is not used on its own)."""

    _parts: QueueParts
    events: EventStream

    def cancel(self, task_id: int, *, by: str = DEFAULT_CANCELLED_BY) -> bool:
        """Cancel a queued task at once, a running one through its worker; False if finished or missing."""
        return self.cancel_task(task_id, by=by).cancelled

    def cancel_task(self, task_id: int, *, by: str = DEFAULT_CANCELLED_BY) -> CancelResult:
        """Cancel task ``task_id``, recording ``by`` as who did; what it found, in `CancelResult.state`.

        A queued task, or one waiting for its parents, is CANCELLED at once
        and never runs; its dependents are cancelled with it (unless
        enqueued with ``on_parent_failure="run"``).  For a running
        one the request is recorded: the worker holding it learns of it
        within one heartbeat (at once on PostgreSQL), stops it, and writes
        CANCELLED unless the task's own outcome was written first.  A
        finished or missing task is left alone.
        """
        return request_cancel(self._parts, self.events, task_id, by)

    def progress(self, task_id: int) -> TaskProgress | None:
        """The last progress task ``task_id`` reported (``current_task().report``); None if none."""
        return read_progress(self._parts, task_id)


__all__ = ["RunningTaskControl"]
