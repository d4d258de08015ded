"""Scheduling controls: unique keys, concurrency slots, retention's index, and the control table.

Revision ID: c41d7e2a9f10
Revises: b2b218417438
Create Date: 2026-11-23 22:30:00.000000

Adds to sa_taskqueue_task, keeping every row and status as it is:

- ``unique_key``, ``concurrency_key`` and ``concurrency_slot``, NULL for
  every existing task;
- two generated columns that are NULL unless a task holds a key
  (``active_unique_key`` while queued or running, ``running_slot_key``
  while running), each with a unique index: the database, not a check before
  an insert, keeps unique keys and concurrency slots single.  PostgreSQL and
  SQLite index only non-NULL values (partial indexes); on Oracle an index on
  a virtual column is a function-based index;
- ``ix_sa_taskqueue_task_finished`` (status, finished_at), which retention
  deletes by;

and creates ``sa_taskqueue_task_control`` (paused queues, periodic
schedules' last slots, the retention lease).

PostgreSQL indexes only stored generated columns, so adding them rewrites
the table there once; elsewhere they are virtual and added in place.  As in
the first revision, every expression is written out here rather than
imported from the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sa_taskqueue.model import IndexableComputed
from sa_taskqueue.types import UTCDateTime

# revision identifiers, used by Alembic.
revision: str = "c41d7e2a9f10"
down_revision: str | Sequence[str] | None = "b2b218417438"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_taskqueue_task"
CONTROL = "sa_taskqueue_task_control"
PARTIAL_INDEX_DIALECTS = ("postgresql", "sqlite")
GENERATED_COLUMNS = ("running_slot_key", "active_unique_key")


def _text(name: str) -> sa.ColumnElement[str]:
    return sa.literal_column(name, sa.String())


def _status_in(*statuses: str) -> sa.ColumnElement[bool]:
    return sa.literal_column("status").in_([sa.literal_column(f"'{status}'") for status in statuses])


def _active_unique_key() -> sa.ColumnElement[str]:
    name, key = _text("name"), _text("unique_key")
    return sa.case(
        (
            sa.and_(
                sa.literal_column("status").in_(
                    [sa.literal_column("'queued'"), sa.literal_column("'running'")]
                ),
                key.is_not(None),
            ),
            sa.cast(sa.func.length(name), sa.String(10)) + sa.literal_column("':'", sa.String()) + name + key,
        )
    )


def _running_slot_key() -> sa.ColumnElement[str]:
    key, slot = _text("concurrency_key"), sa.literal_column("concurrency_slot", sa.Integer())
    return sa.case(
        (
            sa.and_(
                sa.literal_column("status").in_([sa.literal_column("'running'")]),
                key.is_not(None),
                slot.is_not(None),
            ),
            key + sa.literal_column("'#'", sa.String()) + sa.cast(slot, sa.String(11)),
        )
    )


def _where(predicate: str) -> dict[str, sa.TextClause]:
    return {f"{dialect}_where": sa.text(predicate) for dialect in PARTIAL_INDEX_DIALECTS}


def _is_sqlite() -> bool:
    return op.get_context().dialect.name == "sqlite"


def upgrade() -> None:
    """Add the columns and indexes to sa_taskqueue_task; create sa_taskqueue_task_control."""
    # SQLite could ALTER the columns in, but it appends each one's DDL to
    # the table's stored CREATE statement in a form SQLAlchemy's reflection
    # misreads; rebuilding the table (rows copied, ids kept) stores it whole.
    with op.batch_alter_table(TABLE, recreate="always" if _is_sqlite() else "never") as batch:
        batch.add_column(sa.Column("unique_key", sa.String(255), nullable=True))
        batch.add_column(sa.Column("concurrency_key", sa.String(255), nullable=True))
        batch.add_column(sa.Column("concurrency_slot", sa.Integer(), nullable=True))
        batch.add_column(
            sa.Column(
                "active_unique_key", sa.String(521), IndexableComputed(_active_unique_key()), nullable=True
            )
        )
        batch.add_column(
            sa.Column(
                "running_slot_key", sa.String(267), IndexableComputed(_running_slot_key()), nullable=True
            )
        )
    op.create_index(
        f"ix_{TABLE}_finished",
        TABLE,
        ["status", "finished_at"],
        **_where("status IN ('completed', 'failed', 'cancelled')"),
    )
    op.create_index(
        f"ux_{TABLE}_unique",
        TABLE,
        ["active_unique_key"],
        unique=True,
        **_where("active_unique_key IS NOT NULL"),
    )
    op.create_index(
        f"ux_{TABLE}_slot", TABLE, ["running_slot_key"], unique=True, **_where("running_slot_key IS NOT NULL")
    )
    op.create_table(
        CONTROL,
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("paused_at", UTCDateTime(), nullable=True),
        sa.Column("last_slot", UTCDateTime(), nullable=True),
        sa.Column("held_by", sa.String(255), nullable=True),
        sa.Column("held_until", UTCDateTime(), nullable=True),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    """Drop the control table, then the indexes and columns: the tasks and their statuses stay."""
    op.drop_table(CONTROL)
    op.drop_index(f"ux_{TABLE}_slot", table_name=TABLE)
    op.drop_index(f"ux_{TABLE}_unique", table_name=TABLE)
    op.drop_index(f"ix_{TABLE}_finished", table_name=TABLE)
    with op.batch_alter_table(TABLE, recreate="always" if _is_sqlite() else "never") as batch:
        # Generated columns first: they read the others.
        for column in (
            "running_slot_key",
            "active_unique_key",
            "concurrency_slot",
            "concurrency_key",
            "unique_key",
        ):
            batch.drop_column(column)
