"""Rows of the control table that several processes may create at once, and the leases they hold.

A pause, a retention lease: each is one row keyed by ``(kind, name)``, and
any worker or command may be the first to need it.  Creating it is an INSERT
that may lose a race with another process's identical INSERT; losing that
race is fine (the row exists, which is all the caller wanted), so the
duplicate-key error is swallowed, in a transaction of its own so that no
database is left with an aborted transaction to roll back.

A lease row (``held_by`` / ``held_until``) lets one process at a time do a
job every worker could do (delete finished tasks, read the queue gauges):
taking it is one conditional UPDATE, so two processes asking at once cannot
both get it.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Engine, Table, exc, insert, or_, select, update


def ensure_row(engine: Engine, control: Table, kind: str, name: str, now: datetime) -> None:
    """Make sure the control row ``(kind, name)`` exists; safe when several processes call it at once."""
    key = (control.c.kind == kind) & (control.c.name == name)
    with engine.connect() as conn:
        # A read first: the row exists nearly always, and a failed INSERT
        # costs more (and logs an error on the server) than a primary key read.
        if conn.scalar(select(control.c.kind).where(key)) is not None:
            return
    try:
        with engine.begin() as conn:
            conn.execute(insert(control).values(kind=kind, name=name, updated_at=now))
    except exc.IntegrityError:
        # Another process inserted it between our read and our INSERT.
        pass


def take_lease(
    engine: Engine, control: Table, kind: str, name: str, holder: str, now: datetime, hold: timedelta
) -> bool:
    """Take or renew the lease of the row ``(kind, name)`` for ``holder`` until ``now + hold``.

    True if ``holder`` holds it now: it was free, had run out, or was
    already ``holder``'s.  The UPDATE's condition is checked against the
    row as it is at the write, so two processes asking at once cannot both
    get it.  The row must exist (`ensure_row`).
    """
    with engine.begin() as conn:
        taken = conn.execute(
            update(control)
            .where(
                control.c.kind == kind,
                control.c.name == name,
                or_(control.c.held_by.is_(None), control.c.held_until <= now, control.c.held_by == holder),
            )
            .values(held_by=holder, held_until=now + hold, updated_at=now)
        )
        return taken.rowcount == 1


def release_lease(engine: Engine, control: Table, kind: str, name: str, holder: str, now: datetime) -> None:
    """Give the lease of ``(kind, name)`` up if ``holder`` still holds it, so another may take it at once."""
    with engine.begin() as conn:
        conn.execute(
            update(control)
            .where(control.c.kind == kind, control.c.name == name, control.c.held_by == holder)
            .values(held_by=None, held_until=None, updated_at=now)
        )


__all__ = ["ensure_row", "release_lease", "take_lease"]
