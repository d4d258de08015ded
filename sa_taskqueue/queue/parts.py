"""`QueueParts`: what every part of a queue shares, and what its features see (`features.ports.QueueContext`).

The engine and where its calls run, the table and what its columns hold,
the clock, the lease, the strategy (resolved on first use), the worker id,
the translation of database errors and the secrets hidden from what is
stored: one object, owned by the
`TaskQueue`, handed to each of its parts and features.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import Engine, Table

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.event_loop_bridge import EventLoopBridge
from sa_taskqueue.core.exceptions import DatabaseUnavailable, translate_database_errors
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.redaction import Redactor
from sa_taskqueue.strategies import registry
from sa_taskqueue.strategies.base import ClaimStrategy

T = TypeVar("T")

#: How often a call that lost a certification conflict (Galera) runs again before the conflict is raised.
CERTIFICATION_RETRIES = 5


class QueueParts:
    """The shared parts of one queue; satisfies `sa_taskqueue.features.ports.QueueContext`."""

    def __init__(
        self,
        engine: Engine,
        *,
        is_async: bool,
        table: Table,
        clock: Callable[[], datetime],
        lease: timedelta,
        strategy: str | ClaimStrategy | None,
    ) -> None:
        self.engine = engine
        #: Where the database calls run: here for a sync engine, on the engine's loop for an async one.
        self.bridge = EventLoopBridge(engine, is_async=is_async)
        self.table = table
        #: What the table's columns hold: every enqueue is checked against it.
        self.limits = ColumnLimits.of(table)
        self.clock = clock
        self.lease = lease
        self._strategy: ClaimStrategy | None = None
        self._strategy_lock = threading.Lock()
        self._requested_strategy = strategy
        self._worker_id: tuple[int, str] | None = None
        #: The secrets of the engine's URL (its password, secret query values), hidden from every
        #: error text the queue stores.  A LISTEN connection, and an async engine's listener, are
        #: opened from this same URL, so its secrets are theirs too.
        self.redactor = Redactor(engine.url)

    @property
    def is_async(self) -> bool:
        return self.bridge.is_async

    @property
    def strategy(self) -> ClaimStrategy:
        """The claim strategy in use; resolved (connecting once if needed) on first access."""
        if self._strategy is None:
            with self._strategy_lock:
                if self._strategy is None:
                    self._strategy = self.bridge.call(self._resolve_strategy)
        return self._strategy

    @property
    def resolved_strategy(self) -> ClaimStrategy | None:
        """The strategy if it has been resolved, else None (nothing is connected to find it)."""
        return self._strategy

    async def close_strategy_async(self) -> None:
        """From the loop an async engine is attached to: close what the strategy keeps, if resolved."""
        if self._strategy is not None:
            await self.bridge.call_async(self._strategy.close)

    def _resolve_strategy(self) -> ClaimStrategy:
        with self.database_errors():
            # The server version is known only after a first connect.
            with self.engine.connect():
                pass
            backend_for(self.engine.dialect).prepare_database(self.engine)
        strategy = registry.choose(self._requested_strategy, self.engine.dialect)
        with self.database_errors():
            strategy.prepare(self.engine)
        return strategy

    def call(self, fn: Callable[[], T], /) -> T:
        return self.bridge.call(fn)

    async def call_async(self, fn: Callable[[], T], /) -> T:
        if self.is_async:
            return await self.bridge.call_from_any_loop(fn)
        return await asyncio.to_thread(fn)

    def database_errors(self) -> AbstractContextManager[None]:
        return translate_database_errors(self.engine, self.table)

    def certified(self, fn: Callable[[], T], /, *, lost: Callable[[], T] | None = None) -> T:
        """``fn()`` (database errors translated), run again when another Galera node's commit beat it.

        Galera certifies at commit: of two nodes' transactions on one row the
        later fails (`Backend.certification_conflict`), having done nothing.
        It runs again at once, a few times; then ``lost()`` is returned where
        given, else the conflict is raised as the `DatabaseUnavailable` it is.
        """
        backend = backend_for(self.engine.dialect)
        for attempt in range(CERTIFICATION_RETRIES + 1):
            try:
                with self.database_errors():
                    return fn()
            except DatabaseUnavailable as error:
                cause = error.__cause__
                driver_error = getattr(cause, "orig", None) or cause
                if driver_error is None or not backend.certification_conflict(driver_error):
                    raise
                if attempt == CERTIFICATION_RETRIES:
                    if lost is None:
                        raise
                    return lost()
                time.sleep(random.uniform(0.0, 0.01 * (attempt + 1)))
        raise AssertionError("unreachable")  # pragma: no cover

    def default_worker_id(self) -> str:
        """``host:pid:token``, new in each process that uses this queue (a fork gets its own)."""
        pid = os.getpid()
        if self._worker_id is None or self._worker_id[0] != pid:
            self._worker_id = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}")
        return self._worker_id[1]


__all__ = ["QueueParts"]
