"""PostgreSQL: the table's dead row versions, and the transactions that keep vacuum from removing them.

A claim's ``FOR UPDATE SKIP LOCKED`` scan reads every row version on its
way, dead ones included.  Vacuum removes a dead version only once no
transaction could still see it: the oldest snapshot or transaction id of
any session of the database (its *xmin horizon*), of a prepared
transaction, or of a standby through a replication slot.  One session left
``idle in transaction`` for an hour keeps an hour of a busy queue's dead
rows in the table.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, String, Table, bindparam, text

from sa_taskqueue.backends.table_health.figures import Finding, OpenTransaction, TableHealth
from sa_taskqueue.backends.table_health.judge import (
    QUERY_PREFIX,
    TRANSACTIONS_LISTED,
    TRANSACTIONS_READ,
    age_since,
    age_text,
    first_line,
    open_too_long,
    transaction_finding,
    worth_listing,
)
from sa_taskqueue.backends.table_health.thresholds import HealthThresholds

# The table's counters, looked up by its regclass (the name resolved as the
# queue's own statements resolve it: schema given, or the search_path).
# autovacuum is the server's setting and the table's own storage parameter.
TABLE_FIGURES = text(
    """
    SELECT n.nspname AS schema_name, c.relname AS table_name,
           s.n_live_tup AS live_rows, s.n_dead_tup AS dead_rows,
           s.last_vacuum, s.last_autovacuum,
           current_setting('autovacuum')::boolean AND coalesce(
               (SELECT o.option_value::boolean FROM pg_options_to_table(c.reloptions) AS o
                WHERE o.option_name = 'autovacuum_enabled'),
               true) AS autovacuum,
           current_setting('is_superuser') = 'on'
               OR pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER') AS sees_all_sessions
    FROM pg_class AS c
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
    WHERE c.oid = to_regclass(:table)
    """
).bindparams(bindparam("table", type_=String()))

# Sessions whose snapshot (backend_xmin) or own transaction id (backend_xid)
# holds the horizon of this database; a walsender's carries a standby's
# (hot_standby_feedback) for every database.  Vacuum ignores autovacuum
# workers' snapshots, and a parallel worker repeats its leader's.
SESSIONS = text(
    f"""
    SELECT a.pid, a.state, a.xact_start, a.application_name, a.backend_type,
           left(a.query, {QUERY_PREFIX}) AS query,
           greatest(age(a.backend_xmin), age(a.backend_xid)) AS xid_age
    FROM pg_stat_activity AS a
    WHERE a.pid <> pg_backend_pid()
      AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
      AND (a.datname = current_database() OR a.backend_type = 'walsender')
      AND a.backend_type NOT IN ('autovacuum worker', 'parallel worker')
    ORDER BY a.xact_start NULLS LAST, a.pid
    LIMIT {TRANSACTIONS_READ}
    """
)

# A prepared transaction keeps its snapshot until COMMIT PREPARED or ROLLBACK
# PREPARED, whatever becomes of the session that prepared it.
PREPARED = text(
    f"""
    SELECT gid, prepared, owner, age(transaction) AS xid_age
    FROM pg_prepared_xacts
    WHERE database = current_database()
    ORDER BY prepared
    LIMIT {TRANSACTIONS_READ}
    """
)

# A physical slot with a standby's feedback keeps its xmin even while the
# standby is away.  (A logical slot's catalog_xmin holds back the system
# catalogs only.)
SLOTS = text(
    f"""
    SELECT slot_name, active, active_pid, age(xmin) AS xid_age
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL
    ORDER BY age(xmin) DESC
    LIMIT {TRANSACTIONS_LISTED}
    """
)


def measure(
    conn: Connection, table: Table, now: datetime, thresholds: HealthThresholds, *, label: str
) -> TableHealth | None:
    """The figures of ``table`` and of the transactions that hold back its vacuum, judged at ``now``.

    None when the name does not resolve to a table (``to_regclass``), as the
    queue's own statements would resolve it.  ``label`` names the database.
    """
    name = conn.dialect.identifier_preparer.format_table(table)
    row = conn.execute(TABLE_FIGURES, {"table": name}).mappings().first()
    if row is None:
        return None
    # Quoted where it must be, so that the advice's VACUUM can be pasted as it is.
    preparer = conn.dialect.identifier_preparer
    shown = f"{preparer.quote_schema(row['schema_name'])}.{preparer.quote(row['table_name'])}"
    sessions = [_session(found, now) for found in conn.execute(SESSIONS).mappings()]
    prepared = [_prepared(found, now) for found in conn.execute(PREPARED).mappings()]
    transactions = [
        *worth_listing(sessions, thresholds),
        *worth_listing(prepared, thresholds),
        *(_slot(found) for found in conn.execute(SLOTS).mappings()),
    ]
    notes = []
    if row["live_rows"] is None:
        notes.append(f"no statistics for {shown} yet (track_counts is off, or they were just reset)")
    if not row["sees_all_sessions"]:
        notes.append(
            "this role sees when other roles' transactions began only as a superuser or a member of "
            "pg_read_all_stats: their age is unknown here"
        )
    health = TableHealth(
        database=label,
        table=shown,
        measured_at=now,
        thresholds=thresholds,
        live_rows=row["live_rows"],
        dead_rows=row["dead_rows"],
        last_vacuum=_utc(row["last_vacuum"]),
        last_autovacuum=_utc(row["last_autovacuum"]),
        autovacuum=row["autovacuum"],
        open_transactions=tuple(transactions),
        notes=tuple(notes),
    )
    holders = [tx for tx in transactions if open_too_long(tx, thresholds)]
    findings = [
        transaction_finding(tx, thresholds, f"holds back vacuum of {shown}", _ending_advice(tx))
        for tx in holders
    ]
    dead = _dead_rows_finding(health, holders)
    if dead is not None:
        findings.append(dead)
    return replace(health, findings=tuple(findings))


def _session(row: Any, now: datetime) -> OpenTransaction:
    started = _utc(row["xact_start"])
    walsender = row["backend_type"] == "walsender"
    return OpenTransaction(
        kind="standby feedback" if walsender else "transaction",
        who=f"pid {row['pid']}",
        pid=row["pid"],
        state=row["state"],
        started_at=started,
        age=age_since(started, now),
        application=row["application_name"] or None,
        query=first_line(row["query"]),
        xid_age=row["xid_age"],
    )


def _prepared(row: Any, now: datetime) -> OpenTransaction:
    started = _utc(row["prepared"])
    return OpenTransaction(
        kind="prepared transaction",
        who=repr(row["gid"]),
        pid=None,
        state=f"prepared by {row['owner']}",
        started_at=started,
        age=age_since(started, now),
        application=None,
        query=None,
        xid_age=row["xid_age"],
    )


def _slot(row: Any) -> OpenTransaction:
    return OpenTransaction(
        kind="replication slot",
        who=repr(row["slot_name"]),
        pid=row["active_pid"],
        state="active" if row["active"] else "inactive",
        started_at=None,
        age=None,
        application=None,
        query=None,
        xid_age=row["xid_age"],
    )


def _ending_advice(transaction: OpenTransaction) -> str:
    if transaction.kind == "prepared transaction":
        return (
            f"finish it with COMMIT PREPARED {transaction.who} or ROLLBACK PREPARED {transaction.who}; "
            "a prepared transaction outlives its session and restarts of the server"
        )
    if (transaction.state or "").startswith("idle in transaction"):
        return (
            f"commit or close it (SELECT pg_terminate_backend({transaction.pid}) ends it now); "
            "set idle_in_transaction_session_timeout so that the server ends such sessions"
        )
    return (
        f"let it finish or cancel it (SELECT pg_cancel_backend({transaction.pid})); "
        "statement_timeout, and transaction_timeout from PostgreSQL 17 on, bound such work"
    )


def _dead_rows_finding(health: TableHealth, holders: list[OpenTransaction]) -> Finding | None:
    """Dead row versions over both thresholds: many of them, and many beside the live rows."""
    dead, live, thresholds = health.dead_rows, health.live_rows or 0, health.thresholds
    if dead is None:
        return None
    bound = max(float(thresholds.dead_rows), thresholds.dead_row_ratio * live)
    if dead <= bound:
        return None
    if holders:
        oldest = max(holders, key=lambda holder: holder.age or timedelta(0))
        advice = (
            f"vacuum cannot remove them while {oldest.kind} {oldest.who} is open: end it, then "
            f"run VACUUM {health.table}"
        )
    elif health.autovacuum is False:
        advice = (
            f"autovacuum does not run on {health.table} (the server's autovacuum setting, or the table's "
            f"autovacuum_enabled, is off): turn it on, or run VACUUM {health.table} on a schedule"
        )
    else:
        ran = (
            f"{age_text(health.measured_at - health.last_autovacuum)} ago"
            if health.last_autovacuum is not None
            else "never since the statistics were reset"
        )
        advice = (
            f"run VACUUM {health.table} (autovacuum last ran {ran}); if it keeps coming back, "
            "lower the table's autovacuum_vacuum_scale_factor"
        )
    return Finding(
        figure="dead_rows",
        value=dead,
        threshold=bound,
        message=(
            f"{health.table} holds {dead:,} dead row versions beside {live:,} live ones, "
            "and claims step over every one of them"
        ),
        advice=advice,
    )


def _utc(moment: datetime | None) -> datetime | None:
    return None if moment is None else moment.astimezone(UTC)


__all__ = ["measure"]
