"""The library's exceptions: one base class, a few subclasses that say what went wrong."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, Table, inspect
from sqlalchemy import exc as sa_exc


class TaskQueueError(Exception):
    """Base class of every error sa_taskqueue raises on its own account."""


class StrategyError(TaskQueueError):
    """A claim strategy was asked for that this database cannot run."""


class TaskNotRegistered(TaskQueueError, LookupError):
    """A worker claimed a task whose name no function is registered under in this process."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no task registered under {name!r}")
        self.name = name


class SchemaMissing(TaskQueueError):
    """The task table is not there: the migrations have not been run on this database."""


class DatabaseUnavailable(TaskQueueError):
    """The database could not be reached or refused the connection; the driver error is the cause."""


@contextmanager
def translate_database_errors(engine: Engine, table: Table) -> Iterator[None]:
    """Raise ours for driver errors that mean "no database" or "no table"; the original is the cause."""
    try:
        yield
    except sa_exc.DBAPIError as error:
        if error.connection_invalidated or isinstance(error, sa_exc.InterfaceError):
            raise DatabaseUnavailable(f"lost the database connection: {error.orig}") from error
        if isinstance(error, sa_exc.OperationalError | sa_exc.ProgrammingError) and not _has_table(
            engine, table
        ):
            raise SchemaMissing(
                f"the task table {table.name!r} does not exist: "
                "run `sa-taskqueue migrate` (or `alembic upgrade head`)"
            ) from error
        raise


def _has_table(engine: Engine, table: Table) -> bool:
    try:
        return inspect(engine).has_table(table.name, schema=table.schema)
    except sa_exc.DBAPIError:
        return True  # cannot tell; let the original error speak


__all__ = [
    "DatabaseUnavailable",
    "SchemaMissing",
    "StrategyError",
    "TaskNotRegistered",
    "TaskQueueError",
    "translate_database_errors",
]
