"""The library's exceptions: one base class, a few subclasses that say what went wrong.

Errors from SQLAlchemy and the database driver are translated here, at the
queue's boundary, into these; the original stays attached as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import Engine, Table, inspect
from sqlalchemy import exc as sa_exc

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.model import metadata as library_metadata


class TaskQueueError(Exception):
    """Base class of every error sa_taskqueue raises on its own account."""


class StrategyError(TaskQueueError):
    """A claim strategy was asked for that this database cannot run."""


class FootingError(TaskQueueError):
    """The self-test found that this database connection cannot give the queue what it relies on.

    A SKIP LOCKED the server ignores, advisory locks or LISTEN behind a pooler
    in transaction mode: each would let tasks run twice or never wake a
    worker, silently.  The message names each failed check, its cause and
    the fix; ``report`` is the whole `FootingReport`.
    """

    def __init__(self, message: str, report: FootingReport | None = None) -> None:
        super().__init__(message)
        self.report = report


class TaskNotRegistered(TaskQueueError, LookupError):
    """A worker claimed a task whose name no function is registered under in this process."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no task registered under {name!r}")
        self.name = name


class MalformedTask(TaskQueueError):
    """A claimed row cannot be run as it stands (its params are not a JSON object); it fails for good.

    Such a row was written around the queue (raw SQL); running it again could
    never succeed, so it is not retried.
    """


class ParamTypeError(MalformedTask, TypeError):
    """A task's stored param cannot become the type its function's annotation asks for; it fails for good.

    Raised by the worker before the function is called (``when: datetime``
    holding ``"yesterday"``, say).  The same stored value would fail the same
    way on every attempt, so the task is not retried.  ``task_name`` and
    ``param`` (with the place inside it: ``"dates[2]"``) name what failed.
    """

    def __init__(self, task_name: str, param: str, problem: str) -> None:
        super().__init__(f"task {task_name!r}: param {param!r} {problem}")
        self.task_name = task_name
        self.param = param
        self.problem = problem


class DatabaseError(TaskQueueError):
    """The database refused a statement (bad data, a constraint, a permission).

    The driver error is the cause.
    """


class SchemaMissing(DatabaseError):
    """The task table is not there: the migrations have not been run on this database."""


class DatabaseUnavailable(DatabaseError):
    """The database could not be reached, dropped the connection, or is too busy now; worth retrying.

    The driver error is the cause.
    """


class DatabaseBusy(DatabaseUnavailable):
    """Another connection held a lock longer than this one would wait (SQLite's busy timeout); worth retrying.

    The driver error is the cause.
    """


class TaskResultError(TaskQueueError):
    """A task waited for with `TaskQueue.result` ended without a result: it failed for good, or was cancelled.

    ``task_id``, ``status`` and ``attempts`` are the row's as it was read.
    """

    def __init__(self, message: str, *, task_id: int, status: str, attempts: int) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.status = status
        self.attempts = attempts


class TaskFailed(TaskResultError):
    """The task failed for good (FAILED): ``last_error`` is the error its last attempt recorded."""

    def __init__(self, task_id: int, *, attempts: int, last_error: str | None) -> None:
        text = (last_error or "").strip()
        # The last line of a traceback is the exception itself.
        detail = text.splitlines()[-1] if text else "no error recorded"
        super().__init__(
            f"task {task_id} failed after {attempts} attempt(s): {detail}",
            task_id=task_id,
            status="failed",
            attempts=attempts,
        )
        self.last_error = last_error


class TaskCancelled(TaskResultError):
    """The task was cancelled (CANCELLED) before it ran: it has no result and never will."""

    def __init__(self, task_id: int, *, attempts: int) -> None:
        super().__init__(
            f"task {task_id} was cancelled: it has no result",
            task_id=task_id,
            status="cancelled",
            attempts=attempts,
        )


class TaskNotFound(TaskQueueError, LookupError):
    """No task has this id: it never existed, or was deleted (retention, purge) before its result was read."""

    def __init__(self, task_id: int) -> None:
        super().__init__(
            f"no task with id {task_id}: it never existed, or it was deleted (retention or purge) "
            "before its result was read"
        )
        self.task_id = task_id


