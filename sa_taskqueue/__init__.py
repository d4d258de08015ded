"""sa_taskqueue: a reliable task queue in the SQL database an application already has.

``import sa_taskqueue as tq``, map `tq.Task` (or `tq.TaskMixin` on your own
base), create a `tq.TaskQueue`, register functions with ``@queue.task`` and
run ``queue.run_worker()``.
"""

from __future__ import annotations

from sa_taskqueue import backends, health, session_events, strategies
from sa_taskqueue.claimed import ClaimedTask
from sa_taskqueue.event_loop_bridge import SyncCallOnEventLoop
from sa_taskqueue.exceptions import (
    DatabaseBusy,
    DatabaseError,
    DatabaseUnavailable,
    FootingError,
    MalformedTask,
    ResultTimeout,
    SchemaMissing,
    StrategyError,
    TaskCancelled,
    TaskFailed,
    TaskNotFound,
    TaskNotRegistered,
    TaskQueueError,
    TaskResultError,
)
from sa_taskqueue.footing import FootingReport
from sa_taskqueue.health import HealthThresholds, TableHealth
from sa_taskqueue.model import Base, Task, TaskMixin, TaskStatus, metadata
from sa_taskqueue.queue import TaskQueue
from sa_taskqueue.registered import RegisteredTask, TaskWithOptions
from sa_taskqueue.worker import Worker

__version__ = "0.1.0"

# ``session.add(Task(...))`` is checked and wakes workers like ``enqueue``.
# Every import of a submodule (the model included) imports this package first,
# so no task row is flushed before these listeners are in place.
session_events.listen()

__all__ = [
    "Base",
    "ClaimedTask",
    "DatabaseBusy",
    "DatabaseError",
    "DatabaseUnavailable",
    "FootingError",
    "FootingReport",
    "HealthThresholds",
    "MalformedTask",
    "RegisteredTask",
    "ResultTimeout",
    "SchemaMissing",
    "StrategyError",
    "SyncCallOnEventLoop",
    "TableHealth",
    "Task",
    "TaskCancelled",
    "TaskFailed",
    "TaskMixin",
    "TaskNotFound",
    "TaskNotRegistered",
    "TaskQueue",
    "TaskQueueError",
    "TaskResultError",
    "TaskStatus",
    "TaskWithOptions",
    "Worker",
    "backends",
    "health",
    "metadata",
    "strategies",
]
