"""MySQL and MariaDB: InnoDB's history list length, and the oldest transactions open on the server.

InnoDB keeps the old versions of changed rows (undo records, counted by the
history list) until no open transaction's read view may still need them;
purge then removes them.  A claim that meets a row changed since walks back
through its versions, so a history list in the millions, usually kept
there by one transaction left open, slows every claim.  Purge serves the
whole server: a transaction in any database holds it back.

Both views need the PROCESS privilege; without it the figures are None and
a note says so.  InnoDB refreshes what INNODB_TRX shows only once nobody has
read it for 0.1 s: a transaction begun or ended just now may not be seen yet,
nor while monitors read the view more often than that.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Table, text
from sqlalchemy.exc import DBAPIError

from sa_taskqueue.backends.table_health.figures import Finding, OpenTransaction, TableHealth
from sa_taskqueue.backends.table_health.judge import (
    QUERY_PREFIX,
    TRANSACTIONS_READ,
    age_since,
    age_text,
    first_line,
    open_too_long,
    transaction_finding,
    worth_listing,
)
from sa_taskqueue.backends.table_health.thresholds import HealthThresholds

#: ER_SPECIFIC_ACCESS_DENIED_ERROR: "you need (at least one of) the PROCESS privilege(s)".
ACCESS_DENIED = 1227
#: Isolation levels whose read view lasts one statement, not the transaction.
NO_READ_VIEW = frozenset({"READ COMMITTED", "READ UNCOMMITTED"})

# INNODB_METRICS has the counter on MySQL 8 and MariaDB alike (enabled by
# default on both); only NAME and COUNT are common to the two views.
HISTORY_LENGTH = text(
    "SELECT `COUNT` FROM information_schema.INNODB_METRICS WHERE NAME = 'trx_rseg_history_len'"
)

# trx_started is the server's system time (not the session's time zone), in
# whole seconds: CONVERT_TZ from 'SYSTEM' makes it UTC.  PROCESSLIST says
# whether the connection is idle ("Sleep") between statements.
TRANSACTIONS = text(
    f"""
    SELECT t.trx_mysql_thread_id AS thread_id, t.trx_state AS trx_state,
           CONVERT_TZ(t.trx_started, 'SYSTEM', '+00:00') AS started,
           t.trx_isolation_level AS isolation, t.trx_rows_modified AS rows_modified,
           LEFT(COALESCE(t.trx_query, p.INFO), {QUERY_PREFIX}) AS query,
           p.USER AS user_name, p.HOST AS host, p.COMMAND AS command
    FROM information_schema.INNODB_TRX AS t
    LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = t.trx_mysql_thread_id
    WHERE t.trx_mysql_thread_id <> CONNECTION_ID()
    ORDER BY t.trx_started, t.trx_mysql_thread_id
    LIMIT {TRANSACTIONS_READ}
    """
)


def measure(
    conn: Connection, table: Table, now: datetime, thresholds: HealthThresholds, *, label: str, mariadb: bool
) -> TableHealth:
    """The history list length and the oldest open transactions, judged at ``now``.

    ``label`` names the database; ``mariadb`` says whether the server is
    MariaDB, whose settings for ending long transactions have other names.
    """
    notes: list[str] = []
    history = _privileged(
        conn, lambda: conn.execute(HISTORY_LENGTH).scalar(), "the history list length", notes
    )
    rows = _privileged(conn, lambda: list(conn.execute(TRANSACTIONS).mappings()), "open transactions", notes)
    transactions = worth_listing([_transaction(row, now) for row in rows or ()], thresholds)
    # A READ COMMITTED (or UNCOMMITTED) transaction that changed nothing has no
    # read view between statements: it holds back no purge, only its locks.
    readers = {
        row["thread_id"]
        for row in rows or ()
        if row["isolation"] in NO_READ_VIEW and not row["rows_modified"]
    }
    health = TableHealth(
        database=label,
        table=".".join(part for part in (table.schema or conn.engine.url.database, table.name) if part),
        measured_at=now,
        thresholds=thresholds,
        open_transactions=tuple(transactions),
        history_list_length=None if history is None else int(history),
        notes=tuple(notes),
    )
    holders = [tx for tx in transactions if open_too_long(tx, thresholds)]
    findings = [
        transaction_finding(
            tx,
            thresholds,
            "holds metadata locks on the tables it read"
            if tx.pid in readers
            else "holds back InnoDB's purge of old row versions",
            _ending_advice(tx, mariadb=mariadb),
        )
        for tx in holders
    ]
    history_finding = _history_finding(health, [tx for tx in holders if tx.pid not in readers])
    if history_finding is not None:
        findings.append(history_finding)
    return replace(health, findings=tuple(findings))


def _privileged(conn: Connection, read: Any, what: str, notes: list[str]) -> Any:
    """``read()``, or None with a note when the account lacks the PROCESS privilege."""
    try:
        return read()
    except DBAPIError as error:
        args = getattr(error.orig, "args", ())
        if not args or args[0] != ACCESS_DENIED:
            raise
        notes.append(f"{what}: not measured, the database account needs the PROCESS privilege")
        return None


def _transaction(row: Any, now: datetime) -> OpenTransaction:
    started = row["started"]
    started = None if started is None else started.replace(tzinfo=UTC)
    idle = row["command"] == "Sleep"
    user = f"{row['user_name']}@{row['host']}" if row["user_name"] else None
    return OpenTransaction(
        kind="transaction",
        who=f"thread {row['thread_id']}",
        pid=row["thread_id"],
        state="idle in transaction" if idle else str(row["trx_state"]).lower(),
        started_at=started,
        age=age_since(started, now),
        application=user,
        query=first_line(row["query"]),
    )


def _ending_advice(transaction: OpenTransaction, *, mariadb: bool) -> str:
    if transaction.state == "idle in transaction":
        timeout = (
            "set idle_transaction_timeout so that the server ends such sessions"
            if mariadb
            else "a lower wait_timeout for such clients makes the server end them"
        )
        return f"commit or close it (KILL {transaction.pid} ends it now); {timeout}"
    limit = "max_statement_time" if mariadb else "max_execution_time"
    return (
        f"let it finish or stop its statement (KILL QUERY {transaction.pid}); {limit} bounds long statements"
    )


def _history_finding(health: TableHealth, holders: list[OpenTransaction]) -> Finding | None:
    length, thresholds = health.history_list_length, health.thresholds
    if length is None or length <= thresholds.history_list_length:
        return None
    oldest = holders[0] if holders else health.oldest_transaction
    if oldest is not None and oldest.age is not None:
        advice = (
            f"purge waits for the oldest open transaction, {oldest.kind} {oldest.who}, open "
            f"{age_text(oldest.age)}: end it, and purge catches up"
        )
    else:
        advice = (
            "no transaction is open long now: purge is catching up; if it does not, add innodb_purge_threads"
        )
    return Finding(
        figure="history_list_length",
        value=length,
        threshold=thresholds.history_list_length,
        message=(
            f"InnoDB's history list holds {length:,} undo records not purged yet, "
            "and claims walk through the old row versions they keep"
        ),
        advice=advice,
    )


__all__ = ["ACCESS_DENIED", "measure"]
