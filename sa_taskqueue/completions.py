"""`Completions`: successes that finish together are written in one statement.

A worker's slots finish tasks independently.  Writing each success on its own
costs a statement per task; writing them together costs one per batch.  A
success waits, at most ``delay`` seconds, for the tasks still running in the
worker's other slots, so that a claimed batch of quick tasks is written in
one statement rather than in as many as their ends happen to straddle; it
never waits once no other slot runs a task, so a lone slot writes at once.
While one statement is on its way, the successes finishing behind it gather
into the next.  A slot is freed only once its own outcome is written, so a
freed slot always means a recorded outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sa_taskqueue.claimed import ClaimedTask

logger = logging.getLogger("sa_taskqueue")

#: Writes many successes; the ids it wrote, or None if it could not get through at all.
WriteMany = Callable[[Sequence[ClaimedTask], Sequence[Any]], set[int] | None]
#: Writes one success on its own; used for a batch whose common write failed.
WriteOne = Callable[[ClaimedTask, Any], None]


@dataclass
class _Waiting:
    """A success waiting to be written, and whether it was (None: not written at all)."""

    task: ClaimedTask
    result: Any
    recorded: bool | None = None
    written: bool = False


class Completions:
    """Gathers the successes of a worker's slots into shared statements.

    The worker says when a slot starts a task (`begin`) and when it ends
    without a success to write (`end_without_success`); `record` ends it
    with one.  The tasks begun and not ended are the successes that may
    still join a batch.  ``delay`` bounds how long a success waits for them;
    0 writes each batch as soon as no write is under way.
    """

    def __init__(
        self,
        write_many: WriteMany,
        write_one: WriteOne,
        *,
        delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not delay >= 0:
            raise ValueError(f"the completion delay must not be negative, got {delay!r}")
        self._write_many = write_many
        self._write_one = write_one
        self._delay = delay
        self._clock = clock
        self._waiting: list[_Waiting] = []
        self._since: float | None = None  # when the oldest success waiting arrived
        self._running = 0  # tasks begun whose outcome is not known yet
        self._writing = False
        self._changed = threading.Condition()

    def begin(self) -> None:
        """A slot has started a task: a success that may join the next batch."""
        with self._changed:
            self._running += 1

    def end_without_success(self) -> None:
        """A task begun has ended without a success to write (it failed, or was given back)."""
        with self._changed:
            self._end_locked()

    def record(self, task: ClaimedTask, result: Any) -> bool | None:
        """End a task begun with its success; write it, with whatever else is waiting; return once written.

        True if it was recorded, False if the task had been taken over (its
        claim no longer held it), None if the database could not be reached
        for as long as the lease lasted, or the batch fell back to one write
        per task (which reports for itself).
        """
        waiting = _Waiting(task, result)
        with self._changed:
            self._waiting.append(waiting)
            if self._since is None:
                self._since = self._clock()
            self._end_locked()
            while not waiting.written:
                wait_for = None if self._writing else self._time_left()
                if wait_for == 0:
                    self._write_waiting()
                    continue
                self._changed.wait(wait_for)
        return waiting.recorded

    def _end_locked(self) -> None:
        self._running = max(self._running - 1, 0)
        if self._running == 0 and self._waiting:
            self._changed.notify_all()  # nothing else can join: the batch may go

    def _time_left(self) -> float | None:
        """How long the successes waiting may wait still (0: write now; None: nothing waits)."""
        if self._since is None:
            return None
        if self._running == 0:
            return 0.0
        return max(self._since + self._delay - self._clock(), 0.0)

    def _write_waiting(self) -> None:
        """Write every success waiting, outside the lock (called under it; returns under it)."""
        batch, self._waiting, self._since = self._waiting, [], None
        self._writing = True
        self._changed.release()
        try:
            self._write_batch(batch)
        finally:
            self._changed.acquire()
            self._writing = False
            for item in batch:
                item.written = True
            self._changed.notify_all()

    def _write_batch(self, batch: list[_Waiting]) -> None:
        tasks = [item.task for item in batch]
        try:
            written = self._write_many(tasks, [item.result for item in batch])
            for item in batch:
                item.recorded = None if written is None else item.task.id in written
        except Exception:
            # The database refused a result, or something else went wrong
            # with the statement: each on its own, so only what fails fails.
            logger.debug("writing %d completions together failed; one by one", len(batch), exc_info=True)
            for item in batch:
                try:
                    self._write_one(item.task, item.result)
                except Exception:
                    logger.exception("task %d %s: could not record its outcome", item.task.id, item.task.name)


__all__ = ["Completions"]
