"""`Claims`: a claim's request checked and planned, lease recovery when due, and the claim itself.

What a claim takes is decided here, by asking each feature in turn: the
paused queues are left out (`features.pausing`), tasks with a concurrency
limit are claimed first into slots of their keys (`features.concurrency`),
and leases of workers that are gone are recovered at most once per
interval.  The SQL is the strategy's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sa_taskqueue.core import validation
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.claimed_params import json_loads
from sa_taskqueue.features.concurrency import ConcurrencyClaims
from sa_taskqueue.features.pausing import QueuePauses
from sa_taskqueue.features.workflows.bookkeeping import after_final
from sa_taskqueue.health.explain import explain
from sa_taskqueue.queue.parts import QueueParts
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.limited import Limits

logger = logging.getLogger("sa_taskqueue")

#: A planned claim: the strategy, the request, and the limits of the limited names asked for, if any.
Plan = tuple[ClaimStrategy, ClaimRequest, Limits | None]


class Claims:
    """The claim path of one queue."""

    def __init__(
        self,
        parts: QueueParts,
        pauses: QueuePauses,
        concurrency: ConcurrencyClaims,
        recover: Callable[[], int] | None = None,
    ) -> None:
        """``recover`` is what a due recovery calls (the queue's own `TaskQueue.recover`), else `recover`."""
        self._parts = parts
        self._recover_due = recover or self.recover
        self._pauses = pauses
        self._concurrency = concurrency
        self._next_recovery: datetime | None = None

    def plan(
        self, limit: int, queues: Sequence[str] | None, worker_id: str | None, names: Sequence[str] | None
    ) -> Plan | None:
        """A claim's arguments checked, recovery run if due, paused queues read: its request.

        None when there is nothing to claim (no queue or name asked for, or
        every queue asked for paused).  With the limits of the limited names
        among those asked for, if any.
        """
        validation.check_positive_int("limit", limit)
        queue_names: tuple[str, ...] | None = None
        if queues is not None:
            if isinstance(queues, str):
                raise TypeError("queues must be a sequence of queue names, not a single string")
            queue_names = tuple(queues)
            for queue_name in queue_names:
                validation.check_queue_name(queue_name)
            if not queue_names:
                return None
        task_names: tuple[str, ...] | None = None
        if names is not None:
            if isinstance(names, str):
                raise TypeError("names must be a sequence of task names, not a single string")
            task_names = tuple(names)
            for task_name in task_names:
                if not isinstance(task_name, str):
                    raise TypeError(f"names must hold task names (strings), got {task_name!r}")
            if not task_names:
                return None
        strategy = self._parts.strategy
        self._recover_if_due(strategy)
        narrowed = self._pauses.narrow(queue_names)
        if narrowed is None:
            return None  # every queue asked for is paused: nothing to claim, no query
        queue_names, excluded = narrowed
        worker = worker_id or self._parts.default_worker_id()
        request = self.request(limit, queue_names, worker, task_names, excluded)
        return strategy, request, self._concurrency.limits_for(task_names)

    def claim(self, plan: Plan, limited_recheck: float) -> list[ClaimedTask]:
        """The planned claim, in a short transaction of its own (limited tasks first, in one of theirs)."""
        strategy, request, limited = plan
        if limited is not None:
            rows = self._concurrency.claim(strategy, request, limited, limited_recheck, self._plain(strategy))
        else:
            rows = self._plain(strategy)(request)
        return self.claimed_tasks(rows)

    def complete_and_claim(
        self, plan: Plan, tasks: list[ClaimedTask], values: list[Any]
    ) -> tuple[set[int], list[ClaimedTask]]:
        """The completions of ``tasks`` and the planned (plain) claim, as the strategy commits them."""
        parts = self._parts
        strategy, request, _limited = plan
        with parts.database_errors():
            written, rows = parts.call(
                lambda: strategy.complete_and_claim(
                    parts.engine, parts.table, tasks, values, request.now, request
                )
            )
        return written, self.claimed_tasks(rows)

    def claimed_tasks(self, rows: list[dict[str, Any]]) -> list[ClaimedTask]:
        loads = json_loads(self._parts.engine.dialect)
        return sorted((ClaimedTask.from_row(row, loads) for row in rows), key=lambda t: t.sort_key)

    def request(
        self,
        limit: int,
        queues: tuple[str, ...] | None,
        worker_id: str,
        names: tuple[str, ...] | None = None,
        paused: tuple[str, ...] | None = None,
    ) -> ClaimRequest:
        now = self._parts.clock()
        return ClaimRequest(
            limit=limit,
            queues=queues,
            worker_id=worker_id,
            now=now,
            lease_until=now + self._parts.lease,
            names=names,
            paused=paused,
        )

    def explain(self, limit: int, queues: Sequence[str] | None) -> str:
        """The database's plan for the statement a claim runs to find its rows (nothing is claimed)."""
        parts = self._parts
        request = self.request(limit, tuple(queues) if queues is not None else None, "explain")
        statement = parts.strategy.finding_statement(parts.engine.dialect, parts.table, request)
        with parts.database_errors():
            return parts.call(lambda: explain(parts.engine, statement, request.params()))

    def recover(self) -> int:
        """Give back tasks whose worker is gone (lease expired, or advisory lock free); how many."""
        parts = self._parts
        strategy = parts.strategy
        with parts.database_errors():
            now = parts.clock()
            recovered = parts.call(lambda: strategy.recover(parts.engine, parts.table, now, after_final))
        if recovered:
            logger.warning("recovered %d task(s) from workers that are gone", recovered)
        return recovered

    def _recover_if_due(self, strategy: ClaimStrategy) -> None:
        # Recovery is a query of its own; running it on every claim would add a
        # round trip to the hot path, so it runs at most once per interval.
        # (A wall clock stepped back by more than an interval runs it at once.)
        now = self._parts.clock()
        interval = strategy.recovery_interval(self._parts.lease)
        if self._next_recovery is not None and self._next_recovery - interval <= now < self._next_recovery:
            return
        self._next_recovery = now + interval
        self._recover_due()

    def _plain(self, strategy: ClaimStrategy) -> Any:
        parts = self._parts

        def plain_claim(request: ClaimRequest) -> list[dict[str, Any]]:
            with parts.database_errors():
                return parts.call(lambda: strategy.claim(parts.engine, parts.table, request))

        return plain_claim


__all__ = ["Claims", "Plan"]
