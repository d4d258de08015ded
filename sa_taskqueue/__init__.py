"""sa_taskqueue: a reliable task queue in the SQL database an application already has.

``import sa_taskqueue as tq``, map `tq.Task` (or `tq.TaskMixin` on your own
base), create a `tq.TaskQueue`, register functions with ``@queue.task`` and
run ``queue.run_worker()``.
"""

from __future__ import annotations

import importlib

from sa_taskqueue import _moved, backends, health, strategies
from sa_taskqueue.core import session_events
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.current_task import CancellationRequested, TaskContext, current_task
from sa_taskqueue.core.event_loop_bridge import SyncCallOnEventLoop
from sa_taskqueue.core.events import (
    EnqueueEvent,
    EventKind,
    EventStream,
    StatementEvent,
    TaskEvent,
    WorkerEvent,
)
from sa_taskqueue.core.exceptions import (
    BatchClosed,
    BatchNotFound,
    DatabaseBusy,
    DatabaseError,
    DatabaseUnavailable,
    FootingError,
    MalformedTask,
    ParamTypeError,
    ParentNotFound,
    PoolTooSmall,
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
from sa_taskqueue.core.model import Base, Task, TaskMixin, TaskStatus, metadata
from sa_taskqueue.core.param_types import register_type
from sa_taskqueue.core.registered import RegisteredTask, TaskCall, TaskWithOptions
from sa_taskqueue.features.cancellation import CancelResult, CancelState, TaskProgress
from sa_taskqueue.features.live_workers import (
    LiveWorker,
    RunningTask,
    UnservedTasks,
    list_live_workers,
    unserved_tasks,
)
from sa_taskqueue.features.workflows.batches import BatchState, BatchSummary
from sa_taskqueue.health import HealthThresholds, TableHealth
from sa_taskqueue.health.self_test import FootingReport
from sa_taskqueue.queue import TaskQueue
from sa_taskqueue.queue.batching import Batch
from sa_taskqueue.worker.worker import Worker

__version__ = "0.1.0"

# ``session.add(Task(...))`` is checked and wakes workers like ``enqueue``.
# Every import of a submodule (the model included) imports this package first,
# so no task row is flushed before these listeners are in place.
session_events.listen()
# ``import sa_taskqueue.limits`` and the other paths of modules that moved keep working.
_moved.install()


def __getattr__(name: str) -> object:
    """``sa_taskqueue.types`` and the other moved modules, as attributes of the package as before."""
    if name in _moved.MOVED:
        return importlib.import_module(f"sa_taskqueue.{name}")
    raise AttributeError(f"module 'sa_taskqueue' has no attribute {name!r}")


__all__ = [
    "Base",
    "Batch",
    "BatchClosed",
    "BatchNotFound",
    "BatchState",
    "BatchSummary",
    "CancelResult",
    "CancelState",
    "CancellationRequested",
    "ClaimedTask",
    "DatabaseBusy",
    "DatabaseError",
    "DatabaseUnavailable",
    "EnqueueEvent",
    "EventKind",
    "EventStream",
    "FootingError",
    "FootingReport",
    "HealthThresholds",
    "LiveWorker",
    "MalformedTask",
    "ParamTypeError",
    "ParentNotFound",
    "PoolTooSmall",
    "RegisteredTask",
    "ResultTimeout",
    "RunningTask",
    "SchemaMissing",
    "StatementEvent",
    "StrategyError",
    "SyncCallOnEventLoop",
    "TableHealth",
    "Task",
    "TaskCall",
    "TaskCancelled",
    "TaskContext",
    "TaskEvent",
    "TaskFailed",
    "TaskMixin",
    "TaskNotFound",
    "TaskNotRegistered",
    "TaskProgress",
    "TaskQueue",
    "TaskQueueError",
    "TaskResultError",
    "TaskStatus",
    "TaskWithOptions",
    "UnservedTasks",
    "Worker",
    "WorkerEvent",
    "backends",
    "current_task",
    "health",
    "list_live_workers",
    "metadata",
    "register_type",
    "strategies",
    "unserved_tasks",
]
