"""`Completions`: successes that finish together are written in one statement.

A worker's slots finish tasks independently.  Writing each success on its own
costs a statement per task; writing them together costs one per batch.  No
slot waits on a timer for company: whichever slot finds no write under way
writes every success waiting, again and again until none is left, so while
one statement is on its way the slots finishing behind it gather into the
next.  A slot is freed only once its own outcome is written, so a freed slot
always means a recorded outcome.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    written: threading.Event = field(default_factory=threading.Event)


class Completions:
    """Gathers the successes of a worker's slots into shared statements."""

    def __init__(self, write_many: WriteMany, write_one: WriteOne) -> None:
        self._write_many = write_many
        self._write_one = write_one
        self._waiting: list[_Waiting] = []
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # held by the slot writing the successes waiting

    def record(self, task: ClaimedTask, result: Any) -> bool | None:
        """Write ``task``'s success, with whatever else is waiting; return once it is written.

        True if it was recorded, False if the task had been taken over (its
        claim no longer held it), None if the database could not be reached
        for as long as the lease lasted, or the batch fell back to one write
        per task (which reports for itself).
        """
        waiting = _Waiting(task, result)
        with self._lock:
            self._waiting.append(waiting)
        self._write_all()
        waiting.written.wait()
        return waiting.recorded

    def _write_all(self) -> None:
        while self._writing.acquire(blocking=False):
            try:
                while True:
                    with self._lock:
                        batch, self._waiting = self._waiting, []
                    if not batch:
                        break
                    self._write_batch(batch)
            finally:
                self._writing.release()
            # A slot may have added its success after the last look and before
            # the release, finding the write still under way.
            with self._lock:
                if not self._waiting:
                    return

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
        finally:
            for item in batch:
                item.written.set()


__all__ = ["Completions"]
