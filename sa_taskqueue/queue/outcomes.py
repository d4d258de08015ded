"""`Outcomes`: what a claim's holder writes of its tasks, each write fenced by the claim.

Completions, failures (retried with backoff while attempts remain),
releases, the completion a transactional task writes in its own
transaction, and lease renewals.  Each write changes a row only while the
claim that took it still holds it, and says whether it did; the SQL is the
strategy's.  The final writes of tasks in a batch or with dependents go
through the workflow bookkeeping (`sa_taskqueue.features.workflows.final_writes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from sa_taskqueue.core import validation
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.error_text import format_error
from sa_taskqueue.core.model import TaskStatus
from sa_taskqueue.core.registered import DEFAULT_RETRY_DELAY, RegisteredTask, retry_delay
from sa_taskqueue.features.workflows import final_writes
from sa_taskqueue.queue.parts import QueueParts
from sa_taskqueue.strategies.lease import LEASE_EXPIRED_ERROR


class Outcomes:
    """The fenced writes of one queue's claims."""

    def __init__(
        self,
        parts: QueueParts,
        tasks: Mapping[str, RegisteredTask[Any, Any]],
        max_retry_delay: Callable[[], timedelta],
    ) -> None:
        self._parts = parts
        self._tasks = tasks
        self._max_retry_delay = max_retry_delay

    def complete(self, claimed: ClaimedTask, result: Any) -> bool:
        validation.check_result(result)
        now = self._parts.clock()
        values = {"status": TaskStatus.COMPLETED, "finished_at": now, "locked_until": None, "result": result}
        return self.finish(claimed, values, now)

    def complete_many(self, tasks: list[ClaimedTask], values: list[Any]) -> set[int]:
        """``tasks`` (checked by `checked_completions`) completed with ``values`` in one statement."""
        if not tasks:
            return set()
        parts = self._parts
        now = parts.clock()
        strategy = parts.strategy
        with parts.database_errors():
            return parts.call(
                lambda: final_writes.complete_many(strategy, parts.engine, parts.table, tasks, values, now)
            )

    def complete_rerouted(self, tasks: list[ClaimedTask], values: list[Any], written: set[int]) -> set[int]:
        """Of plain ``tasks`` a completion did not write, those that gained dependents, completed now."""
        parts = self._parts
        now = parts.clock()
        strategy = parts.strategy
        with parts.database_errors():
            return parts.call(
                lambda: final_writes.complete_rerouted(
                    strategy, parts.engine, parts.table, tasks, values, now, written
                )
            )

    @staticmethod
    def checked_completions(
        claimed: Sequence[ClaimedTask], results: Sequence[Any] | None
    ) -> tuple[list[ClaimedTask], list[Any]]:
        """``claimed`` and ``results`` (all None if omitted) as lists, each task and result checked."""
        tasks = list(claimed)
        values = [None] * len(tasks) if results is None else list(results)
        if len(values) != len(tasks):
            raise ValueError(f"results has {len(values)} entries for {len(tasks)} tasks")
        for task, result in zip(tasks, values, strict=True):
            check_claimed(task)
            if result is not None:  # (its message is built only for a result to check)
                validation.check_result(result, f"result of task {task.id}")
        return tasks, values

    def fail(self, claimed: ClaimedTask, error: BaseException | str, *, retry: bool) -> bool:
        now = self._parts.clock()
        return self.finish(claimed, self.failure_values(claimed, error, now, retry=retry), now)

    def fail_many(
        self, claimed: Sequence[ClaimedTask], errors: Sequence[BaseException | str], *, retry: bool
    ) -> set[int]:
        if isinstance(errors, str | bytes):
            raise TypeError("errors must be a sequence with one error per task, not a single string")
        tasks = list(claimed)
        texts = list(errors)
        if len(texts) != len(tasks):
            raise ValueError(f"errors has {len(texts)} entries for {len(tasks)} tasks")
        for task, error in zip(tasks, texts, strict=True):
            check_claimed(task)
            if not isinstance(error, BaseException | str):
                kind = type(error).__name__
                raise TypeError(f"the error of task {task.id} must be an exception or a string, got {kind}")
        if not tasks:
            return set()
        parts = self._parts
        now = parts.clock()
        values = [
            self.failure_values(task, error, now, retry=retry)
            for task, error in zip(tasks, texts, strict=True)
        ]
        strategy = parts.strategy
        with parts.database_errors():
            return parts.call(
                lambda: final_writes.fail_many(strategy, parts.engine, parts.table, tasks, values, now)
            )

    def failure_values(
        self, claimed: ClaimedTask, error: BaseException | str, now: datetime, *, retry: bool
    ) -> dict[str, Any]:
        """What a failure writes: queued again after its backoff while attempts remain, else FAILED."""
        # Scrubbed of the engine's secrets: a task's own message may quote its URL.
        values: dict[str, Any] = {
            "last_error": format_error(error, self._parts.redactor),
            "locked_until": None,
        }
        if retry and claimed.malformed is None and claimed.attempts < claimed.max_attempts:
            values.update(status=TaskStatus.QUEUED, run_at=now + self.retry_delay(claimed))
        else:
            values.update(status=TaskStatus.FAILED, finished_at=now)
        give_up_slot(claimed, values)
        return values

    def release(self, claimed: ClaimedTask) -> bool:
        values = {
            "status": TaskStatus.QUEUED,
            "attempts": self._parts.table.c.attempts - 1,
            "locked_until": None,
        }
        give_up_slot(claimed, values)
        return self.finish(claimed, values, self._parts.clock())

    def complete_in(self, conn: Connection, claimed: ClaimedTask, result: Any) -> bool:
        check_claimed(claimed)
        validation.check_result(result)
        parts = self._parts
        now = parts.clock()
        values = {"status": TaskStatus.COMPLETED, "finished_at": now, "locked_until": None, "result": result}
        with parts.database_errors():
            # (The fenced UPDATE announces the finished task itself, where the
            # database has a channel: `LeaseWrites.write_if_held`.)
            return final_writes.complete_on(parts.strategy, conn, parts.table, claimed, values, now)

    def let_go(self, claimed: ClaimedTask) -> None:
        parts = self._parts
        strategy = parts.strategy
        with parts.database_errors():
            parts.call(lambda: strategy.settled(claimed))

    def outcome_written(self, claimed: ClaimedTask, *, completed: bool) -> bool:
        check_claimed(claimed)
        parts = self._parts
        strategy = parts.strategy
        with parts.database_errors():
            found = parts.call(lambda: strategy.claim_outcome(parts.engine, parts.table, claimed))
        if found is None:
            return False
        status, last_error = found
        if completed:
            return status == TaskStatus.COMPLETED
        return status in (TaskStatus.QUEUED, TaskStatus.FAILED) and last_error != LEASE_EXPIRED_ERROR

    def extend_leases(self, claimed: Sequence[ClaimedTask]) -> set[int]:
        if not claimed:
            return set()
        parts = self._parts
        now = parts.clock()
        strategy = parts.strategy
        with parts.database_errors():
            return parts.call(
                lambda: strategy.extend(parts.engine, parts.table, claimed, now + parts.lease, now)
            )

    def finish(self, claimed: ClaimedTask, values: dict[str, Any], now: datetime) -> bool:
        check_claimed(claimed)
        parts = self._parts
        strategy = parts.strategy
        with parts.database_errors():
            return parts.call(
                lambda: final_writes.finish(strategy, parts.engine, parts.table, claimed, values, now)
            )

    def retry_delay(self, claimed: ClaimedTask) -> timedelta:
        registered = self._tasks.get(claimed.name)
        base = registered.options.retry_delay if registered else DEFAULT_RETRY_DELAY
        return retry_delay(base, claimed.attempts, self._max_retry_delay())


def give_up_slot(claimed: ClaimedTask, values: dict[str, Any]) -> None:
    """Clear the slot of a limited task going back to the queue (or to FAILED, which can be retried).

    The slot stops counting as the row leaves RUNNING anyway; cleared, it
    cannot come back with a later claim that gives no slot (a release of the
    task without the limit), where it could clash with the slot's new holder.
    """
    if claimed.concurrency_slot is not None:
        values["concurrency_slot"] = None


def check_claimed(claimed: Any) -> None:
    if not isinstance(claimed, ClaimedTask):
        raise TypeError(f"expected the ClaimedTask returned by claim(), got {claimed!r}")


__all__ = ["Outcomes", "check_claimed", "give_up_slot"]
