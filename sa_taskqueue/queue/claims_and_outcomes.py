"""The calls a claim's holder makes: claim, complete, fail, release, renew; every write fenced by the claim.

A worker makes them (`sa_taskqueue.worker`), and so can an application's
own loop or a test.  They are `TaskQueue` methods, gathered here apart from
the enqueueing and operating side of the queue; the work is done by the
queue's `Claims` and `Outcomes` parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.features.concurrency import ConcurrencyClaims
from sa_taskqueue.queue.claiming import Claims
from sa_taskqueue.queue.outcomes import Outcomes
from sa_taskqueue.queue.parts import QueueParts


class ClaimsAndOutcomes:
    """`TaskQueue`'s claim and outcome methods (this class is not used on its own)."""

    _parts: QueueParts
    _claims: Claims
    _outcomes: Outcomes
    _concurrency: ConcurrencyClaims

    def default_worker_id(self) -> str:
        """``host:pid:token``, new in each process that uses this queue (a fork gets its own)."""
        return self._parts.default_worker_id()

    def claim(
        self,
        *,
        limit: int = 1,
        queues: Sequence[str] | None = None,
        worker_id: str | None = None,
        names: Sequence[str] | None = None,
        limited_recheck: float = 0.0,
    ) -> list[ClaimedTask]:
        """Take up to ``limit`` due tasks for ``worker_id`` in one short transaction of its own.

        With tasks that have a concurrency limit among the names, a claim
        takes those first, in a transaction of their own.  ``limited_recheck``
        (seconds; a worker passes `LIMITED_RECHECK_SECONDS`) lets the claims
        that follow one which found no limited task to take leave that
        transaction out for as long, until `recheck_limited` is called.

        Each is marked RUNNING with ``attempts`` incremented and a lease of
        ``self.lease``; the claim commits before this returns.  The snapshots
        come in claim order: priority, then run_at, then id.  ``names``, when
        given, takes only tasks of those names (a worker passes the names it
        has functions for).
        """
        plan = self._claims.plan(limit, queues, worker_id, names)
        return [] if plan is None else self._claims.claim(plan, limited_recheck)

    def complete_many_and_claim(
        self,
        claimed: Sequence[ClaimedTask],
        results: Sequence[Any] | None = None,
        *,
        limit: int = 1,
        queues: Sequence[str] | None = None,
        worker_id: str | None = None,
        names: Sequence[str] | None = None,
        limited_recheck: float = 0.0,
    ) -> tuple[set[int], list[ClaimedTask]]:
        """`complete_many`, then `claim`: the ids written, and the tasks claimed.

        What a worker loop does once a batch is done.  Where the strategy
        commits both at once (`ClaimStrategy.completes_and_claims_at_once`:
        `skip_locked` on PostgreSQL in one statement, on MySQL and MariaDB in
        one transaction; `conditional_update` on SQLite in one transaction)
        either both happen or neither does; elsewhere one after the other.
        The arguments are those of `complete_many` and `claim`; the
        completion is checked in full before anything is sent, and if it
        raises nothing is claimed.  Tasks with a concurrency limit among the
        names are claimed by their own transaction, after the completion.
        """
        tasks, values = Outcomes.checked_completions(claimed, results)
        plan = self._claims.plan(limit, queues, worker_id, names)
        if plan is None or plan[2] is not None:
            # Nothing to claim, or limited tasks to claim first: each on its own.
            written = self.complete_many(tasks, values)
            return written, self.claim(
                limit=limit, queues=queues, worker_id=worker_id, names=names, limited_recheck=limited_recheck
            )
        if any(task.in_workflow for task in tasks):
            # Tasks in a batch or with dependents first, through the workflow
            # path (`final_writes`); the plain ones with the claim.
            flow = [(task, value) for task, value in zip(tasks, values, strict=True) if task.in_workflow]
            written_first = self._outcomes.complete_many([task for task, _ in flow], [v for _, v in flow])
            pairs = [(task, value) for task, value in zip(tasks, values, strict=True) if not task.in_workflow]
            tasks, values = [task for task, _ in pairs], [value for _, value in pairs]
        else:
            written_first = set()
        written, claimed_now = self._claims.complete_and_claim(plan, tasks, values)
        if len(written) < len(tasks):
            # Some not written: perhaps a dependent was added while they ran.
            written |= self._outcomes.complete_rerouted(tasks, values, written)
        return written | written_first, claimed_now

    def recheck_limited(self) -> None:
        """Let the next claim look for limited tasks again (tasks were enqueued, or a slot was freed).

        After a claim with ``limited_recheck`` finds no limited task it can
        take, claims leave the limited claim out for that long; a worker
        calls this when a NOTIFY says tasks arrived and when one of its
        limited tasks leaves its slot, so neither waits that long.
        """
        self._concurrency.recheck()

    def recover(self) -> int:
        """Give back tasks whose worker is gone (lease expired, or advisory lock free); return how many."""
        return self._claims.recover()

    def complete(self, claimed: ClaimedTask, result: Any = None) -> bool:
        """Mark the task COMPLETED with ``result``; False if ``claimed`` no longer holds it."""
        return self._outcomes.complete(claimed, result)

    def complete_many(self, claimed: Sequence[ClaimedTask], results: Sequence[Any] | None = None) -> set[int]:
        """Mark many tasks COMPLETED in one statement; return the ids of those still held (and so written).

        ``results`` pairs with ``claimed`` (all None if omitted).  Every result
        is checked before anything is written.  A worker finishing tasks faster
        than one statement each can write them uses this.
        """
        tasks, values = Outcomes.checked_completions(claimed, results)
        return self._outcomes.complete_many(tasks, values)

    def fail(self, claimed: ClaimedTask, error: BaseException | str, *, retry: bool = True) -> bool:
        """Record ``error``; retry later with backoff while attempts remain, else mark FAILED.

        ``retry=False`` marks it FAILED now, whatever attempts remain, and so
        does a ``malformed`` task, which no attempt could ever run.  The error
        is stored as `format_error` leaves it: storable, and bounded in length.
        False if ``claimed`` no longer holds the task (its outcome is then
        someone else's to write).
        """
        return self._outcomes.fail(claimed, error, retry=retry)

    def fail_many(
        self,
        claimed: Sequence[ClaimedTask],
        errors: Sequence[BaseException | str],
        *,
        retry: bool = True,
    ) -> set[int]:
        """Record many failures in one statement, each as `fail` records one; return the ids still held.

        ``errors`` pairs with ``claimed``.  Each task still held (and so
        written) is retried later with its own backoff while it has attempts
        left, else marked FAILED; the others are left alone, their ids not
        returned.  A worker whose tasks fail together writes them this way.
        """
        return self._outcomes.fail_many(claimed, errors, retry=retry)

    def release(self, claimed: ClaimedTask) -> bool:
        """Give a task back unrun (shutting down): QUEUED again, the attempt not counted."""
        return self._outcomes.release(claimed)

    def complete_in(self, conn: Connection, claimed: ClaimedTask, result: Any = None) -> bool:
        """In ``conn``'s open transaction, mark the task COMPLETED if ``claimed`` still holds it; True if so.

        A transactional task's completion, written beside its own writes:
        the caller commits when this returns True, and rolls everything back
        when it returns False (the task is no longer this claim's).  The
        finished-task notification goes out with that commit.
        """
        return self._outcomes.complete_in(conn, claimed, result)

    def let_go(self, claimed: ClaimedTask) -> None:
        """A transactional task's transaction has ended: drop what the strategy still holds for it."""
        self._outcomes.let_go(claimed)

    def outcome_written(self, claimed: ClaimedTask, *, completed: bool) -> bool:
        """Whether this claim's own outcome is in the row: completed, or else failed or set to retry.

        For a write whose answer was lost with its connection: the write may
        have committed, and its retry then finds the task no longer held.
        Only this claim can have written it while the row still carries the
        claim's identity, but for lease recovery, whose error text says so.
        """
        return self._outcomes.outcome_written(claimed, completed=completed)

    def extend_leases(self, claimed: Sequence[ClaimedTask]) -> set[int]:
        """Renew the lease of each task still held; return the ids renewed (the worker's heartbeat)."""
        return self._outcomes.extend_leases(claimed)

    def retry_delay(self, claimed: ClaimedTask) -> timedelta:
        """``retry_delay * 2**(attempts-1)``, plus up to 25% jitter, capped at ``max_retry_delay``."""
        return self._outcomes.retry_delay(claimed)


__all__ = ["ClaimsAndOutcomes"]
