"""The control table beside each task table: paused queues, periodic schedules, and who runs retention.

A few rows of state that every worker reads and any of them may change, kept
in the application's database like the tasks themselves, so that a pause or
a schedule holds for every worker on every machine.  Each row is keyed by
what it controls, ``(kind, name)``:

- ``("queue", <queue>)``: ``paused_at`` is set while the queue is paused.
- ``("schedule", <task name>)``: ``last_slot`` is the last slot of a periodic
  task that was enqueued; a worker enqueues a slot only by moving it forward
  with a conditional UPDATE, so each slot is enqueued once.
- ``("retention", <table>)``: ``held_by`` / ``held_until`` is a lease, so
  that one worker at a time deletes finished tasks.

`TaskMixin` declares the table on the same `MetaData` as the task table,
named ``<task table>_control``, so ``create_all`` and Alembic's autogenerate
see both.
"""

from __future__ import annotations

from sqlalchemy import Column, MetaData, String, Table

from sa_taskqueue.core.types import UTCDateTime

KIND_LENGTH = 16
NAME_LENGTH = 255

#: The kinds of row (``kind`` column).
QUEUE = "queue"
SCHEDULE = "schedule"
RETENTION = "retention"
METRICS = "metrics"


def control_table_name(task_table_name: str) -> str:
    """The control table's name for a task table's: ``<task table>_control``."""
    return f"{task_table_name}_control"


def control_table(metadata: MetaData, task_table_name: str) -> Table:
    """The control table of the task table ``task_table_name``, declared on ``metadata`` once."""
    name = control_table_name(task_table_name)
    key = name if metadata.schema is None else f"{metadata.schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        name,
        metadata,
        Column("kind", String(KIND_LENGTH), primary_key=True),
        Column("name", String(NAME_LENGTH), primary_key=True),
        Column("paused_at", UTCDateTime()),
        Column("last_slot", UTCDateTime()),
        Column("held_by", String(NAME_LENGTH)),
        Column("held_until", UTCDateTime()),
        Column("updated_at", UTCDateTime(), nullable=False),
    )


def control_table_of(task_table: Table) -> Table:
    """The control table declared beside ``task_table`` (by `TaskMixin`), declaring it if it is missing."""
    return control_table(task_table.metadata, task_table.name)


__all__ = [
    "METRICS",
    "QUEUE",
    "RETENTION",
    "SCHEDULE",
    "control_table",
    "control_table_name",
    "control_table_of",
]
