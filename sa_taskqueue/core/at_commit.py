"""Events of an application's own transaction, emitted once it commits.

A task enqueued in the caller's session exists only when the caller
commits, so ``ENQUEUED`` is held until then: emitted after the outermost
commit, dropped with a rollback of the transaction (or of the savepoint)
it was recorded in.  Two listeners on the `Session` class do this for
every session, registered with the others (`sa_taskqueue.core.session_events`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from sa_taskqueue.core.events import Event, EventStream

#: Where a session keeps the events waiting for its commit: (transaction, stream, build).
_PENDING = "sa_taskqueue_events_at_commit"

Pending = tuple[SessionTransaction, EventStream, Callable[[], Sequence[Event]]]


def emit_at_commit(session: Session, stream: EventStream, build: Callable[[], Sequence[Event]]) -> None:
    """Emit what ``build()`` returns on ``stream`` once ``session``'s transaction commits.

    ``build`` runs at the commit, so its events can read the time then.
    """
    transaction = session.get_nested_transaction() or session.get_transaction()
    if transaction is None:  # nothing open: what was written is committed already
        _emit(stream, build)
        return
    pending: list[Pending] = session.info.setdefault(_PENDING, [])
    pending.append((transaction, stream, build))


def _committed(session: Session) -> None:
    """``after_commit``: a savepoint's release waits for the outermost commit; that one emits."""
    if session.get_nested_transaction() is not None:
        return
    for _transaction, stream, build in session.info.pop(_PENDING, ()):
        _emit(stream, build)


def _rolled_back(session: Session, previous_transaction: SessionTransaction) -> None:
    """``after_soft_rollback``: what was recorded in the transaction rolled back, or within it, is dropped."""
    pending: list[Pending] | None = session.info.get(_PENDING)
    if pending:
        pending[:] = [entry for entry in pending if not _within(entry[0], previous_transaction)]


def _ended(session: Session, transaction: SessionTransaction) -> None:
    """``after_transaction_end``: the outermost transaction ended without a commit (a ``close()``): drop all.

    A commit has emitted and cleared its events before its transaction ends.
    """
    if transaction.parent is None:
        session.info.pop(_PENDING, None)


def _within(transaction: SessionTransaction | None, ended: SessionTransaction) -> bool:
    while transaction is not None:
        if transaction is ended:
            return True
        transaction = transaction.parent
    return False


def _emit(stream: EventStream, build: Callable[[], Sequence[Event]]) -> None:
    for item in build():
        stream.emit(item)


def listen() -> None:
    """Register the listeners on the `Session` class (once: SQLAlchemy ignores a repeat)."""
    if not event.contains(Session, "after_commit", _committed):
        event.listen(Session, "after_commit", _committed)
    if not event.contains(Session, "after_soft_rollback", _rolled_back):
        event.listen(Session, "after_soft_rollback", _rolled_back)
    if not event.contains(Session, "after_transaction_end", _ended):
        event.listen(Session, "after_transaction_end", _ended)


__all__ = ["emit_at_commit", "listen"]
