"""The library's exceptions: one base class, a few subclasses that say what went wrong."""

from __future__ import annotations


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


__all__ = ["DatabaseUnavailable", "SchemaMissing", "StrategyError", "TaskNotRegistered", "TaskQueueError"]
