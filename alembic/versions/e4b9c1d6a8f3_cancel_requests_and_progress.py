"""Cancel requests and progress.

Revision ID: e4b9c1d6a8f3
Revises: d7a3e5f1c2b8
Create Date: 2026-11-29 00:45:00.000000

Adds to sa_taskqueue_task, NULL for every existing task and keeping every
row and status as it is:

- ``cancel_requested_at`` and ``cancelled_by``: a request to cancel a task
  while it runs, and who cancelled a task;
- ``progress``, ``progress_note`` and ``progress_at``: what a running task
  last reported of its progress.

Plain nullable columns: ALTER TABLE ADD COLUMN on every database, SQLite
included.  As in the earlier revisions, every type is written out here.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sa_taskqueue.types import JSONDocument, UTCDateTime

# revision identifiers, used by Alembic.
revision: str = "e4b9c1d6a8f3"
down_revision: str | Sequence[str] | None = "d7a3e5f1c2b8"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_taskqueue_task"
COLUMNS = ("cancel_requested_at", "cancelled_by", "progress", "progress_note", "progress_at")


def upgrade() -> None:
    """Add the cancel-request and progress columns to sa_taskqueue_task."""
    op.add_column(TABLE, sa.Column("cancel_requested_at", UTCDateTime(), nullable=True))
    # No length on SQLite, which enforces none: appended after the generated
    # columns, "VARCHAR(255)" would end SQLAlchemy's reading of their
    # expressions in the stored CREATE statement at its parenthesis.
    op.add_column(
        TABLE, sa.Column("cancelled_by", sa.String(255).with_variant(sa.String(), "sqlite"), nullable=True)
    )
    op.add_column(TABLE, sa.Column("progress", sa.Float(), nullable=True))
    op.add_column(TABLE, sa.Column("progress_note", JSONDocument(), nullable=True))
    op.add_column(TABLE, sa.Column("progress_at", UTCDateTime(), nullable=True))


def downgrade() -> None:
    """Drop them again (SQLite has ALTER TABLE DROP COLUMN since 3.35): the tasks stay."""
    for column in reversed(COLUMNS):
        op.drop_column(TABLE, column)