class BatchNotFound(TaskQueueError, LookupError):
    """No batch has this id."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(f"no batch with id {batch_id}")
        self.batch_id = batch_id


class BatchClosed(TaskQueueError, ValueError):
    """The batch is closed: it takes no more members (nothing was written)."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(
            f"batch {batch_id} is closed: it takes no more members (nothing was written); "
            "open a new batch for more tasks"
        )
        self.batch_id = batch_id


class ParentNotFound(TaskNotFound):
    """A task was enqueued with ``depends_on`` naming a task that does not exist: nothing was enqueued."""

    def __init__(self, task_id: int) -> None:
        TaskQueueError.__init__(
            self,
            f"depends_on names task {task_id}, which does not exist (never created, or deleted by "
            "retention or purge): nothing was enqueued",
        )
        self.task_id = task_id


class ResultTimeout(TaskQueueError, TimeoutError):
    """`TaskQueue.result` waited ``waited`` seconds and the task had not finished."""

    def __init__(self, task_id: int, waited: float, status: str) -> None:
        super().__init__(f"task {task_id} did not finish within {waited:g} s (it is {status})")
        self.task_id = task_id
        self.waited = waited
        self.status = status


@contextmanager
def translate_database_errors(engine: Engine, table: Table) -> Iterator[None]:
    """Raise ours for SQLAlchemy's and the driver's errors; the original is the cause.

    A driver error can arrive unwrapped when it is raised outside a statement
    (SQLAlchemy setting up a connection it took from the pool), so the
    driver's own exception classes are caught too.
    """
    dbapi = getattr(engine.dialect, "dbapi", None)
    driver_error: type[BaseException] = getattr(dbapi, "Error", sa_exc.DBAPIError)
    try:
        yield
    except TaskQueueError:
        raise
    except sa_exc.DBAPIError as error:
        raise _translated(error, error.orig, engine, table) from error
    except sa_exc.TimeoutError as error:
        raise DatabaseUnavailable(f"no database connection could be had from the pool: {error}") from error
    except driver_error as error:
        raise _translated(error, error, engine, table) from error


def _translated(
    error: BaseException, orig: BaseException | None, engine: Engine, table: Table
) -> TaskQueueError:
    detail = _first_line(orig if orig is not None else error)
    invalidated = isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated
    if invalidated or _is(error, orig, "InterfaceError"):
        return DatabaseUnavailable(f"lost the database connection: {detail}")
    backend = backend_for(engine.dialect)
    driver_error = orig if orig is not None else error
    busy = backend.busy(driver_error)
    if busy is not None:
        return DatabaseBusy(busy)
    if is_missing_table(error, engine, table):
        return schema_missing(table)
    # Only a failure of the database or the connection is an outage, worth
    # retrying; a statement refused for what it asks (OperationalError is
    # also where drivers file "too many columns" or an unknown column) would
    # be refused again, forever.
    # A connection that could not be made (no statement yet: a server not
    # up, a refused login) is judged by the DB-API class alone, as drivers
    # file those failures under OperationalError.
    connecting = not isinstance(error, sa_exc.DBAPIError) or error.statement is None
    outage = None if connecting else backend.outage(driver_error)
    if outage is None:
        outage = _is(error, orig, "OperationalError")
    if outage:
        return DatabaseUnavailable(f"the database is unavailable: {detail}")
    return DatabaseError(f"the database refused a statement: {detail}")


def schema_missing(table: Table) -> SchemaMissing:
    """The error for a task table that is not there, saying how to create it.

    The library's own table is made by its migrations (``sa-taskqueue
    migrate``); a `TaskMixin` table on the application's own Base, by the
    application's own Alembic history, which ``migrate`` does not run.
    """
    if table.metadata is library_metadata:
        how = "run `sa-taskqueue migrate` (or `alembic upgrade head`)"
    else:
        how = (
            "create it with the application's own migrations (`alembic upgrade head`); "
            "`sa-taskqueue migrate` makes only the library's table"
        )
    return SchemaMissing(f"the task table {table.name!r} does not exist: {how}")


