"""Table health: what slows a queue's table, measured, judged against thresholds, and explained.

A queue slows down for reasons outside it: a transaction left open in
another part of the application keeps PostgreSQL's vacuum (or InnoDB's
purge) from cleaning up, and every ``SKIP LOCKED`` claim then steps over the
dead rows.  `measure_table_health` reads what each database can tell about
that, and turns each figure over its `HealthThresholds` limit into a
`Finding` that says what to do.  ``queue.table_health()`` is the way in for
applications and monitoring; ``sa-taskqueue health`` prints it.

=============  ==================================================================
module         what
=============  ==================================================================
``figures``    `TableHealth`, `OpenTransaction`, `Finding`: the measurement
``thresholds`` `HealthThresholds`: the limits, with their defaults
``judge``      words for figures, and the finding every database gives a long transaction
``lines``      `health_lines`: the measurement as text
``postgresql`` dead row versions, autovacuum, sessions and slots holding the xmin horizon
``mysql``      InnoDB's history list length and oldest transactions (MySQL, MariaDB)
``sqlite``     journal mode, WAL file size, pages
=============  ==================================================================

The probe is chosen here, by the backend's name, and nowhere else.
Oracle has none: its figures (``V$TRANSACTION``, undo retention) need
privileges an application account rarely has, and no live Oracle checks
them, so the measurement says "not measured on Oracle" instead of guessing.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import Connection, Engine, Table, inspect

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.exceptions import SchemaMissing
from sa_taskqueue.health import mysql, postgresql, sqlite
from sa_taskqueue.health.figures import Finding, OpenTransaction, TableHealth
from sa_taskqueue.health.lines import health_lines
from sa_taskqueue.health.thresholds import HealthThresholds

Probe = Callable[[Connection, Table, datetime, HealthThresholds], TableHealth]

#: Backend name -> what measures it.  A backend not listed is not measured.
PROBES: dict[str, Probe] = {
    "postgresql": postgresql.measure,
    "mysql": mysql.measure,
    "mariadb": mysql.measure,
    "sqlite": sqlite.measure,
}


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
    probe = PROBES.get(backend.name)
    if probe is None:
        return TableHealth(
            database=backend.label,
            table=".".join(part for part in (table.schema, table.name) if part),
            measured_at=now,
            thresholds=thresholds,
            notes=(
                f"not measured on {backend.label}: sa_taskqueue reads table health on PostgreSQL, "
                "MySQL, MariaDB and SQLite",
            ),
        )
    with engine.connect() as conn:
        # Most figures are the server's or the file's: without this check a
        # database never migrated would look healthy.
        if not inspect(conn).has_table(table.name, schema=table.schema):
            raise SchemaMissing(
                f"the task table {table.name!r} does not exist: "
                "run `sa-taskqueue migrate` (or `alembic upgrade head`)"
            )
        return probe(conn, table, now, thresholds)


__all__ = [
    "PROBES",
    "Finding",
    "HealthThresholds",
    "OpenTransaction",
    "TableHealth",
    "health_lines",
    "measure_table_health",
]
