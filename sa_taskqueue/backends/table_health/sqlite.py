"""SQLite: the journal mode, the size of the write-ahead log, and the file's pages.

In WAL mode a commit appends to the ``-wal`` file, and a checkpoint copies
it back into the database; the checkpoint cannot pass the snapshot of the
oldest read transaction still open, so one reader left open lets the log
grow without end, and every read searches it.  The file is not shrunk by a
checkpoint either: its size says how far it got.  Other connections'
transactions cannot be seen from SQL, so none are listed.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime

from sqlalchemy import Connection, Table

from sa_taskqueue.backends.table_health.figures import Finding, TableHealth
from sa_taskqueue.backends.table_health.judge import size_text
from sa_taskqueue.backends.table_health.thresholds import HealthThresholds


def measure(
    conn: Connection, table: Table, now: datetime, thresholds: HealthThresholds, *, label: str
) -> TableHealth:
    """The journal mode, WAL size and pages of the file holding ``table``; ``label`` names the database."""
    schema = table.schema or "main"
    # The schema of an attached database prefixes its pragmas.
    prefix = f"{conn.dialect.identifier_preparer.quote_identifier(schema)}."

    def pragma(name: str) -> int | str | None:
        value = conn.exec_driver_sql(f"PRAGMA {prefix}{name}").scalar()
        return value if isinstance(value, int | str) else None

    journal = str(pragma("journal_mode") or "").lower() or None
    files = {row[1]: row[2] for row in conn.exec_driver_sql("PRAGMA database_list")}
    path = files.get(schema) or None  # "" for a database in memory
    wal_bytes = None
    if path is not None:
        try:
            wal_bytes = os.path.getsize(f"{path}-wal")
        except FileNotFoundError:
            wal_bytes = 0
    notes = [f"other connections' transactions are not visible on {label}"]
    if path is not None and journal != "wal":
        notes.append(
            f"the database is in {journal} journal mode, not WAL: readers wait while a claim writes "
            "(the queue switches a file to WAL on first use, once no other connection is writing)"
        )
    health = TableHealth(
        database=label,
        table=f"{schema}.{table.name}",
        measured_at=now,
        thresholds=thresholds,
        journal_mode=journal,
        wal_bytes=wal_bytes,
        page_size=_int(pragma("page_size")),
        page_count=_int(pragma("page_count")),
        freelist_count=_int(pragma("freelist_count")),
        notes=tuple(notes),
    )
    if wal_bytes is None or wal_bytes <= thresholds.wal_bytes:
        return health
    finding = Finding(
        figure="wal_bytes",
        value=wal_bytes,
        threshold=thresholds.wal_bytes,
        message=(
            f"the write-ahead log {path}-wal has grown to {size_text(wal_bytes)}, "
            "and every read searches what it holds"
        ),
        advice=(
            "close transactions that stay open (a checkpoint cannot pass the oldest reader); "
            "PRAGMA wal_checkpoint(TRUNCATE) then empties the file, and PRAGMA journal_size_limit keeps "
            "it small after each checkpoint"
        ),
    )
    return replace(health, findings=(finding,))


def _int(value: int | str | None) -> int | None:
    return value if isinstance(value, int) else None


__all__ = ["measure"]
