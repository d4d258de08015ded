"""What the worker needs of a queue: the `WorkerQueue` protocol `TaskQueue` satisfies.

The worker layer sits below the queue and never imports it, not even for
its annotations: it is typed against this protocol, which names exactly the
members a worker uses, each with what the worker relies on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy import Engine, Table

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.events import EventStream
from sa_taskqueue.core.registered import RegisteredTask
from sa_taskqueue.features.live_workers import LiveWorkers
from sa_taskqueue.features.pausing import PausedQueues
from sa_taskqueue.features.schedules import PeriodicTask, ScheduleSource
from sa_taskqueue.features.transactional import TransactionalQueue
from sa_taskqueue.health.self_test import FootingReport
from sa_taskqueue.strategies.base import ClaimStrategy


class WorkerQueue(TransactionalQueue, ScheduleSource, Protocol):
    """The queue as a worker sees it.  Every write is fenced: it lands only while the claim holds the task."""

    @property
    def events(self) -> EventStream:
        """The stream the worker emits its lifecycle events on; its log lines and hooks subscribe there."""

    def parent_results(self, task_id: int) -> dict[int, Any]:
        """The results of task ``task_id``'s parents, by id (what `TaskContext.parent_results` reads)."""

    @property
    def paused(self) -> PausedQueues:
        """The paused queues: kept fresh by the worker's `PauseWatch`, read again when they changed."""

    @property
    def live_workers(self) -> LiveWorkers:
        """The live-worker registry: the worker runs its service to be listed while it runs."""

    @property
    def lease(self) -> timedelta:
        """How long a claim or a renewal holds a task; the heartbeat and the watchdog are timed from it."""

    @property
    def retention(self) -> Any:
        """How long finished tasks are kept, per status; empty (false) when nothing is deleted."""

    @property
    def retention_interval(self) -> timedelta | None:
        """How often the retention service deletes expired tasks (set whenever ``retention`` is)."""

    @property
    def engine(self) -> Engine:
        """The application's engine: its dialect names the backend, LISTEN connects through it."""

    @property
    def table(self) -> Table:
        """The tasks table, for the LISTEN channel names."""

    @property
    def strategy(self) -> ClaimStrategy:
        """The claim strategy in use: its name is logged, it says whether a write may claim too."""

    @property
    def is_async(self) -> bool:
        """Whether the engine is async: ``async def`` tasks then run on `event_loop`."""

    @property
    def periodic_tasks(self) -> list[PeriodicTask]:
        """The periodic tasks registered: the schedule service ticks while there are any."""

    @property
    def task_names(self) -> list[str]:
        """The names registered: the only ones a claim takes."""

    def registered(self, name: str) -> RegisteredTask[Any, Any] | None:
        """The function registered under ``name`` and its options, None if none is."""

    def default_worker_id(self) -> str:
        """A worker id new in each process."""

    def check_footing(self, *, listen: bool = True) -> FootingReport:
        """The self-test the worker runs before it claims; raises `DatabaseUnavailable` in an outage."""

    def claim(
        self,
        *,
        limit: int = 1,
        queues: Sequence[str] | None = None,
        worker_id: str | None = None,
        names: Sequence[str] | None = None,
        limited_recheck: float = 0.0,
    ) -> list[ClaimedTask]:
        """Up to ``limit`` due tasks, RUNNING and leased to ``worker_id`` once this returns (committed)."""

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
        """`complete_many` then `claim`, in one commit where the strategy can: ids written, tasks claimed."""

    def complete(self, claimed: ClaimedTask, result: Any = None) -> bool:
        """Mark the task COMPLETED with ``result`` if the claim still holds it; True if written."""

    def complete_many(self, claimed: Sequence[ClaimedTask], results: Sequence[Any] | None = None) -> set[int]:
        """`complete` for many in one statement: the ids written."""

    def fail(self, claimed: ClaimedTask, error: BaseException | str, *, retry: bool = True) -> bool:
        """Write the failure: QUEUED again while attempts < max_attempts and not malformed, else FAILED."""

    def fail_many(
        self, claimed: Sequence[ClaimedTask], errors: Sequence[BaseException | str], *, retry: bool = True
    ) -> set[int]:
        """`fail` for many in one statement: the ids written."""

    def release(self, claimed: ClaimedTask) -> bool:
        """Give an unfinished task back: QUEUED again, its attempt not counted; True if the claim held it."""

    def let_go(self, claimed: ClaimedTask) -> None:
        """A transactional task's transaction has ended: drop what the strategy still holds for it."""

    def outcome_written(self, claimed: ClaimedTask, *, completed: bool) -> bool:
        """Whether this claim's outcome is in the row (a write whose reply was lost may have committed)."""

    def extend_leases(self, claimed: Sequence[ClaimedTask]) -> set[int]:
        """Renew the leases of the tasks still held: the ids renewed."""

    def recheck_limited(self) -> None:
        """The next claim looks for tasks with a concurrency limit again."""

    def delete_expired(
        self,
        *,
        holder: str | None = None,
        stop: threading.Event | None = None,
        queues: Sequence[str] | None = None,
    ) -> int:
        """Delete expired finished tasks (of ``queues``, if given), one caller at a time: how many."""

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop an async engine's calls run on (only for an async engine)."""


__all__ = ["WorkerQueue"]
