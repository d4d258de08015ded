"""The outcome writer: writes each task's success or failure, many in one statement, through outages.

A success (or a failure) waits up to the completion delay for the others
the worker has claimed, so that they go in one statement
(`sa_taskqueue.worker.completions`).  Each outcome's event, SUCCEEDED, or
FAILED or RETRIED, is emitted once it is written, never before.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.events import EventKind
from sa_taskqueue.core.exceptions import DatabaseError, DatabaseUnavailable
from sa_taskqueue.worker.claim_loop import CONFLICT_PAUSE, ClaimLoop
from sa_taskqueue.worker.completions import Completions
from sa_taskqueue.worker.execution import Outcome
from sa_taskqueue.worker.lifecycle import Emitter
from sa_taskqueue.worker.outages import Outages
from sa_taskqueue.worker.ports import WorkerQueue
from sa_taskqueue.worker.slots import Slot, WorkerState, ids

logger = logging.getLogger("sa_taskqueue")

T = TypeVar("T")


def failure_kind(task: ClaimedTask) -> EventKind:
    """RETRIED or FAILED: what the queue's `fail` wrote, told from the claimed task without a query.

    The worker always fails with ``retry=True``, so the row is queued again
    exactly when the task is not malformed and ``attempts < max_attempts``.
    """
    if task.malformed is None and task.attempts < task.max_attempts:
        return EventKind.RETRIED
    return EventKind.FAILED


class OutcomeWriter:
    """Writes outcomes for the slots, frees them once written, and emits what was written."""

    def __init__(
        self,
        queue: WorkerQueue,
        state: WorkerState,
        claims: ClaimLoop,
        outages: Outages,
        emit: Emitter,
        *,
        completion_delay: float,
    ) -> None:
        self.queue = queue
        self.state = state
        self.claims = claims
        self.outages = outages
        self.emit = emit
        #: What a write of one task at a time (a batch refused as a whole) wrote, by ``id()`` of the task.
        self._written_alone: dict[int, EventKind] = {}
        self.completions = Completions(
            self._write_successes,
            self._write_success_alone,
            delay=completion_delay,
            fail_many=self._write_failures,
            fail_one=self._write_failure_alone,
            after_write=claims.admit_claimed_with_write,
        )

    def no_success(self, slot: Slot) -> None:
        """The task has no success for the batch to wait for (once per task claimed)."""
        if not slot.reported:
            slot.reported = True
            self.completions.end_without_success()

    def write(self, slot: Slot, result: Any, error: BaseException | str | None, *, wait: bool) -> None:
        """Record a success (or, given ``error``, a failure) in one statement with others' ending meanwhile.

        Without ``wait`` the outcome is handed over and the slot's thread
        moves on at once: the slot is freed, and the event emitted, when the
        write is done, on the thread that wrote it.  With ``wait`` this
        returns once it is written, the event emitted on this thread (where
        the hooks want it).
        """
        task = slot.task
        slot.reported = True
        slot.completing = True
        if not wait:
            slot.handed_off = True
            self.completions.hand_off(task, result, partial(self._written, slot, result, error), error=error)
            return
        try:
            try:
                recorded = self.completions.record(task, result, error=error)
            finally:
                slot.writing = False
        finally:
            slot.completing = False
            self.state.wake.set()  # the loop may be waiting for this write before it claims
        self._announce(slot, result, error, recorded)

    def _written(
        self, slot: Slot, result: Any, error: BaseException | str | None, recorded: bool | None
    ) -> None:
        """An outcome handed over is written (on whichever thread wrote it): emit it, free its slot."""
        slot.writing = False
        slot.completing = False
        self._announce(slot, result, error, recorded)
        self.claims.free(slot)

    def _announce(
        self, slot: Slot, result: Any, error: BaseException | str | None, recorded: bool | None
    ) -> None:
        task = slot.task
        alone = self._written_alone.pop(id(task), None)
        if recorded is False:
            logger.warning("task %d %s: outcome not recorded, the task was taken over", *ids(task))
            self.emit.task(EventKind.LEASE_LOST, task, duration=slot.duration)
            return
        if recorded:
            kind = EventKind.SUCCEEDED if error is None else failure_kind(task)
        elif alone is not None:
            kind = alone  # (written on its own: the batch was refused as a whole)
        else:
            return
        self.announce(slot, kind, result)

    def announce(self, slot: Slot, kind: EventKind, result: Any = None) -> None:
        """Emit the written outcome of ``slot``'s run."""
        if kind is EventKind.SUCCEEDED:
            self.emit.task(kind, slot.task, duration=slot.duration, result=result)
        else:
            self.emit.task(kind, slot.task, duration=slot.duration, error=slot.error)

    def _write_successes(self, tasks: Sequence[ClaimedTask], results: Sequence[Any]) -> set[int] | None:
        claim = self.claims.claim_with_write(tasks)
        if claim is None:
            self.claims.writing(tasks)
            return self._through_outage(
                self.emit.timed("complete", lambda: self.queue.complete_many(tasks, results)),
                tasks,
                partial(self._all_landed, tasks, completed=True),
            )
        number, limit, free_now = claim
        sent_at = [time.monotonic()]
        claimed: list[ClaimedTask] = []

        def complete_and_claim() -> set[int]:
            sent_at[0] = time.monotonic()  # (each try through an outage claims afresh)
            written, claimed[:] = self.queue.complete_many_and_claim(
                tasks,
                results,
                limit=limit,
                queues=self.claims.queues,
                worker_id=self.state.worker_id,
                names=self.queue.task_names,
            )
            return written

        try:
            return self._through_outage(
                self.emit.timed("complete_and_claim", complete_and_claim),
                tasks,
                partial(self._all_landed, tasks, completed=True),
            )
        finally:
            # Given to slots once this write's slots are freed (`ClaimLoop.admit_claimed_with_write`).
            self.claims.claimed_with_write = (claimed, sent_at[0], number, free_now)

    def _write_failures(
        self, tasks: Sequence[ClaimedTask], errors: Sequence[BaseException | str]
    ) -> set[int] | None:
        self.claims.writing(tasks)
        return self._through_outage(
            self.emit.timed("fail", lambda: self.queue.fail_many(tasks, errors)),
            tasks,
            partial(self._all_landed, tasks, completed=False),
        )

    def _all_landed(self, tasks: Sequence[ClaimedTask], written: set[int], *, completed: bool) -> set[int]:
        return written | {
            task.id
            for task in tasks
            if task.id not in written and self.queue.outcome_written(task, completed=completed)
        }

    def _write_success_alone(self, task: ClaimedTask, result: Any) -> None:
        kind = self.record(task, Outcome(result=result))
        if kind is not None:
            self._written_alone[id(task)] = kind

    def _write_failure_alone(self, task: ClaimedTask, error: BaseException | str) -> None:
        kind = self.record_failure(task, error)
        if kind is not None:
            self._written_alone[id(task)] = kind

    def record(self, task: ClaimedTask, outcome: Outcome) -> EventKind | None:
        """Write the outcome of one task on its own: completed, or failed; what was written, if anything."""
        if outcome.error is not None:
            return self.record_failure(task, outcome.error_text or outcome.error)
        try:
            recorded = self._through_outage(
                partial(self.queue.complete, task, outcome.result),
                [task],
                partial(self._landed, task, completed=True),
            )
        except TypeError as error:
            # A result that cannot be stored (not JSON): the run failed as
            # far as anyone reading the row can tell.
            return self.record_failure(task, error)
        except DatabaseError as error:
            # The database refused the result itself (e.g. NaN in JSON).
            logger.warning("task %d %s: its result cannot be stored: %s", *ids(task), error)
            return self.record_failure(task, error)
        if recorded is False:
            logger.warning("task %d %s: outcome not recorded, the task was taken over", *ids(task))
        return EventKind.SUCCEEDED if recorded else None

    def record_failure(self, task: ClaimedTask, error: BaseException | str) -> EventKind | None:
        """Write one task's failure on its own: retried later, or failed for good."""
        try:
            recorded = self._through_outage(
                partial(self.queue.fail, task, error),
                [task],
                partial(self._landed, task, completed=False),
            )
        except DatabaseError:
            logger.exception("task %d %s: could not record the failure", *ids(task))
            return None
        if recorded is False:
            logger.warning("task %d %s: outcome not recorded, the task was taken over", *ids(task))
        return failure_kind(task) if recorded else None

    def give_back(self, task: ClaimedTask) -> bool:
        """Queue ``task`` again, its attempt not counted, through an outage; whether it was.

        False if it was taken over meanwhile, or the database stayed away
        past the lease (the lease then gives it back).
        """
        try:
            released = self._through_outage(
                partial(self.queue.release, task), [task], partial(self._landed, task, completed=False)
            )
        except DatabaseError:
            logger.exception("task %d %s: could not give it back; its lease will", *ids(task))
            return False
        return bool(released)

    def _landed(self, task: ClaimedTask, written: bool, *, completed: bool) -> bool:
        return written or self.queue.outcome_written(task, completed=completed)

    def _through_outage(
        self, write: Callable[[], T], tasks: Sequence[ClaimedTask], landed: Callable[[T], T]
    ) -> T | None:
        """``write()``, retried through a database outage while a lease lasts; None if it never got through.

        Giving up early would run the tasks again after their lease: at least
        once, but needlessly twice.  A write whose connection broke may have
        committed all the same, and then its retry finds the tasks no longer
        held: ``landed`` corrects what the retry reports by reading the rows.
        """
        retried = False
        backoff = 0.25
        # Past one lease from now the write would be refused anyway.
        give_up_at = time.monotonic() + self.queue.lease.total_seconds()
        while True:
            try:
                value = write()
            except DatabaseUnavailable as error:
                conflict = self.outages.certification_conflict(error)
                self.outages.trouble(error, backoff)
                if time.monotonic() > give_up_at or self.state.stopped.is_set():
                    for task in tasks:
                        logger.error("task %d %s: outcome not recorded; it will run again", *ids(task))
                    return None
                if conflict:
                    # Another node wrote one of these rows first (Galera): the
                    # write goes again at once, with no backing off as from an outage.
                    time.sleep(random.uniform(0.0, CONFLICT_PAUSE))
                else:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                retried = True
                continue
            self.outages.back()
            return landed(value) if retried else value


__all__ = ["OutcomeWriter", "failure_kind"]
