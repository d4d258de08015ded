"""Prompt pickup on PostgreSQL: NOTIFY when an enqueue commits, LISTEN in idle workers.

NOTIFY is transactional: sent inside the enqueuing transaction, it reaches
listeners only when that transaction commits, and never if it rolls back.
The payload is the queue name.  A notification is only a hint to look now;
workers keep polling, so a lost one (listener reconnecting) costs a poll
interval, never a task.  Other dialects have no such channel and poll.

The listener waits in a thread of its own, on its connection's socket and on
a socket of its own that `Listener.interrupt` writes to, so that a stopping
worker does not wait for the next notification or timeout; psycopg's
``notifies()`` then reads what arrived.  For an async engine (psycopg's
async mode, or asyncpg) it opens its one connection through psycopg's sync
driver to the same server, outside the engine's pool and event loop: a
LISTEN connection is never lent to anyone, so nothing is gained by making it
async, and the worker's wait stays the same.  Where psycopg is not installed
(asyncpg alone) the worker polls.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Engine, Table, create_engine, func, select
from sqlalchemy.orm import Session, SessionTransaction, scoped_session
from sqlalchemy.pool import NullPool

from sa_taskqueue.backends import backend_for

logger = logging.getLogger("sa_taskqueue")

#: The longest wait on a quiet LISTEN connection before it is read anyway (seconds).
QUIET_WAIT = 1.0


def channel_name(table: Table) -> str:
    """The channel of one task table (identifiers are at most 63 bytes)."""
    return f"sa_taskqueue_{table.name}"[:63]


def control_channel_name(table: Table) -> str:
    """The channel on which a change of the pause state of one task table's queues is announced.

    A channel of its own, not a payload on the enqueue channel: any string
    may be a queue name there, so no payload could be told apart.
    """
    return f"sa_taskqueue_ctl_{table.name}"[:63]


def cancel_channel_name(table: Table) -> str:
    """The channel on which cancels of one task table's running tasks are announced (the payload: the id)."""
    return f"sa_taskqueue_cxl_{table.name}"[:63]


def notify_enqueued(session: Session | scoped_session[Any], table: Table, queues: Iterable[str]) -> None:
    """Within the caller's transaction: wake listening workers of these queues at commit.

    ``session`` may be a `scoped_session` (Flask-SQLAlchemy's ``db.session``):
    its current Session is used.
    """
    session = current_session(session)
    if not backend_for(session.get_bind(clause=table).dialect).notify:
        return
    channel = channel_name(table)
    session.connection(bind_arguments={"clause": table})  # begins the transaction, if none is open yet
    # One notification per queue and transaction is all a commit delivers
    # anyway, so a loop of enqueues pays for the first one only.  What was
    # sent is remembered per transaction, the root one or a savepoint: a
    # NOTIFY sent inside a savepoint that rolls back is discarded with it, so
    # only the memos of the transactions still open around this one count.
    # (Transactions are kept, not their ids, which a later one could reuse.)
    open_now = _open_transactions(session)
    remembered: dict[SessionTransaction, set[tuple[str, str]]] = session.info.get(_NOTIFIED_KEY, {})
    remembered = {
        transaction: remembered[transaction] for transaction in open_now if transaction in remembered
    }
    already = set().union(*remembered.values())
    for queue in sorted(set(queues)):
        if (channel, queue) not in already:
            session.execute(select(func.pg_notify(channel, queue)), bind_arguments={"clause": table})
            remembered.setdefault(open_now[0], set()).add((channel, queue))
    session.info[_NOTIFIED_KEY] = remembered


#: Where a session keeps what `notify_enqueued` sent in its open transactions.
_NOTIFIED_KEY = "sa_taskqueue_notified"


def current_session(session: Session | scoped_session[Any]) -> Session:
    """The Session to work in: ``session`` itself, or a `scoped_session`'s current one."""
    if isinstance(session, scoped_session):
        resolved: Session = session()
        return resolved
    return session


def _open_transactions(session: Session) -> list[SessionTransaction]:
    """The innermost savepoint (or the transaction), then each savepoint around it, then the transaction.

    A NOTIFY sent in any of them reaches listeners if the current one commits
    through to the end.  The flush's internal subtransactions are left out:
    they end with each flush.
    """
    found: list[SessionTransaction] = []
    transaction = session.get_nested_transaction() or session.get_transaction()
    while transaction is not None:
        if transaction.nested or transaction.parent is None:
            found.append(transaction)
        transaction = transaction.parent
    return found


def can_listen(engine: Engine) -> bool:
    """Whether a `Listener` can wait for this engine's notifications (else the worker polls)."""
    backend = backend_for(engine.dialect)
    if not engine.dialect.is_async:
        return backend.listen
    # An async engine's listener connects through a sync driver (PostgreSQL: psycopg's).
    return backend.notify and backend.listener_url(engine.url) is not None


def listening_engine(engine: Engine) -> Engine:
    """The engine a `Listener` of ``engine`` connects through: itself, or a sync one if async."""
    return _sync_listening_engine(engine) if engine.dialect.is_async else engine


