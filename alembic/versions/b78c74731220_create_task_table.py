"""Create the task table, sa_taskqueue_task, and its claim and lease indexes.

Revision ID: b78c74731220
Revises:
Create Date: 2025-11-21 09:00:00.000000

Written by hand to match ``sa_taskqueue.metadata`` on every dialect
(PostgreSQL, MySQL/MariaDB, SQLite, Oracle).  The column types come from
``sa_taskqueue.types``, so each dialect gets the same physical type the model
creates (JSONB / JSON / CLOB, TIMESTAMPTZ / DATETIME(6) / TIMESTAMP WITH TIME
ZONE, MEDIUMTEXT / TEXT), under every URL form: MySQL and MariaDB get
MEDIUMTEXT whether SQLAlchemy names the dialect "mysql" or "mariadb".
Everything else is spelled out here rather than imported from the model: a
revision records the schema as it was when it was written, and must not
change when the model does.

No column has a server default: the defaults live in the model (Python side),
exactly as ``metadata.create_all`` would create the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sa_taskqueue.types import JSONDocument, LongText, UTCDateTime

# revision identifiers, used by Alembic.
revision: str = "b78c74731220"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_taskqueue_task"

# The statuses as of this revision.  Stored as a plain VARCHAR(16): no native
# ENUM type and no CHECK constraint, so a later status needs no migration.
STATUSES = ("queued", "running", "completed", "failed", "cancelled")


def upgrade() -> None:
    """Create sa_taskqueue_task and its two indexes."""
    op.create_table(
        TABLE,
        sa.Column(
            "id",
            # SQLite only auto-increments an INTEGER PRIMARY KEY (a rowid alias).
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(),
            primary_key=True,
        ),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("queue", sa.String(100), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("params", JSONDocument(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                *STATUSES,
                name="taskstatus",
                native_enum=False,
                create_constraint=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("run_at", UTCDateTime(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("locked_by", sa.String(255), nullable=True),
        sa.Column("locked_until", UTCDateTime(), nullable=True),
        # A traceback can outgrow MySQL's 64 KiB TEXT: MEDIUMTEXT there,
        # whether SQLAlchemy calls the dialect "mysql" or "mariadb".
        sa.Column("last_error", LongText(), nullable=True),
        sa.Column("result", JSONDocument(), nullable=True),
    )
    # The claim walks this index in claim order.  PostgreSQL and SQLite keep
    # only queued rows in it; MySQL, MariaDB and Oracle have no partial
    # indexes and ignore the WHERE, indexing every row.
    op.create_index(
        f"ix_{TABLE}_claim",
        TABLE,
        ["status", "priority", "run_at", "id"],
        postgresql_where=sa.text("status = 'queued'"),
        sqlite_where=sa.text("status = 'queued'"),
    )
    # Lease recovery looks for running rows whose lease has ended.
    op.create_index(
        f"ix_{TABLE}_lease",
        TABLE,
        ["status", "locked_until"],
        postgresql_where=sa.text("status = 'running'"),
        sqlite_where=sa.text("status = 'running'"),
    )


def downgrade() -> None:
    """Drop the indexes, then sa_taskqueue_task itself (and every task in it)."""
    op.drop_index(f"ix_{TABLE}_lease", table_name=TABLE)
    op.drop_index(f"ix_{TABLE}_claim", table_name=TABLE)
    op.drop_table(TABLE)
