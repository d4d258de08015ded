"""What the task layer needs of a queue, as a protocol: enqueueing code depends on this, not on `TaskQueue`.

`RegisteredTask` enqueues through the queue it was registered with; typed
against this small protocol, it never imports the queue module, which sits
layers above it.  `TaskQueue` satisfies it.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Table

from sa_taskqueue.core.model import TaskMixin


class Enqueuer(Protocol):
    """A queue that enqueues registered tasks: `TaskQueue.enqueue` and `TaskQueue.enqueue_many`."""

    @property
    def table(self) -> Table:
        """The task table: what an enqueue's values are checked against."""

    @property
    def clock(self) -> Callable[[], datetime]:
        """The queue's clock: a ``delay`` is counted from it."""

    def enqueue(
        self,
        session: Any,
        name: str,
        params: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
        depends_on: Iterable[Any] | None = None,
        on_parent_failure: str | None = None,
        batch: Any = None,
    ) -> TaskMixin | Coroutine[Any, Any, TaskMixin]:
        """Add one run of task ``name`` to ``session``; a coroutine for an async session."""

    def enqueue_many(
        self,
        session: Any,
        name: str,
        params_list: Iterable[dict[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        chunk_size: int = 1000,
        unique_key: str | None = None,
        depends_on: Iterable[Any] | None = None,
        on_parent_failure: str | None = None,
        batch: Any = None,
    ) -> list[int] | Coroutine[Any, Any, list[int] | None] | None:
        """Add one run of task ``name`` per params dict to ``session``; a coroutine for an async session."""


__all__ = ["Enqueuer"]
