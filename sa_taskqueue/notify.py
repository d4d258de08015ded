"""Prompt pickup on PostgreSQL: NOTIFY when an enqueue commits, LISTEN in idle workers.

NOTIFY is transactional: sent inside the enqueuing transaction, it reaches
listeners only when that transaction commits, and never if it rolls back.
The payload is the queue name.  A notification is only a hint to look now;
workers keep polling, so a lost one (listener reconnecting) costs a poll
interval, never a task.  Other dialects have no such channel and poll.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Engine, Table, func, select
from sqlalchemy.orm import Session

from sa_taskqueue.backends import backend_for

logger = logging.getLogger("sa_taskqueue")


def channel_name(table: Table) -> str:
    """The channel of one task table (identifiers are at most 63 bytes)."""
    return f"sa_taskqueue_{table.name}"[:63]


def notify_enqueued(session: Session, table: Table, queues: Iterable[str]) -> None:
    """Within the caller's transaction: wake listening workers of these queues at commit."""
    if not backend_for(session.get_bind().dialect).notify:
        return
    channel = channel_name(table)
    # One notification per queue and transaction is all a commit delivers
    # anyway, so a loop of enqueues pays for the first one only.
    # (The transaction itself is kept, not its id, which a later one could reuse.)
    transaction = session.get_nested_transaction() or session.get_transaction()
    remembered = session.info.get("sa_taskqueue_notified")
    if remembered is None or remembered[0] is not transaction:
        remembered = session.info["sa_taskqueue_notified"] = (transaction, set())
    already: set[tuple[str, str]] = remembered[1]
    for queue in sorted(set(queues)):
        if (channel, queue) not in already:
            session.execute(select(func.pg_notify(channel, queue)))
            already.add((channel, queue))


class Listener(threading.Thread):
    """LISTENs on a dedicated connection and calls ``wake(queue)`` for each notification."""

    def __init__(
        self, engine: Engine, table: Table, wake: Callable[[str], None], stop: threading.Event
    ) -> None:
        super().__init__(name="sa_taskqueue-listen", daemon=True)
        self.engine = engine
        self.channel = channel_name(table)
        self.wake = wake
        self.stop = stop
        self.listening = threading.Event()

    def run(self) -> None:
        self.backoff = 0.5
        while not self.stop.is_set():
            try:
                self._listen()
            except Exception as error:  # noqa: BLE001 - reconnect on any failure; polling covers the gap
                backoff = self.backoff
                self.listening.clear()
                logger.warning("LISTEN connection lost, reconnecting in %.1fs: %s", backoff, error)
                self.stop.wait(backoff)
                self.backoff = min(backoff * 2, 30.0)

    def _listen(self) -> None:
        raw = self.engine.raw_connection()
        try:
            driver: Any = raw.driver_connection
            driver.autocommit = True
            quoted = self.engine.dialect.identifier_preparer.quote(self.channel)
            driver.execute(f"LISTEN {quoted}")
            self.listening.set()
            self.backoff = 0.5  # connected: the next outage starts from a short wait again
            # A wake-up right after (re)connecting: anything enqueued while we
            # were not listening is picked up now rather than at the next poll.
            self.wake("")
            while not self.stop.is_set():
                for notification in driver.notifies(timeout=1.0):
                    self.wake(notification.payload)
        finally:
            self.listening.clear()
            raw.invalidate()  # never hand a LISTENing connection back to the pool
