"""Workflows: dependencies and batches.

Revision ID: a6d1f9c3e8b4
Revises: f3a8d2c5b7e1
Create Date: 2026-11-29 03:30:00.000000

Adds to sa_taskqueue_task, NULL for every existing task and keeping every
row and status as it is:

- ``batch_id``: the batch a task belongs to, with an index (partial where
  the database has them: non-NULL rows only);
- ``parents_pending``: while a task waits, how many parents have not finished;
- ``on_parent_failure``: what a failed or cancelled parent does to it;
- ``has_dependents``: set on a task once some task depends on it;

and creates ``sa_taskqueue_task_dependencies`` (one row per edge, parent to
child) and ``sa_taskqueue_task_batches`` (one row per batch with its counts
and callbacks).  The new status ``waiting`` needs no DDL: status is a plain
VARCHAR without a CHECK constraint.

Plain nullable columns: ALTER TABLE ADD COLUMN on every database, SQLite
included.  As in the earlier revisions, every type is written out here.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sa_taskqueue.types import JSONDocument, UTCDateTime

# revision identifiers, used by Alembic.
revision: str = "a6d1f9c3e8b4"
down_revision: str | Sequence[str] | None = "f3a8d2c5b7e1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_taskqueue_task"
DEPENDENCIES = "sa_taskqueue_task_dependencies"
BATCHES = "sa_taskqueue_task_batches"
COLUMNS = ("batch_id", "parents_pending", "on_parent_failure", "has_dependents")


def upgrade() -> None:
    """Add the workflow columns to sa_taskqueue_task; create the dependency and batch tables."""
    op.add_column(TABLE, sa.Column("batch_id", sa.BigInteger(), nullable=True))
    op.add_column(TABLE, sa.Column("parents_pending", sa.Integer(), nullable=True))
    # No length on SQLite, which enforces none: appended after the generated
    # columns, "VARCHAR(16)" would end SQLAlchemy's reading of their
    # expressions in the stored CREATE statement at its parenthesis.
    op.add_column(
        TABLE,
        sa.Column("on_parent_failure", sa.String(16).with_variant(sa.String(), "sqlite"), nullable=True),
    )
    op.add_column(TABLE, sa.Column("has_dependents", sa.Boolean(), nullable=True))
    op.create_index(
        "ix_sa_taskqueue_task_batch",
        TABLE,
        ["batch_id"],
        postgresql_where=sa.text("batch_id IS NOT NULL"),
        sqlite_where=sa.text("batch_id IS NOT NULL"),
    )
    op.create_table(
        DEPENDENCIES,
        sa.Column("parent_id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("child_id", sa.BigInteger(), primary_key=True, autoincrement=False),
    )
    op.create_index(f"ix_{DEPENDENCIES}_child", DEPENDENCIES, ["child_id"])
    op.create_table(
        BATCHES,
        sa.Column(
            "id",
            # SQLite only auto-increments an INTEGER PRIMARY KEY (a rowid alias).
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(),
            primary_key=True,
        ),
        sa.Column("name", sa.String(255), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("closed_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("succeeded", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("failed", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("cancelled", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("callbacks", JSONDocument(), nullable=True),
    )


def downgrade() -> None:
    """Drop the workflow tables and columns.

    The tasks stay; a task still waiting on parents becomes queued, since
    nothing would release it any more.
    """
    op.execute(sa.text(f"UPDATE {TABLE} SET status = 'queued' WHERE status = 'waiting'"))
    op.drop_table(BATCHES)
    op.drop_index(f"ix_{DEPENDENCIES}_child", table_name=DEPENDENCIES)
    op.drop_table(DEPENDENCIES)
    op.drop_index("ix_sa_taskqueue_task_batch", table_name=TABLE)
    # SQLite has ALTER TABLE DROP COLUMN since 3.35.
    for column in reversed(COLUMNS):
        op.drop_column(TABLE, column)
