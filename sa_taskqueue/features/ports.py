"""The seam between the queue and its features: what a feature may ask of the queue it serves.

Each feature (pauses, concurrency limits, retention, schedules, results,
the self-test) is typed against `QueueContext`, never against `TaskQueue`
or `Worker`: it sees the engine, the table, the clock, the strategy, and
where and how database calls run, and nothing else.  So a feature can be
read, tested and changed on its own, and the queue stays a coordinator.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Protocol, TypeVar

from sqlalchemy import Engine, Table

from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.strategies.base import ClaimStrategy

T = TypeVar("T")


class QueueContext(Protocol):
    """The parts of a queue a feature works with."""

    @property
    def engine(self) -> Engine:
        """The synchronous engine every statement runs on (an `AsyncEngine`'s ``sync_engine``)."""

    @property
    def table(self) -> Table:
        """The task table; its control table is `sa_taskqueue.core.control.control_table_of` it."""

    @property
    def limits(self) -> ColumnLimits:
        """What the table's columns hold: names and queues are checked against it."""

    @property
    def lease(self) -> timedelta:
        """How long a claim holds a task before another worker may take it over."""

    @property
    def is_async(self) -> bool:
        """Whether the engine belongs to an `AsyncEngine`, whose calls run on its event loop."""

    @property
    def strategy(self) -> ClaimStrategy:
        """The claim strategy, resolved (connecting once) on first use."""

    def clock(self) -> datetime:
        """Now, as the queue reads it: every time written or compared comes from here."""

    def call(self, fn: Callable[[], T], /) -> T:
        """``fn()`` where the engine may be used: here for a sync engine, on its loop for an async one."""

    async def call_async(self, fn: Callable[[], T], /) -> T:
        """``fn()`` from a coroutine, without blocking the running loop."""

    def database_errors(self) -> AbstractContextManager[None]:
        """A context that turns the driver's errors into `TaskQueueError` subclasses, the cause kept."""

    def default_worker_id(self) -> str:
        """``host:pid:token``, new in each process: who holds a claim or a control-table lease."""


__all__ = ["QueueContext"]
