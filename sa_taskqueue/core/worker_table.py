"""The live-worker table beside each task table: who is working, where, on what.

Each worker writes its own row when it starts, moves ``expires_at`` forward
with every heartbeat, and deletes the row when it stops.  A worker that dies
without deleting it (SIGKILL, a lost machine) drops out of every listing once
``expires_at`` has passed, and the next worker to prune removes the row.  The
rows are small and few (one per worker process), so the table has no index
beyond its key: listing it reads every row.

`TaskMixin` declares the table on the same `MetaData` as the task table,
named ``<task table>_workers``, so ``create_all`` and Alembic's autogenerate
see it.
"""

from __future__ import annotations

from sqlalchemy import Column, Integer, MetaData, String, Table

from sa_taskqueue.core.types import JSONDocument, UTCDateTime

WORKER_ID_LENGTH = 255
HOST_LENGTH = 255
VERSION_LENGTH = 64


def worker_table_name(task_table_name: str) -> str:
    """The live-worker table's name for a task table's: ``<task table>_workers``."""
    return f"{task_table_name}_workers"


def worker_table(metadata: MetaData, task_table_name: str) -> Table:
    """The live-worker table of the task table ``task_table_name``, declared on ``metadata`` once."""
    name = worker_table_name(task_table_name)
    key = name if metadata.schema is None else f"{metadata.schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        name,
        metadata,
        # The id a worker writes into ``locked_by`` of the tasks it holds.
        Column("id", String(WORKER_ID_LENGTH), primary_key=True),
        Column("host", String(HOST_LENGTH), nullable=False),
        Column("pid", Integer, nullable=False),
        # The queues it claims from, and the task names it can run: JSON lists.
        Column("queues", JSONDocument, nullable=False),
        Column("task_names", JSONDocument, nullable=False),
        Column("concurrency", Integer, nullable=False),
        # The sa_taskqueue version the worker runs.
        Column("version", String(VERSION_LENGTH), nullable=False),
        Column("started_at", UTCDateTime(), nullable=False),
        Column("heartbeat_at", UTCDateTime(), nullable=False),
        # The worker counts as live until then; each heartbeat moves it on.
        Column("expires_at", UTCDateTime(), nullable=False),
    )


def worker_table_of(task_table: Table) -> Table:
    """The live-worker table beside ``task_table`` (declared by `TaskMixin`), declaring it if missing."""
    return worker_table(task_table.metadata, task_table.name)


__all__ = ["worker_table", "worker_table_name", "worker_table_of"]