def is_missing_table(error: BaseException, engine: Engine, table: Table) -> bool:
    """Whether ``error`` (SQLAlchemy's, or the driver's own) came of ``table`` not being there.

    Drivers file "no such table" under OperationalError or ProgrammingError,
    beside many other failures, so the database is asked whether it has it.
    """
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else None
    if not _is(error, orig, "OperationalError", "ProgrammingError"):
        return False
    invalidated = isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated
    backend = backend_for(engine.dialect)
    driver_error = orig if orig is not None else error
    if invalidated or backend.busy(driver_error) is not None or backend.outage(driver_error):
        # A lost connection or a lock wait is no missing table, and asking would wait again.
        return False
    return not _has_table(engine, table)


@contextmanager
def missing_table_errors(engine: Engine, table: Table) -> Iterator[None]:
    """`SchemaMissing` for an error the task table's absence caused, the driver's error as its cause.

    Any other error passes as it was raised: around an enqueue into the
    caller's session, it may be about rows of the caller's own that the
    same flush wrote, and those errors are the caller's to handle.
    """
    dbapi = getattr(engine.dialect, "dbapi", None)
    driver_error: type[BaseException] = getattr(dbapi, "Error", sa_exc.DBAPIError)
    try:
        yield
    except TaskQueueError:
        raise
    except (sa_exc.DBAPIError, driver_error) as error:
        if not is_missing_table(error, engine, table):
            raise
        cause = error.orig if isinstance(error, sa_exc.DBAPIError) else error
        raise schema_missing(table) from cause


def _is(error: BaseException, orig: BaseException | None, *kinds: str) -> bool:
    """``error`` (SQLAlchemy's wrapper) or ``orig`` (the driver's) is of a DB-API error kind named."""
    names = {cls.__name__ for value in (error, orig) if value is not None for cls in type(value).__mro__}
    return any(kind in names for kind in kinds)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _has_table(engine: Engine, table: Table) -> bool:
    # Asked while another error is being translated: whatever goes wrong here
    # (no connection free in the pool, the server gone) must not replace it.
    try:
        return inspect(engine).has_table(table.name, schema=table.schema)
    except Exception:  # noqa: BLE001 - cannot tell; let the original error speak
        return True


@dataclass(frozen=True)
class Check:
    """One check of the self-test: what it is about, whether it passed, and what it found."""

    #: ``skip_locked``, ``advisory_lock``, ``conditional_update`` or ``listen``.
    name: str
    passed: bool
    #: What was shown when it passed; the cause and the fix when it failed.
    detail: str
    #: How long the check took, in seconds.
    seconds: float

    def line(self) -> str:
        """``passed  skip_locked: ...`` or ``FAILED  listen: ...``, for people."""
        outcome = "passed" if self.passed else "FAILED"
        return f"{outcome}  {self.name}: {self.detail} ({self.seconds * 1000:.0f} ms)"


@dataclass(frozen=True)
class FootingReport:
    """The checks one self-test ran, for a worker's start, ``sa-taskqueue doctor`` or monitoring."""

    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]

    @property
    def seconds(self) -> float:
        return sum(check.seconds for check in self.checks)

    def lines(self) -> list[str]:
        return [check.line() for check in self.checks]

    def raise_if_failed(self) -> None:
        """Raise `FootingError` naming every failed check, its cause and its fix."""
        if not self.ok:
            causes = "; ".join(f"{check.name}: {check.detail}" for check in self.failures)
            raise FootingError(f"the self-test failed, so this worker will not start: {causes}", self)


class PoolTooSmall(TaskQueueError, ValueError):
    """The engine's pool cannot lend a worker the connections it holds at once; it refuses to start.

    Started anyway, its lease renewals would wait behind its tasks for a
    connection, and its watchdog would kill it once a lease ran out.
    """


__all__ = [
    "BatchClosed",
    "BatchNotFound",
    "Check",
    "DatabaseBusy",
    "DatabaseError",
    "DatabaseUnavailable",
    "FootingError",
    "FootingReport",
    "MalformedTask",
    "ParentNotFound",
    "PoolTooSmall",
    "ResultTimeout",
    "SchemaMissing",
    "StrategyError",
    "TaskCancelled",
    "TaskFailed",
    "TaskNotFound",
    "TaskNotRegistered",
    "TaskQueueError",
    "TaskResultError",
    "is_missing_table",
    "missing_table_errors",
    "schema_missing",
    "translate_database_errors",
]
