"""Rows of the control table that several processes may create at once.

A pause, a retention lease: each is one row keyed by ``(kind, name)``, and
any worker or command may be the first to need it.  Creating it is an INSERT
that may lose a race with another process's identical INSERT; losing that
race is fine (the row exists, which is all the caller wanted), so the
duplicate-key error is swallowed, in a transaction of its own so that no
database is left with an aborted transaction to roll back.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine, Table, exc, insert, select


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


__all__ = ["ensure_row"]
