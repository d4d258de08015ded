"""Writing the progress running tasks report, in the background, at most once a second per task.

`TaskContext.report` only leaves the report here and returns: the task is
never held up by the database.  A thread of the worker's writes, for each
task, the last report left (earlier ones are dropped unwritten), no sooner
than ``interval`` after the task's previous write.  Each write is fenced
like every outcome (`sa_taskqueue.features.cancellation.write_progress`): a
worker that lost a task's lease writes nothing of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.features.cancellation import write_progress
from sa_taskqueue.worker.ports import WorkerQueue

logger = logging.getLogger("sa_taskqueue")

#: The least time between two progress writes of one task, in seconds.
PROGRESS_INTERVAL = 1.0


@dataclass
class _Pending:
    task: ClaimedTask
    progress: float
    note: Any


class ProgressWriter:
    """Coalesces each task's progress reports and writes the last one at most once per ``interval``.

    ``clock`` is monotonic seconds (injectable, for tests about time).  Call
    `start` for the background thread; `write_due` is one round of it.
    """

    def __init__(
        self,
        queue: WorkerQueue,
        *,
        interval: float = PROGRESS_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.interval = interval
        self.clock = clock
        self._lock = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._last_write: dict[int, float] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: How many reports were written, and how many the fence refused (a lost lease).
        self.written = 0
        self.refused = 0

    def report(self, task: ClaimedTask, progress: float, note: Any) -> None:
        """Leave ``task``'s latest report to be written; returns at once."""
        with self._lock:
            self._pending[task.id] = _Pending(task, progress, note)
            self._lock.notify()

    def forget(self, task: ClaimedTask) -> None:
        """The task's run is over: its unwritten report is dropped with its bookkeeping."""
        with self._lock:
            self._pending.pop(task.id, None)
            self._last_write.pop(task.id, None)

    def write_due(self) -> float | None:
        """Write every report whose task's last write is ``interval`` old; seconds until the next is due."""
        now = self.clock()
        with self._lock:
            due = [
                pending
                for task_id, pending in self._pending.items()
                if now - self._last_write.get(task_id, -self.interval) >= self.interval
            ]
            for pending in due:
                del self._pending[pending.task.id]
                self._last_write[pending.task.id] = now
            later = [self._last_write[task_id] + self.interval - now for task_id in self._pending]
        for pending in due:
            self._write(pending)
        return max(0.0, min(later)) if later else None

    def _write(self, pending: _Pending) -> None:
        queue = self.queue
        try:
            wrote = write_progress(
                queue.strategy,
                queue.engine,
                queue.table,
                pending.task,
                pending.progress,
                pending.note,
                queue.clock(),
            )
        except Exception as error:  # noqa: BLE001 - progress is a hint: a failed write is logged, not retried
            logger.warning("task %d: its progress could not be written: %s", pending.task.id, error)
            return
        if wrote:
            self.written += 1
        else:
            self.refused += 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sa_taskqueue-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        while True:
            wait = self.write_due()
            with self._lock:
                if self._stopped:
                    return
                if not self._pending:
                    self._lock.wait()
                elif wait is not None and wait > 0:
                    self._lock.wait(wait)


__all__ = ["PROGRESS_INTERVAL", "ProgressWriter"]
