"""Table health's measurement: its figures, thresholds and judgements, and one probe per database.

Each probe reads what its database can tell about what slows a queue's
table; its backend hands it out (`Backend.table_health_probe`), and
`sa_taskqueue.health` runs it.  The figures and thresholds live here, beside
the probes that fill them in, because a backend may import nothing above it.

=============  ==================================================================
module         what
=============  ==================================================================
``figures``    `TableHealth`, `OpenTransaction`, `Finding`: the measurement
``thresholds`` `HealthThresholds`: the limits, with their defaults
``judge``      words for figures, and the finding every database gives a long transaction
``postgresql`` dead row versions, autovacuum, sessions and slots holding the xmin horizon
``mysql``      InnoDB's history list length and oldest transactions (MySQL, MariaDB)
``sqlite``     journal mode, WAL file size, pages
=============  ==================================================================

Oracle has none: its figures (``V$TRANSACTION``, undo retention) need
privileges an application account rarely has, and no live Oracle checks
them, so the measurement says "not measured on Oracle" instead of guessing.
"""

from __future__ import annotations

from sa_taskqueue.backends.table_health.figures import Finding, OpenTransaction, TableHealth
from sa_taskqueue.backends.table_health.thresholds import HealthThresholds

#: Where these modules were before they moved here (under ``sa_taskqueue.``): those paths import them still.
FORMER_PATHS = {
    f"health.{module}": f"sa_taskqueue.backends.table_health.{module}"
    for module in ("figures", "judge", "thresholds", "postgresql", "mysql", "sqlite")
}

#: The databases a probe measures, for the note on any other.
MEASURED_ON = "PostgreSQL, MySQL, MariaDB and SQLite"

__all__ = ["FORMER_PATHS", "MEASURED_ON", "Finding", "HealthThresholds", "OpenTransaction", "TableHealth"]
