"""Live workers and task headers.

Revision ID: d7a3e5f1c2b8
Revises: c41d7e2a9f10
Create Date: 2026-11-29 00:10:00.000000

Adds to sa_taskqueue_task, keeping every row and status as it is:

- ``headers``, NULL for every existing task: what the enqueuing code carried
  beside the params (the trace context of the request that enqueued it);

and creates ``sa_taskqueue_task_workers``, one row per live worker process
(its host, pid, queues, task names, concurrency, version and heartbeat).

As in the earlier revisions, every type is written out here rather than
read from the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sa_taskqueue.types import JSONDocument, UTCDateTime

# revision identifiers, used by Alembic.
revision: str = "d7a3e5f1c2b8"
down_revision: str | Sequence[str] | None = "c41d7e2a9f10"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_taskqueue_task"
WORKERS = "sa_taskqueue_task_workers"


def upgrade() -> None:
    """Add ``headers`` to sa_taskqueue_task; create sa_taskqueue_task_workers."""
    # A plain nullable column: ALTER TABLE ADD COLUMN on every database,
    # SQLite included (no rebuild, which could not copy the generated
    # columns of the previous revision).
    op.add_column(TABLE, sa.Column("headers", JSONDocument(), nullable=True))
    op.create_table(
        WORKERS,
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("queues", JSONDocument(), nullable=False),
        sa.Column("task_names", JSONDocument(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("heartbeat_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    """Drop the worker table and ``headers``: the tasks and their statuses stay."""
    op.drop_table(WORKERS)
    # SQLite has ALTER TABLE DROP COLUMN since 3.35.
    op.drop_column(TABLE, "headers")
