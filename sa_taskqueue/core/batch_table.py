"""The batch table beside each task table: one row per batch of tasks.

Each row holds the batch's counts by outcome, moved in the same transaction
as each member's fenced final write; ``closed_at``, set when no more members
may be added; and ``finished_at``, set exactly once by the conditional
UPDATE that also enqueues the batch's callbacks.  Members name their batch
in the task table's ``batch_id``.  No foreign key: retention deletes
finished members, and the batch row outlives them.

`TaskMixin` declares the table on the same `MetaData` as the task table,
named ``<task table>_batches``, so ``create_all`` and Alembic's autogenerate
see it.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Identity, Integer, MetaData, String, Table, text

from sa_taskqueue.backends import dialects_with
from sa_taskqueue.core.types import JSONDocument, UTCDateTime

NAME_LENGTH = 255


def batch_table_name(task_table_name: str) -> str:
    """The batch table's name for a task table's: ``<task table>_batches``."""
    return f"{task_table_name}_batches"


def _count(name: str) -> Column[int]:
    return Column(name, Integer, nullable=False, default=0, server_default=text("0"))


def batch_table(metadata: MetaData, task_table_name: str) -> Table:
    """The batch table of the task table ``task_table_name``, declared on ``metadata`` once."""
    name = batch_table_name(task_table_name)
    key = name if metadata.schema is None else f"{metadata.schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        name,
        metadata,
        Column(
            "id",
            # SQLite only auto-increments an INTEGER PRIMARY KEY (a rowid alias), not BIGINT.
            BigInteger().with_variant(Integer(), *dialects_with("autoincrement_needs_integer_key")),
            Identity(),
            primary_key=True,
        ),
        Column("name", String(NAME_LENGTH)),
        Column("created_at", UTCDateTime(), nullable=False),
        # Members may be added while NULL.
        Column("closed_at", UTCDateTime()),
        # Set exactly once, by the conditional UPDATE that enqueues the callbacks.
        Column("finished_at", UTCDateTime()),
        _count("total"),
        _count("succeeded"),
        _count("failed"),
        _count("cancelled"),
        # The callbacks to enqueue when the batch finishes (a JSON list of specs).
        Column("callbacks", JSONDocument),
    )


def batch_table_of(task_table: Table) -> Table:
    """The batch table beside ``task_table`` (declared by `TaskMixin`), declaring it if missing."""
    return batch_table(task_table.metadata, task_table.name)


__all__ = ["batch_table", "batch_table_name", "batch_table_of"]
