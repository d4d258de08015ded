"""Rate limits.

Revision ID: f3a8d2c5b7e1
Revises: e4b9c1d6a8f3
Create Date: 2026-11-29 01:10:00.000000

Creates ``sa_taskqueue_task_rate_limits``: one row per (task, window, rate
key) that has started a run, holding its recent starts per bucket of the
window and a version the claim compares and sets.  The task table and its
rows are left as they are.

As in the earlier revisions, every type is written out here.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sa_taskqueue.types import UTCDateTime

# revision identifiers, used by Alembic.
revision: str = "f3a8d2c5b7e1"
down_revision: str | Sequence[str] | None = "e4b9c1d6a8f3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RATE_LIMITS = "sa_taskqueue_task_rate_limits"


def upgrade() -> None:
    """Create sa_taskqueue_task_rate_limits."""
    op.create_table(
        RATE_LIMITS,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("rate_window", sa.String(32), nullable=False),
        sa.Column("rate_key", sa.String(255), nullable=False),
        sa.Column("state", sa.String(255), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    """Drop the rate-limit table: the tasks stay."""
    op.drop_table(RATE_LIMITS)
