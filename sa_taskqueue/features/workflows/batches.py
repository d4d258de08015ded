"""Batches: the counts of a batch's members, moved in the transaction of each member's final write.

A minimal version: it keeps the counts exact.  Closing a batch and its
callbacks come with the batch API.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Connection, Table, update

from sa_taskqueue.core.batch_table import batch_table_of
from sa_taskqueue.core.finished import FinishedTask
from sa_taskqueue.core.model import TaskStatus

#: The batch column each final status counts in.
COUNTED_IN = {
    TaskStatus.COMPLETED: "succeeded",
    TaskStatus.FAILED: "failed",
    TaskStatus.CANCELLED: "cancelled",
}


def members_finished(conn: Connection, table: Table, members: Sequence[FinishedTask], now: datetime) -> None:
    """Count ``members`` (each with a ``batch_id``) into their batches, in ``conn``'s open transaction.

    One UPDATE per batch, adding to each count; called by
    `sa_taskqueue.features.workflows.bookkeeping.after_final` with the
    members whose final status that transaction wrote, each exactly once.
    """
    del now  # (the time a batch finishes, for the callbacks)
    batches = batch_table_of(table)
    per_batch: dict[int, Counter[str]] = {}
    for member in members:
        if member.batch_id is not None:
            per_batch.setdefault(member.batch_id, Counter())[COUNTED_IN[TaskStatus(member.status)]] += 1
    # In id order, so two transactions counting into the same batches lock them in one order.
    for batch_id, counts in sorted(per_batch.items()):
        conn.execute(
            update(batches)
            .where(batches.c.id == batch_id)
            .values({name: batches.c[name] + count for name, count in sorted(counts.items())})
        )


__all__ = ["members_finished"]
