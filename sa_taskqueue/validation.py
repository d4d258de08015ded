"""Every check of what an application hands the queue, before anything reaches the database.

One place, used by every enqueue path (`TaskQueue.enqueue`, `enqueue_many`,
the command line's ``enqueue``), by task registration and by the recording of
results, so that a value refused on one path is refused on all of them, with
the same error: `TypeError` for a value of the wrong kind, `ValueError` for
one out of range.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from sa_taskqueue.model import ID_MAX, INTEGER_MAX, INTEGER_MIN, QUEUE_LENGTH, TaskStatus


def check_params(params: Any) -> None:
    """A dict with string keys (they become keyword arguments) whose values JSON can hold."""
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict, got {type(params).__name__}")
    for key in params:
        if not isinstance(key, str):
            raise TypeError(f"params keys must be strings (they become keyword arguments), got {key!r}")
    try:
        json.dumps(params, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"params must be JSON-serialisable: {error}") from error


def check_result(result: Any, what: str = "result") -> None:
    """None, or a value JSON can hold (a task's result is stored as JSON)."""
    if result is None:
        return
    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} is not JSON-serialisable: {error}") from error


def is_storable(result: Any) -> bool:
    """Whether ``result`` can be stored as a task's result."""
    try:
        check_result(result)
    except TypeError:
        return False
    return True


def check_queue_name(queue: Any) -> None:
    if not isinstance(queue, str) or not queue or len(queue) > QUEUE_LENGTH:
        raise ValueError(
            f"queue must be a non-empty string of at most {QUEUE_LENGTH} characters, got {queue!r}"
        )


def check_int(argument: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{argument} must be an integer, got {value!r}")


def check_column_int(argument: str, value: Any) -> None:
    """An integer the 32-bit INTEGER column it is stored in can hold, on every database."""
    check_int(argument, value)
    if not INTEGER_MIN <= value <= INTEGER_MAX:
        raise ValueError(f"{argument} must be between {INTEGER_MIN} and {INTEGER_MAX}, got {value!r}")


def check_max_attempts(value: Any) -> None:
    check_column_int("max_attempts", value)
    if value < 1:
        raise ValueError(f"max_attempts must be at least 1, got {value!r}")


def check_task_id(value: Any) -> None:
    """A task id as the 64-bit id column can hold it (ids start at 1)."""
    check_int("task_id", value)
    if not 1 <= value <= ID_MAX:
        raise ValueError(f"task_id must be between 1 and {ID_MAX}, got {value!r}")


def check_positive_int(argument: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument} must be a positive integer, got {value!r}")


def check_run_at(run_at: Any) -> None:
    if not isinstance(run_at, datetime):
        raise TypeError(f"run_at must be a datetime, got {type(run_at).__name__}")
    if run_at.tzinfo is None or run_at.utcoffset() is None:
        raise ValueError(f"run_at must be timezone-aware, got naive {run_at!r}")


def check_retry_delay(retry_delay: Any) -> None:
    if not isinstance(retry_delay, timedelta) or retry_delay < timedelta(0):
        raise ValueError(f"retry_delay must be a non-negative timedelta, got {retry_delay!r}")


def timeout_seconds(timeout: timedelta | float | None) -> float | None:
    """A task timeout as seconds (None: no timeout), checked positive."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds or timedelta, got {timeout!r}")
    return float(seconds)


def task_values(
    name: str,
    params: Any,
    *,
    queue: Any,
    priority: Any,
    max_attempts: Any,
    run_at: Any,
    now: datetime,
) -> dict[str, Any]:
    """The column values of one new task, every one checked; ``run_at`` None means ``now``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    check_params(params)
    check_queue_name(queue)
    check_column_int("priority", priority)
    check_max_attempts(max_attempts)
    if run_at is not None:
        check_run_at(run_at)
    return {
        "name": name,
        "params": params,
        "queue": queue,
        "priority": priority,
        "max_attempts": max_attempts,
        "run_at": run_at if run_at is not None else now,
        "status": TaskStatus.QUEUED,
        "attempts": 0,
        "created_at": now,
    }


__all__ = [
    "check_column_int",
    "check_int",
    "check_max_attempts",
    "check_params",
    "check_positive_int",
    "check_queue_name",
    "check_result",
    "check_retry_delay",
    "check_run_at",
    "check_task_id",
    "is_storable",
    "task_values",
    "timeout_seconds",
]
