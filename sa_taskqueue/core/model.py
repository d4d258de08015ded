"""The task table: `TaskMixin` for an application's own `Base`, and `Task` on ours."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Computed,
    Enum,
    Float,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    case,
    cast,
    func,
    literal_column,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column
from sqlalchemy.sql.compiler import DDLCompiler, SQLCompiler
from sqlalchemy.sql.visitors import InternalTraversal

from sa_taskqueue.backends import backend_for, dialects_with, partial_index_dialects
from sa_taskqueue.core.batch_table import batch_table
from sa_taskqueue.core.control import control_table
from sa_taskqueue.core.dependency_table import dependency_table
from sa_taskqueue.core.rate_limit_table import rate_limit_table
from sa_taskqueue.core.types import JSONDocument, LongText, UTCDateTime, utcnow
from sa_taskqueue.core.worker_table import worker_table


class TaskStatus(enum.StrEnum):
    """Where a task is in its life.  Stored as a plain string, never a native enum."""

    #: Enqueued with ``depends_on``: some parent has not finished yet.  Out of
    #: the claim index; the last parent to finish moves it to QUEUED.
    WAITING = "waiting"
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
CANCELLED_BY_LENGTH = 255
STATUS_LENGTH = 16
UNIQUE_KEY_LENGTH = 255
CONCURRENCY_KEY_LENGTH = 255
ON_PARENT_FAILURE_LENGTH = 16
# "<length of name>:<name><unique key>" and "<concurrency key>#<slot>": the
# generated columns the unique indexes hold (MySQL's 3072-byte key limit
# allows 768 four-byte characters).
ACTIVE_UNIQUE_KEY_LENGTH = 10 + 1 + NAME_LENGTH + UNIQUE_KEY_LENGTH
RUNNING_SLOT_KEY_LENGTH = CONCURRENCY_KEY_LENGTH + 1 + 11

#: The statuses a unique key is held in: a second enqueue with the same name
#: and key is refused while the first task is waiting or running.
ACTIVE_STATUSES = (TaskStatus.QUEUED, TaskStatus.RUNNING)
#: The statuses a task ends in; retention deletes rows in these.
FINISHED_STATUSES = (TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED)

# What the integer columns hold on every database: ``priority``, ``attempts``
# and ``max_attempts`` are 32-bit signed INTEGERs, ids 64-bit (BIGINT, or
# SQLite's INTEGER, which is 64-bit too).
INTEGER_MIN = -(2**31)
INTEGER_MAX = 2**31 - 1
ID_MAX = 2**63 - 1


class IndexableComputed(Computed):
    """A generated column that every database can index.

    Virtual where the database indexes virtual columns (SQLite, MySQL,
    MariaDB; on Oracle an index on one is its function-based index), which
    also lets ``ALTER TABLE ... ADD COLUMN`` add it in place; stored on
    PostgreSQL, which indexes only stored generated columns (18 makes virtual
    the default).
    """

    inherit_cache = True

    def _copy(self, *, target_table: Table | None = None, **kw: Any) -> IndexableComputed:
        # Declarative copies a mixin's columns onto each table; keep the class.
        copied = super()._copy(target_table=target_table, **kw)
        return self._schema_item_copy(IndexableComputed(copied.sqltext))


@compiles(IndexableComputed)
def _stored_where_indexes_need_it(element: IndexableComputed, compiler: DDLCompiler, **kw: Any) -> str:
    if not backend_for(compiler.dialect).indexes_only_stored_generated_columns:
        return str(compiler.visit_computed_column(element, **kw))  # type: ignore[no-untyped-call]
    # PostgreSQL indexes only stored generated columns.
    expression = compiler.sql_compiler.process(element.sqltext, include_table=False, literal_binds=True)
    return f"GENERATED ALWAYS AS ({expression}) STORED"


def _column(name: str) -> ColumnElement[Any]:
    # Generated columns are DDL, written once per mixin and table: by name.
    return literal_column(name, String())


def _in_statuses(*statuses: TaskStatus) -> ColumnElement[bool]:
    return literal_column("status").in_([literal_column(f"'{status.value}'") for status in statuses])


def _active_unique_key() -> ColumnElement[Any]:
    """``<length of name>:<name><unique key>`` while queued or running and keyed, else NULL.

    The length prefix keeps every (name, key) pair distinct in one string.
    (MySQL's LENGTH counts bytes, which distinguishes them as well.)
    """
    name, key = _column("name"), _column("unique_key")
    return case(
        (
            and_(_in_statuses(*ACTIVE_STATUSES), key.is_not(None)),
            cast(func.length(name), String(10)) + literal_column("':'", String()) + name + key,
        )
    )


def _running_slot_key() -> ColumnElement[Any]:
    """``<concurrency key>#<slot>`` while running with a slot, else NULL.

    The slot is digits after the last ``#``, so the pair stays distinct.
    Both columns are tested for NULL because Oracle's ``||`` reads NULL as ''.
    """
    key, slot = _column("concurrency_key"), literal_column("concurrency_slot", Integer())
    return case(
        (
            and_(_in_statuses(TaskStatus.RUNNING), key.is_not(None), slot.is_not(None)),
            key + literal_column("'#'", String()) + cast(slot, String(11)),
        )
    )


class TaskMixin:
    """The columns, indexes and defaults of a task table.

    Map it on any declarative base: ``class Task(TaskMixin, Base): __tablename__ = "tasks"``.
    The indexes are named after the table, so two task tables can live in one schema.
    """

    id: Mapped[int] = mapped_column(
        # SQLite only auto-increments an INTEGER PRIMARY KEY (a rowid alias), not BIGINT.
        BigInteger().with_variant(Integer(), *dialects_with("autoincrement_needs_integer_key")),
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
    #: While this task is queued or running, no other task of the same name
    #: may hold the same key (see ``active_unique_key``).
    unique_key: Mapped[str | None] = mapped_column(String(UNIQUE_KEY_LENGTH))
    #: Tasks sharing a concurrency key run at most their task's limit at once;
    #: each running one holds a slot, ``0 <= concurrency_slot < limit``.
    concurrency_key: Mapped[str | None] = mapped_column(String(CONCURRENCY_KEY_LENGTH))
    concurrency_slot: Mapped[int | None] = mapped_column(Integer)
    #: Name and unique key while the task is queued or running, else NULL:
    #: computed by the database, and unique (``ux_<table>_unique``).  One
    #: column rather than two because Oracle enforces a composite unique
    #: index on rows where only some of its columns are NULL.
    active_unique_key: Mapped[str | None] = mapped_column(
        String(ACTIVE_UNIQUE_KEY_LENGTH), IndexableComputed(_active_unique_key())
    )
    #: Concurrency key and slot while the task is running, else NULL; unique
    #: (``ux_<table>_slot``), so two running tasks never hold one slot.
    running_slot_key: Mapped[str | None] = mapped_column(
        String(RUNNING_SLOT_KEY_LENGTH), IndexableComputed(_running_slot_key())
    )
    #: What the enqueuing code carried with the task beside its params: the
    #: W3C trace context of the request that enqueued it (``traceparent``,
    #: ``tracestate``), so the task's run continues that trace.  NULL when
    #: there was nothing to carry.  (This column and those below come last:
    #: the migrations that added them append them.)
    headers: Mapped[dict[str, str] | None] = mapped_column(JSONDocument)
    #: When someone asked to cancel the task while it ran; the worker holding
    #: it stops it and writes CANCELLED.  NULL while nobody has asked.
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    #: Who cancelled the task (a queued one at once, a running one by request).
    cancelled_by: Mapped[str | None] = mapped_column(
        String(CANCELLED_BY_LENGTH).with_variant(String(), *dialects_with("appended_columns_without_length"))
    )
    #: The last progress the running task reported, from 0 to 1, its note (a
    #: small JSON value) and when it was written.
    progress: Mapped[float | None] = mapped_column(Float)
    progress_note: Mapped[Any | None] = mapped_column(JSONDocument)
    progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    #: The batch the task belongs to, fixed when it is enqueued; NULL for a
    #: task outside any batch.
    batch_id: Mapped[int | None] = mapped_column(BigInteger)
    #: While the task is WAITING, how many of its parents have not finished.
    parents_pending: Mapped[int | None] = mapped_column(Integer)
    #: What a parent that ends failed or cancelled does to this task:
    #: ``"cancel"`` (NULL means the same, the default) or ``"run"``.
    on_parent_failure: Mapped[str | None] = mapped_column(
        String(ON_PARENT_FAILURE_LENGTH).with_variant(
            String(), *dialects_with("appended_columns_without_length")
        )
    )
    #: Set when the first dependent of this task is enqueued: its final
    #: write then goes through the workflow bookkeeping, which releases them.
    has_dependents: Mapped[bool | None] = mapped_column(Boolean)

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Index, ...]:
        table = cls.__tablename__  # type: ignore[attr-defined]
        # The control table (paused queues, schedules) lives on the same
        # metadata, so create_all and autogenerate make both.
        control_table(cls.metadata, table)  # type: ignore[attr-defined]
        # And the live workers, for the same reason.
        worker_table(cls.metadata, table)  # type: ignore[attr-defined]
        # And the rate limits' recent starts.
        rate_limit_table(cls.metadata, table)  # type: ignore[attr-defined]
        # And the workflows' dependency edges and batches.
        dependency_table(cls.metadata, table)  # type: ignore[attr-defined]
        batch_table(cls.metadata, table)  # type: ignore[attr-defined]
        return (
            # The claim walks this index in claim order.  On PostgreSQL and
            # SQLite it holds queued rows only, so millions of finished rows
            # cost the claim nothing; MySQL, MariaDB and Oracle have no
            # partial indexes, and there the leading status column narrows
            # the walk to the queued range instead.
            Index(f"ix_{table}_claim", "status", "priority", "run_at", "id", **_only(TaskStatus.QUEUED)),
            # Lease recovery looks for running rows whose lease has ended.
            Index(f"ix_{table}_lease", "status", "locked_until", **_only(TaskStatus.RUNNING)),
            # Retention deletes finished rows by status and age.
            Index(f"ix_{table}_finished", "status", "finished_at", **_only(*FINISHED_STATUSES)),
            # The database, not a check before the insert, keeps unique keys
            # and concurrency slots single: NULLs (inactive rows) never clash,
            # and the partial indexes leave them out altogether.
            Index(f"ux_{table}_unique", "active_unique_key", unique=True, **_non_null("active_unique_key")),
            Index(f"ux_{table}_slot", "running_slot_key", unique=True, **_non_null("running_slot_key")),
            # A batch's members are listed per batch; most tasks have none.
            Index(f"ix_{table}_batch", "batch_id", **_non_null("batch_id")),
        )

    @property
    def depends_on(self) -> list[TaskMixin | int] | None:
        """The parents this new task waits for (``Task(..., depends_on=[parent, parent_id])``), until flushed.

        Not a column: a new row given parents is written WAITING by its
        flush, with one edge per parent in the dependency table
        (`sa_taskqueue.features.workflows.dependencies`).  None once flushed,
        and for a row loaded from the database.
        """
        return self.__dict__.get(PARENTS_KEY)

    @depends_on.setter
    def depends_on(self, parents: Iterable[TaskMixin | int] | None) -> None:
        self.__dict__[PARENTS_KEY] = None if parents is None else check_parents(parents)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id} name={self.name!r} status={self.status}>"


#: Where a task row object keeps the parents it was given (`TaskMixin.depends_on`) until its flush.
PARENTS_KEY = "_sa_taskqueue_depends_on"


def check_parents(depends_on: Any) -> list[TaskMixin | int]:
    """``depends_on`` as a list of parents (task row objects or task ids); a clear error if it is not."""
    if isinstance(depends_on, TaskMixin | int) and not isinstance(depends_on, bool):
        raise TypeError(
            f"depends_on must be a list of tasks or task ids, got a single {type(depends_on).__name__}: "
            "write depends_on=[parent]"
        )
    if isinstance(depends_on, str | bytes) or not isinstance(depends_on, Iterable):
        raise TypeError(f"depends_on must be a list of tasks or task ids, got {depends_on!r}")
    parents: list[TaskMixin | int] = []
    for parent in depends_on:
        if isinstance(parent, TaskMixin):
            parents.append(parent)
        elif isinstance(parent, bool) or not isinstance(parent, int) or not 1 <= parent <= ID_MAX:
            raise TypeError(
                f"depends_on must hold tasks (the rows enqueue returns) or task ids (positive integers), "
                f"got {parent!r}"
            )
        else:
            parents.append(parent)
    return parents


def _only(*statuses: TaskStatus) -> dict[str, Any]:
    """Index options keeping an index to rows of these statuses, where partial indexes exist."""
    # A literal (not a bound parameter): a partial index predicate is DDL.
    predicate = (
        literal_column("status") == literal_column(f"'{statuses[0].value}'")
        if len(statuses) == 1
        else _in_statuses(*statuses)
    )
    return {f"{dialect}_where": predicate for dialect in partial_index_dialects()}


def _non_null(column: str) -> dict[str, Any]:
    """The index options that leave NULLs out of an index, on the databases with partial indexes."""
    return {f"{dialect}_where": literal_column(column).is_not(None) for dialect in partial_index_dialects()}


def has_status(table: Table, status: TaskStatus, *, indexed: bool = True) -> ColumnElement[bool]:
    """``status = '<status>'`` with the value written into the SQL rather than bound.

    Only then can the partial index on that status serve the query in a
    prepared statement's generic plan (PostgreSQL, which psycopg prepares
    after five runs) and at all on SQLite: neither can tell that a bound
    ``status = $1`` implies the index's ``status = 'queued'``.

    Not ``indexed``: a test no index may serve, for a statement that finds
    its rows by their ids (`Unindexed`).
    """
    column = table.c.status if indexed else Unindexed(table.c.status)
    return column == literal_column(f"'{status.value}'", type_=table.c.status.type)


class Unindexed(ColumnElement[Any]):
    """A text column, written so that no index serves a test of it (`Backend.unindexed`)."""

    inherit_cache = True
    _traverse_internals = [("column", InternalTraversal.dp_clauseelement)]  # noqa: RUF012 (SQLAlchemy's own form)

    def __init__(self, column: ColumnElement[Any]) -> None:
        self.column = column
        self.type = column.type


@compiles(Unindexed)
def _unindexed(element: Unindexed, compiler: SQLCompiler, **kw: Any) -> str:
    return backend_for(compiler.dialect).unindexed(compiler.process(element.column, **kw))


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
    "check_parents",
    "has_status",
    "metadata",
]
