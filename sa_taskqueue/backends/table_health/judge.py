"""What the database probes share: figures in words, and the finding for a transaction open too long."""

from __future__ import annotations

from datetime import datetime, timedelta

from sa_taskqueue.backends.table_health.figures import Finding, OpenTransaction
from sa_taskqueue.backends.table_health.thresholds import MIB, HealthThresholds

#: How many of the oldest open transactions (of each kind) a measurement lists, however young...
TRANSACTIONS_LISTED = 5
#: ...and how many it reads, oldest first, to list every one open longer than the threshold.
TRANSACTIONS_READ = 100
#: How much of a transaction's statement is kept: enough to recognise it.
QUERY_PREFIX = 80


def age_text(age: timedelta) -> str:
    """``75 s``, ``12 min``, ``3.4 h``, ``2.1 d``."""
    seconds = max(age.total_seconds(), 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def size_text(size: int) -> str:
    """``812 KiB``, ``80.0 MiB``."""
    if size < MIB:
        return f"{size / 1024:.0f} KiB"
    return f"{size / MIB:.1f} MiB"


def age_since(started: datetime | None, now: datetime) -> timedelta | None:
    """How long ago ``started`` was at ``now``; never negative (the server's clock and ours may differ)."""
    if started is None:
        return None
    return max(now - started, timedelta(0))


def first_line(text: str | None) -> str | None:
    """The start of a statement on one line, as much as `QUERY_PREFIX` allows."""
    if text is None:
        return None
    flat = " ".join(text.split())
    return flat[:QUERY_PREFIX] or None


def open_too_long(transaction: OpenTransaction, thresholds: HealthThresholds) -> bool:
    return transaction.age is not None and transaction.age > thresholds.transaction_age


def worth_listing(transactions: list[OpenTransaction], thresholds: HealthThresholds) -> list[OpenTransaction]:
    """Of ``transactions`` (oldest first), the few oldest and every one open too long."""
    return [
        transaction
        for position, transaction in enumerate(transactions)
        if position < TRANSACTIONS_LISTED or open_too_long(transaction, thresholds)
    ]


def transaction_finding(
    transaction: OpenTransaction, thresholds: HealthThresholds, consequence: str, advice: str
) -> Finding:
    """ "<transaction> has been open 75 s and <consequence>": <advice>."""
    assert transaction.age is not None
    return Finding(
        figure="transaction_age",
        value=round(transaction.age.total_seconds(), 3),
        threshold=thresholds.transaction_age.total_seconds(),
        message=f"{transaction.describe()} has been open {age_text(transaction.age)} and {consequence}",
        advice=advice,
    )


__all__ = [
    "QUERY_PREFIX",
    "TRANSACTIONS_LISTED",
    "TRANSACTIONS_READ",
    "age_since",
    "age_text",
    "first_line",
    "open_too_long",
    "size_text",
    "transaction_finding",
    "worth_listing",
]
