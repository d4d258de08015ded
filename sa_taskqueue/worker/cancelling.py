"""Stopping the running tasks someone cancelled, once the worker learns of it.

The worker learns of a cancel from its heartbeat (one SELECT by primary key
of the tasks it holds, after the renewal) and, on PostgreSQL, at once from
the cancel channel its listener hears.  How a task is stopped depends on how
it runs:

- an ``async def`` task: its coroutine is cancelled, `asyncio.CancelledError`
  at its next ``await``;
- a sync task in a thread: a thread cannot be stopped, so its `TaskContext`
  says ``cancel_requested`` and `TaskContext.raise_if_cancelled` raises;
- a task process: SIGUSR1 raises `CancellationRequested` in it, and the
  process is killed once ``grace`` seconds have passed if it is still running.

Whatever stops it, the run's end is written CANCELLED by the fenced write
(`sa_taskqueue.features.cancellation.write_cancelled`).
"""

from __future__ import annotations

import logging
import time

from sa_taskqueue.core.exceptions import DatabaseUnavailable
from sa_taskqueue.features.cancellation import requested_cancels
from sa_taskqueue.worker.ports import WorkerQueue
from sa_taskqueue.worker.slots import Slot, WorkerState, ids

logger = logging.getLogger("sa_taskqueue")

#: Seconds a task process has, once cancelled, before it is killed.
DEFAULT_CANCEL_GRACE = 10.0


class Canceller:
    """Finds the cancelled tasks among those a worker runs, and stops them."""

    def __init__(self, queue: WorkerQueue, state: WorkerState, grace: float = DEFAULT_CANCEL_GRACE) -> None:
        self.queue = queue
        self.state = state
        self.grace = grace

    def check(self, slots: list[Slot]) -> None:
        """Read which of ``slots``' tasks were cancelled, and stop them (the heartbeat, the listener)."""
        waiting = [slot for slot in slots if not slot.cancel_requested and not slot.finished]
        if not waiting:
            return
        try:
            cancelled = requested_cancels(self.queue.engine, self.queue.table, [s.task.id for s in waiting])
        except DatabaseUnavailable:
            return  # the next heartbeat asks again
        except Exception:
            logger.exception("could not read the cancel requests of running tasks")
            return
        for slot in waiting:
            if slot.task.id in cancelled:
                self.stop(slot)

    def notified(self, payload: str) -> None:
        """A cancel was announced (PostgreSQL): check it at once if this worker runs that task."""
        try:
            task_id = int(payload)
        except ValueError:
            return
        self.check([slot for slot in self.state.running_slots() if slot.task.id == task_id])

    def stop(self, slot: Slot) -> None:
        """Stop ``slot``'s run as its kind of run allows (see the module's docstring)."""
        with slot.lock:
            if slot.cancel_requested or slot.given_back:
                return
            slot.cancel_requested = True
            if slot.context is not None:
                slot.context.request_cancel()
            if slot.coroutine is not None:
                slot.coroutine.cancel()  # CancelledError at its next await
            if slot.child is not None:
                slot.cancel_kill_at = time.monotonic() + self.grace
                slot.child.request_cancel()
        logger.info("task %d %s: cancelled while it ran; stopping it", *ids(slot.task))


__all__ = ["DEFAULT_CANCEL_GRACE", "Canceller"]
