"""Widen sa_taskqueue_task.last_error to MEDIUMTEXT on MySQL and MariaDB where it is TEXT.

Revision ID: b2b218417438
Revises: b78c74731220
Create Date: 2025-11-23 14:00:00.000000

The first revision gave last_error MEDIUMTEXT only when SQLAlchemy named the
dialect "mysql".  Under a ``mariadb://`` URL SQLAlchemy names it "mariadb",
so a database first migrated that way got a TEXT column, which holds 64 KiB:
a longer traceback was cut short or refused, and the table differed from the
model.  The first revision now creates MEDIUMTEXT under either name; this one
brings the tables it already created to the same type.

Only MySQL and MariaDB are touched, and only when last_error is narrower than
MEDIUMTEXT: a column that is already MEDIUMTEXT (a new install, or one made
under ``mysql://``) or LONGTEXT is left alone, so the table is not rebuilt for
nothing and never narrowed.  Offline (``--sql``) the column cannot be looked
at, so the script always contains the ALTER.

The downgrade does nothing: narrowing the column back to TEXT could truncate
the errors already stored, and MEDIUMTEXT is correct for the first revision
too.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

# revision identifiers, used by Alembic.
revision: str = "b2b218417438"
down_revision: str | Sequence[str] | None = "b78c74731220"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_taskqueue_task"
COLUMN = "last_error"

#: SQLAlchemy's names for the MySQL dialect, by URL: mysql:// and mariadb://.
MYSQL_FAMILY = ("mysql", "mariadb")

#: Column types that already hold a traceback of any length we store.
WIDE_ENOUGH = (mysql.MEDIUMTEXT, mysql.LONGTEXT)


def upgrade() -> None:
    """On MySQL and MariaDB, ALTER last_error to MEDIUMTEXT NULL unless it is at least that wide."""
    context = op.get_context()
    if context.dialect.name not in MYSQL_FAMILY:
        return
    if not context.as_sql:
        columns = sa.inspect(op.get_bind()).get_columns(TABLE)
        current = next(column["type"] for column in columns if column["name"] == COLUMN)
        if isinstance(current, WIDE_ENOUGH):
            return
    op.alter_column(
        TABLE,
        COLUMN,
        existing_type=sa.Text(),
        type_=mysql.MEDIUMTEXT(),
        existing_nullable=True,
    )


def downgrade() -> None:
    """Nothing: narrowing last_error back to TEXT could truncate the errors already stored."""
