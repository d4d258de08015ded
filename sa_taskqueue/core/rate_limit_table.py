"""The rate-limit table beside each task table: the recent starts of each (task, window, rate key).

One row per task, window and key that has started a run, holding the starts
per bucket of its window (`sa_taskqueue.core.rate_limit`) and a version the
claim compares and sets: a claim reads the rows of its candidates, decides
in Python which start, and writes each row back only if its version is still
the one it read, in the claim's own transaction.  Two claimers that read one
row at once cannot both write it: the second finds the version moved, and
its whole claim rolls back and tries again.

The key is a SHA-256 of task, window and rate key, so the primary key has a
fixed size on every database; the three are kept beside it for people.
A row whose key has started no run for 1.1 times its window holds only
buckets that no window counts any more: it may then be deleted.

`TaskMixin` declares the table on the same `MetaData` as the task table,
named ``<task table>_rate_limits``, so ``create_all`` and Alembic's
autogenerate see it.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, MetaData, String, Table

from sa_taskqueue.core.types import UTCDateTime

ID_LENGTH = 64
NAME_LENGTH = 255
WINDOW_LENGTH = 32
KEY_LENGTH = 255
STATE_LENGTH = 255


def rate_limit_table_name(task_table_name: str) -> str:
    """The rate-limit table's name for a task table's: ``<task table>_rate_limits``."""
    return f"{task_table_name}_rate_limits"


def rate_limit_table(metadata: MetaData, task_table_name: str) -> Table:
    """The rate-limit table of the task table ``task_table_name``, declared on ``metadata`` once."""
    name = rate_limit_table_name(task_table_name)
    key = name if metadata.schema is None else f"{metadata.schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        name,
        metadata,
        Column("id", String(ID_LENGTH), primary_key=True),
        Column("name", String(NAME_LENGTH), nullable=False),
        # "<count>/<seconds>s", e.g. "100/1s".
        Column("rate_window", String(WINDOW_LENGTH), nullable=False),
        Column("rate_key", String(KEY_LENGTH), nullable=False),
        # "<first bucket>:<count>,<count>,...": the starts per bucket of the window.
        Column("state", String(STATE_LENGTH), nullable=False),
        # Moved on by every write: the compare-and-set that keeps two claimers from both writing.
        Column("version", BigInteger, nullable=False),
        Column("updated_at", UTCDateTime(), nullable=False),
    )


def rate_limit_table_of(task_table: Table) -> Table:
    """The rate-limit table beside ``task_table`` (declared by `TaskMixin`), declaring it if missing."""
    return rate_limit_table(task_table.metadata, task_table.name)


__all__ = ["rate_limit_table", "rate_limit_table_name", "rate_limit_table_of"]
