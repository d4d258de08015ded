"""The task table: `TaskMixin` for an application's own `Base`, and `Task` on ours."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Enum,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    literal_column,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column

from sa_taskqueue.backends import partial_index_dialects
from sa_taskqueue.types import JSONDocument, LongText, UTCDateTime, utcnow


class TaskStatus(enum.StrEnum):
    """Where a task is in its life.  Stored as a plain string, never a native enum."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Long enough for "module.qualname" task names and "host:pid:token" worker ids,
# short enough to be indexable on every dialect (MySQL's key prefix limit).
NAME_LENGTH = 255
QUEUE_LENGTH = 100
WORKER_ID_LENGTH = 255
STATUS_LENGTH = 16

# What the integer columns hold on every database: ``priority``, ``attempts``
# and ``max_attempts`` are 32-bit signed INTEGERs, ids 64-bit (BIGINT, or
# SQLite's INTEGER, which is 64-bit too).
INTEGER_MIN = -(2**31)
INTEGER_MAX = 2**31 - 1
ID_MAX = 2**63 - 1


class TaskMixin:
    """The columns, indexes and defaults of a task table.

    Map it on any declarative base: ``class Task(TaskMixin, Base): __tablename__ = "tasks"``.
    The indexes are named after the table, so two task tables can live in one schema.
    """

    id: Mapped[int] = mapped_column(
        # SQLite only auto-increments an INTEGER PRIMARY KEY (a rowid alias), not BIGINT.
        BigInteger().with_variant(Integer(), "sqlite"),
        Identity(),
        primary_key=True,
    )
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    queue: Mapped[str] = mapped_column(String(QUEUE_LENGTH), default="default")
    priority: Mapped[int] = mapped_column(Integer, default=0)
    params: Mapped[dict[str, Any]] = mapped_column(JSONDocument, default=dict)
    status: Mapped[TaskStatus] = mapped_column(
        # A VARCHAR holding the enum's value: no native ENUM type, no CHECK
        # constraint, so adding a status later is not a schema migration.
        Enum(
            TaskStatus,
            native_enum=False,
            create_constraint=False,
            length=STATUS_LENGTH,
            values_callable=lambda statuses: [status.value for status in statuses],
        ),
        default=TaskStatus.QUEUED,
    )
    run_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    locked_by: Mapped[str | None] = mapped_column(String(WORKER_ID_LENGTH))
    locked_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A traceback can outgrow MySQL's 64 KiB TEXT.
    last_error: Mapped[str | None] = mapped_column(LongText)
    result: Mapped[Any | None] = mapped_column(JSONDocument)

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Index, ...]:
        table = cls.__tablename__  # type: ignore[attr-defined]
        return (
            # The claim walks this index in claim order.  On PostgreSQL and
            # SQLite it holds queued rows only, so millions of finished rows
            # cost the claim nothing; MySQL, MariaDB and Oracle have no
            # partial indexes, and there the leading status column narrows
            # the walk to the queued range instead.
            Index(f"ix_{table}_claim", "status", "priority", "run_at", "id", **_only(TaskStatus.QUEUED)),
            # Lease recovery looks for running rows whose lease has ended.
            Index(f"ix_{table}_lease", "status", "locked_until", **_only(TaskStatus.RUNNING)),
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id} name={self.name!r} status={self.status}>"


def _only(status: TaskStatus) -> dict[str, Any]:
    """The index options that keep an index to rows of one status, on the databases with partial indexes."""
    return {f"{dialect}_where": _status_is(status) for dialect in partial_index_dialects()}


def _status_is(status: TaskStatus) -> Any:
    # A literal (not a bound parameter): a partial index predicate is DDL.
    return literal_column("status") == literal_column(f"'{status.value}'")


def has_status(table: Table, status: TaskStatus) -> ColumnElement[bool]:
    """``status = '<status>'`` with the value written into the SQL rather than bound.

    Only then can the partial index on that status serve the query in a
    prepared statement's generic plan (PostgreSQL, which psycopg prepares
    after five runs) and at all on SQLite: neither can tell that a bound
    ``status = $1`` implies the index's ``status = 'queued'``.
    """
    return table.c.status == literal_column(f"'{status.value}'", type_=table.c.status.type)


class Base(DeclarativeBase):
    """The declarative base of the library's own table, and nothing else."""

    metadata = MetaData()


class Task(TaskMixin, Base):
    """A task in the library's own table, ``sa_taskqueue_task``."""

    __tablename__ = "sa_taskqueue_task"


metadata = Base.metadata

__all__ = [
    "ID_MAX",
    "INTEGER_MAX",
    "INTEGER_MIN",
    "Base",
    "Task",
    "TaskMixin",
    "TaskStatus",
    "has_status",
    "metadata",
]
