"""What a table health measurement holds: the figures, the open transactions, the findings.

Every figure is None where the database does not have it (a dead-row count on
SQLite) or could not tell (a view the role may not read; the notes say so).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sa_taskqueue.backends.table_health.thresholds import HealthThresholds


@dataclass(frozen=True)
class OpenTransaction:
    """A transaction open elsewhere on the server, which keeps old row versions from being cleaned up.

    While it lasts, PostgreSQL's vacuum may not remove the rows it could
    still see, and InnoDB may not purge their undo records: every claim
    steps over them.
    """

    #: ``"transaction"`` (a session's), ``"prepared transaction"`` or ``"replication slot"``.
    kind: str
    #: How the database names it: ``"pid 4242"``, ``"thread 17"``, ``"'gid'"``, ``"'standby_1'"``.
    who: str
    #: The server process (PostgreSQL) or connection thread (MySQL, MariaDB) id, to end it with.
    pid: int | None
    #: ``"idle in transaction"``, ``"active"``, ``"inactive"``, ...
    state: str | None
    #: When it began (or was prepared), as the server says; None for a replication slot.
    started_at: datetime | None
    #: How long it has been open at the measurement's time; None where no start is known.
    age: timedelta | None
    #: The client's application_name (PostgreSQL), or user@host (MySQL, MariaDB).
    application: str | None
    #: The start of its current or last statement.
    query: str | None
    #: PostgreSQL: how many transactions ago its snapshot (or its own id) was taken.
    xid_age: int | None = None

    def describe(self) -> str:
        """``transaction pid 4242 (idle in transaction, app 'psql')``: who it is, in one phrase."""
        details = [part for part in (self.state, _app(self.application)) if part]
        said = f" ({', '.join(details)})" if details else ""
        return f"{self.kind} {self.who}{said}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "who": self.who,
            "pid": self.pid,
            "state": self.state,
            "started_at": _iso(self.started_at),
            "age_seconds": None if self.age is None else round(self.age.total_seconds(), 3),
            "application": self.application,
            "query": self.query,
            "xid_age": self.xid_age,
        }


@dataclass(frozen=True)
class Finding:
    """A figure over its threshold: what is wrong, and what to do about it, in plain words."""

    #: Which threshold was passed: a field name of `HealthThresholds`.
    figure: str
    #: The figure (seconds for an age, bytes for a size).
    value: float
    #: The threshold it passed.
    threshold: float
    #: What is wrong: "transaction pid 4242 (...) has been open 75 s and holds back vacuum of ...".
    message: str
    #: What to do: "commit or close it; set idle_in_transaction_session_timeout ...".
    advice: str

    @property
    def line(self) -> str:
        """The message and the advice as one line."""
        return f"{self.message}: {self.advice}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "value": self.value,
            "threshold": self.threshold,
            "message": self.message,
            "advice": self.advice,
        }


@dataclass(frozen=True)
class TableHealth:
    """What slows a queue's table, measured at ``measured_at``: figures, findings and notes.

    ``ok`` is true when no figure is over its threshold.  Figures that do not
    apply to the database are None; ``notes`` say what could not be
    measured, and why.
    """

    #: The database, as people name it: "PostgreSQL", "MariaDB", "SQLite".
    database: str
    #: The task table, with its schema where it has one.
    table: str
    #: The time the ages are counted to: the queue's clock, or ``now=``.
    measured_at: datetime
    #: The thresholds the figures were judged against.
    thresholds: HealthThresholds
    # PostgreSQL ----------------------------------------------------------------
    #: Live and dead row versions of the table, as the statistics estimate them.
    live_rows: int | None = None
    dead_rows: int | None = None
    #: When the table was last vacuumed by hand, and by autovacuum (None: never, or stats reset).
    last_vacuum: datetime | None = None
    last_autovacuum: datetime | None = None
    #: Whether autovacuum may vacuum this table (the server setting and the table's own).
    autovacuum: bool | None = None
    # PostgreSQL, MySQL, MariaDB --------------------------------------------------
    #: The oldest transactions open elsewhere that hold back cleanup, oldest first (a few of each kind).
    open_transactions: tuple[OpenTransaction, ...] = ()
    # MySQL, MariaDB -------------------------------------------------------------
    #: InnoDB's history list length: undo records of committed changes not purged yet (server-wide).
    history_list_length: int | None = None
    # SQLite -----------------------------------------------------------------------
    #: ``wal``, ``delete``, ``memory``, ...
    journal_mode: str | None = None
    #: The size of the ``-wal`` file in bytes (0 when there is none); None for a database in memory.
    wal_bytes: int | None = None
    page_size: int | None = None
    page_count: int | None = None
    #: Pages the file holds but no longer uses (VACUUM gives them back).
    freelist_count: int | None = None
    # Judgement --------------------------------------------------------------------
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No figure over its threshold."""
        return not self.findings

    @property
    def oldest_transaction(self) -> OpenTransaction | None:
        """The longest-open transaction of `open_transactions` (sessions and prepared ones)."""
        aged = [tx for tx in self.open_transactions if tx.age is not None]
        return max(aged, key=lambda tx: tx.age or timedelta(0)) if aged else None

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-able: times in ISO 8601, ages in seconds; a figure not measured is null."""
        return {
            "database": self.database,
            "table": self.table,
            "measured_at": _iso(self.measured_at),
            "ok": self.ok,
            "figures": {
                "live_rows": self.live_rows,
                "dead_rows": self.dead_rows,
                "last_vacuum": _iso(self.last_vacuum),
                "last_autovacuum": _iso(self.last_autovacuum),
                "autovacuum": self.autovacuum,
                "open_transactions": [tx.as_dict() for tx in self.open_transactions],
                "history_list_length": self.history_list_length,
                "journal_mode": self.journal_mode,
                "wal_bytes": self.wal_bytes,
                "page_size": self.page_size,
                "page_count": self.page_count,
                "freelist_count": self.freelist_count,
            },
            "thresholds": self.thresholds.as_dict(),
            "findings": [finding.as_dict() for finding in self.findings],
            "notes": list(self.notes),
        }


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _app(application: str | None) -> str | None:
    return f"app {application!r}" if application else None


__all__ = ["Finding", "OpenTransaction", "TableHealth"]