def _sync_listening_engine(engine: Engine) -> Engine:
    """An engine of a sync driver to an async engine's server (`Backend.listener_url`), without a pool."""
    url = backend_for(engine.dialect).listener_url(engine.url)
    if url is None:
        raise RuntimeError(
            f"no installed sync driver can listen to {engine.url.drivername} for notifications"
        )
    return create_engine(url, poolclass=NullPool)


class Listener(threading.Thread):
    """LISTENs on a dedicated connection and calls ``wake(queue)`` for each notification.

    With ``control_changed``, it also listens on the table's control channel
    and calls ``control_changed(queue)`` when a queue is paused or resumed.
    """

    def __init__(
        self,
        engine: Engine,
        table: Table,
        wake: Callable[[str], None],
        stop: threading.Event,
        control_changed: Callable[[str], None] | None = None,
        cancelled: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(name="sa_taskqueue-listen", daemon=True)
        self.engine = engine
        self.channel = channel_name(table)
        self.control_channel = control_channel_name(table)
        self.wake = wake
        self.control_changed = control_changed
        #: With it, the listener also hears the cancels of running tasks (the worker holding one stops it).
        self.cancelled = cancelled
        self.cancel_channel = cancel_channel_name(table)
        self.stop = stop
        self.listening = threading.Event()
        # An async engine's driver cannot wait here: a sync engine to its server does.
        self._listening_engine = listening_engine(engine)
        # While the thread runs: a socket pair whose one end `interrupt`
        # writes to, the other ending the wait (selectors take sockets
        # everywhere, pipes not on Windows).  Made in the thread and closed
        # there, under the lock `interrupt` takes.
        self._interrupt_lock = threading.Lock()
        self._interrupter: socket.socket | None = None

    def interrupt(self) -> None:
        """End the wait for notifications now, so that a ``stop`` set before is seen at once.

        A listener not yet waiting sees the stop before its first wait; one
        that has ended has nothing to interrupt.
        """
        with self._interrupt_lock:
            if self._interrupter is not None:
                with contextlib.suppress(OSError):  # its buffer is full: woken already
                    self._interrupter.send(b"\0")

    def run(self) -> None:
        self.backoff = 0.5
        interrupted, interrupter = socket.socketpair()
        for end in (interrupted, interrupter):
            end.setblocking(False)
        with self._interrupt_lock:
            self._interrupter = interrupter
        try:
            while not self.stop.is_set():
                try:
                    self._listen(interrupted)
                except Exception as error:  # noqa: BLE001 - reconnect on any failure; polling covers the gap
                    backoff = self.backoff
                    self.listening.clear()
                    logger.warning("LISTEN connection lost, reconnecting in %.1fs: %s", backoff, error)
                    self.stop.wait(backoff)
                    self.backoff = min(backoff * 2, 30.0)
        finally:
            with self._interrupt_lock:
                self._interrupter = None
            interrupter.close()
            interrupted.close()

    def _listen(self, interrupted: socket.socket) -> None:
        raw = self._listening_engine.raw_connection()
        try:
            driver: Any = raw.driver_connection
            driver.autocommit = True
            quote = self.engine.dialect.identifier_preparer.quote
            driver.execute(f"LISTEN {quote(self.channel)}")
            if self.cancelled is not None:
                # Before the control channel's LISTEN, which stays the connection's last statement.
                driver.execute(f"LISTEN {quote(self.cancel_channel)}")
            if self.control_changed is not None:
                driver.execute(f"LISTEN {quote(self.control_channel)}")
                # What changed while we were not listening is read again too.
                self.control_changed("")
            self.listening.set()
            self.backoff = 0.5  # connected: the next outage starts from a short wait again
            # A wake-up right after (re)connecting: anything enqueued while we
            # were not listening is picked up now rather than at the next poll.
            self.wake("")
            with selectors.DefaultSelector() as selector:
                selector.register(driver.fileno(), selectors.EVENT_READ)
                selector.register(interrupted, selectors.EVENT_READ)
                while not self.stop.is_set():
                    self._hand_on_arrived(driver)
                    for key, _events in selector.select(QUIET_WAIT):
                        if key.fileobj is interrupted:
                            with contextlib.suppress(BlockingIOError):
                                interrupted.recv(64)  # read, so that the next wait waits
        finally:
            self.listening.clear()
            raw.invalidate()  # never hand a LISTENing connection back to the pool

    def _hand_on_arrived(self, driver: Any) -> None:
        """Hand on every notification that has arrived, without waiting for more.

        Read until none is left, since psycopg may already hold some that no
        longer show on the socket (read along with an earlier one, or while
        the connection ran a statement).
        """
        while True:
            arrived = list(driver.notifies(timeout=0))
            if not arrived:
                return
            for notification in arrived:
                if notification.channel == self.control_channel and self.control_changed is not None:
                    self.control_changed(notification.payload)
                elif notification.channel == self.cancel_channel and self.cancelled is not None:
                    self.cancelled(notification.payload)
                else:
                    self.wake(notification.payload)
