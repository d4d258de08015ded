"""`health_lines`: a `TableHealth` as lines of text, for ``sa-taskqueue health`` and ``doctor``."""

from __future__ import annotations

from datetime import datetime

from sa_taskqueue.backends.table_health.figures import OpenTransaction, TableHealth
from sa_taskqueue.backends.table_health.judge import age_text, size_text


def health_lines(health: TableHealth) -> list[str]:
    """One heading, one line per group of figures the database has, then each finding and note.

    Findings start with ``finding:`` and notes with ``note:``, so a reader
    (or a grep) finds them; nothing is coloured or wrapped.
    """
    count = len(health.findings)
    verdict = "ok" if health.ok else f"{count} finding{'s' if count > 1 else ''}"
    lines = [f"table health of {health.table} ({health.database}): {verdict}"]
    if health.live_rows is not None or health.dead_rows is not None:
        lines.append(
            f"rows: {_count(health.live_rows)} live, {_count(health.dead_rows)} dead; "
            f"last autovacuum {_when(health.last_autovacuum, health.measured_at)}, "
            f"last VACUUM {_when(health.last_vacuum, health.measured_at)}"
            + ("; autovacuum does not run on it" if health.autovacuum is False else "")
        )
    if health.history_list_length is not None:
        lines.append(f"history list length: {health.history_list_length:,} undo records not purged yet")
    if health.journal_mode is not None:
        wal = f"; WAL file {size_text(health.wal_bytes)}" if health.wal_bytes is not None else ""
        lines.append(
            f"journal mode {health.journal_mode}{wal}; {_count(health.page_count)} pages of "
            f"{_count(health.page_size)} bytes, {_count(health.freelist_count)} free"
        )
    if health.live_rows is not None or health.history_list_length is not None or health.open_transactions:
        if not health.open_transactions:
            lines.append("open transactions holding back cleanup: none")
        for transaction in health.open_transactions:
            lines.append(f"open: {_transaction(transaction)}")
    lines.extend(f"finding: {finding.line}" for finding in health.findings)
    lines.extend(f"note: {note}" for note in health.notes)
    return lines


def _transaction(transaction: OpenTransaction) -> str:
    parts = [transaction.describe()]
    if transaction.age is not None:
        parts.append(f"open {age_text(transaction.age)}")
    if transaction.xid_age is not None:
        parts.append(f"snapshot {transaction.xid_age:,} transactions old")
    if transaction.query:
        parts.append(f"query: {transaction.query}")
    return ", ".join(parts)


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _when(moment: datetime | None, now: datetime) -> str:
    return "never" if moment is None else f"{age_text(now - moment)} ago"


__all__ = ["health_lines"]
