"""Table health: what slows a queue's table, measured, judged against thresholds, and explained.

A queue slows down for reasons outside it: a transaction left open in
another part of the application keeps PostgreSQL's vacuum (or InnoDB's
purge) from cleaning up, and every ``SKIP LOCKED`` claim then steps over the
dead rows.  `measure_table_health` reads what each database can tell about
that, and turns each figure over its `HealthThresholds` limit into a
`Finding` that says what to do.  ``queue.table_health()`` is the way in for
applications and monitoring; ``sa-taskqueue health`` prints it.

=================  ==================================================================
module             what
=================  ==================================================================
``lines``          `health_lines`: the measurement as text
``explain``        the plan of a statement, for checking that a claim uses its index
``self_test``      the footing check: row locks, advisory locks, notifications
=================  ==================================================================

What each database can tell is read by its backend's probe
(`Backend.table_health_probe`, in `sa_taskqueue.backends.table_health`,
with the figures and thresholds it fills in); this module connects, checks
that the table is there, and runs it.  A database whose backend has no
probe (Oracle: its figures need privileges an application account rarely
has) is reported as not measured rather than guessed at.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, Engine, Table, inspect

from sa_taskqueue.backends import TableHealthProbe, backend_for
from sa_taskqueue.backends.table_health import (
    MEASURED_ON,
    Finding,
    HealthThresholds,
    OpenTransaction,
    TableHealth,
)
from sa_taskqueue.core.exceptions import SchemaMissing
from sa_taskqueue.health.lines import health_lines

#: What measures a task table on one database (`Backend.table_health_probe`).
Probe = TableHealthProbe


def measure_table_health(
    engine: Engine, table: Table, *, now: datetime, thresholds: HealthThresholds | None = None
) -> TableHealth:
    """The health of ``table`` on ``engine``'s database, ages counted to ``now`` (an aware datetime).

    One connection, a few reads of the server's own views, rolled back:
    nothing is written and no lock is taken that a claim could wait for.
    """
    if not isinstance(now, datetime) or now.utcoffset() is None:
        raise TypeError(f"now must be an aware datetime, got {now!r}")
    if thresholds is None:
        thresholds = HealthThresholds()
    elif not isinstance(thresholds, HealthThresholds):
        raise TypeError(f"thresholds must be a HealthThresholds, got {thresholds!r}")
    backend = backend_for(engine.dialect)
    probe = backend.table_health_probe()
    if probe is None:
        return TableHealth(
            database=backend.label,
            table=".".join(part for part in (table.schema, table.name) if part),
            measured_at=now,
            thresholds=thresholds,
            notes=(f"not measured on {backend.label}: sa_taskqueue reads table health on {MEASURED_ON}",),
        )
    with engine.connect() as conn:
        # Most figures are the server's or the file's: without this check a
        # database never migrated would look healthy.
        health = probe(conn, table, now, thresholds) if _has_table(conn, table) else None
        if health is None:
            raise SchemaMissing(
                f"the task table {table.name!r} does not exist: "
                "run `sa-taskqueue migrate` (or `alembic upgrade head`)"
            )
        return health


def _has_table(conn: Connection, table: Table) -> bool:
    return bool(inspect(conn).has_table(table.name, schema=table.schema))


__all__ = [
    "Finding",
    "HealthThresholds",
    "OpenTransaction",
    "TableHealth",
    "health_lines",
    "measure_table_health",
]
