"""Every check of what an application hands the queue, before anything reaches the database.

One place, used by every enqueue path (`TaskQueue.enqueue`, `enqueue_many`,
the command line's ``enqueue``), by task registration and by the recording of
results, so that a value refused on one path is refused on all of them, with
the same error: `TypeError` for a value of the wrong kind, `ValueError` for
one out of range.  "In range" is what every supported database stores
(`sa_taskqueue.core.limits`): a value only some would take, or one a database
would refuse mid-transaction, is refused here, before any SQL is sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.sql import ClauseElement

from sa_taskqueue.core import param_types
from sa_taskqueue.core.limits import (
    DEFAULT_LIMITS,
    EARLIEST_RUN_AT,
    LATEST_RUN_AT,
    MAX_PARAMS_DEPTH,
    PARAMS_INT_MAX,
    PARAMS_INT_MIN,
    ColumnLimits,
)
from sa_taskqueue.core.model import ID_MAX, TaskStatus
from sa_taskqueue.core.storable_text import unstorable_character


class _Refused(Exception):
    """A value in params that cannot be stored; the path to it is added as the error unwinds."""

    def __init__(self, error: type[Exception], problem: str) -> None:
        super().__init__(problem)
        self.error = error
        self.problem = problem
        self.path: list[str] = []


def check_params(params: Any) -> None:
    """A dict with string keys (they become keyword arguments) of values every database stores as JSON.

    As `storable_params`, for a caller that keeps no encoded copy.
    """
    storable_params(params)


def storable_params(params: Any) -> dict[str, Any]:
    """``params`` checked, as they are stored: values of known types encoded as plain JSON.

    Values are None, booleans, integers within `PARAMS_INT_MIN`..`PARAMS_INT_MAX`,
    finite floats, strings, lists or tuples and dicts of these, nested at most
    `MAX_PARAMS_DEPTH` deep, or values of the types `sa_taskqueue.core.param_types`
    knows (datetimes, Decimals, UUIDs, Enum members, registered classes), each
    replaced by its JSON encoding; no string (key or value) may hold a NUL or an
    unpaired surrogate.  One pass over the values, no serialisation: a wrong
    kind is a `TypeError`, a value out of range a `ValueError`, each naming
    where in params it is.  ``params`` itself is returned when nothing needed
    encoding (the common case: no copy); otherwise a copy, ``params`` untouched.
    """
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict (a JSON object), got {type(params).__name__}")
    try:
        return _check_object(params, 1)
    except _Refused as refused:
        where = "".join(reversed(refused.path))
        raise refused.error(f"params{where}: {refused.problem}") from None


def _check_object(value: dict[Any, Any], depth: int) -> dict[Any, Any]:
    if depth > MAX_PARAMS_DEPTH:
        raise _Refused(ValueError, f"nested more than {MAX_PARAMS_DEPTH} arrays and objects deep")
    encoded: dict[Any, Any] | None = None
    for key, item in value.items():
        if not isinstance(key, str):
            raise _Refused(TypeError, f"keys must be strings (they become keyword arguments), got {key!r}")
        try:
            problem = unstorable_character(key)
            if problem is not None:
                raise _Refused(ValueError, f"the key holds {problem}")
            stored = _check_value(item, depth)
        except _Refused as refused:
            refused.path.append(f"[{key!r}]")
            raise
        if stored is not item:
            if encoded is None:
                encoded = dict(value)
            encoded[key] = stored
    return value if encoded is None else encoded


def _check_value(value: Any, depth: int) -> Any:
    """``value`` as stored: itself when it is JSON already, else its encoding, checked in turn."""
    kind = type(value)
    if kind is str:
        problem = unstorable_character(value)
        if problem is not None:
            raise _Refused(ValueError, f"the string holds {problem}")
    elif value is None or kind is bool:
        pass
    elif kind is int:
        _check_int(value)
    elif kind is float:
        _check_float(value)
    elif kind is dict:
        return _check_object(value, depth + 1)
    elif kind is list or kind is tuple:
        return _check_array(value, depth)
    else:
        return _check_other(value, depth)
    return value


def _check_int(value: int) -> None:
    if not PARAMS_INT_MIN <= value <= PARAMS_INT_MAX:
        # (Named by size: printing a huge integer can itself fail, past 4,300 digits.)
        raise _Refused(
            ValueError,
            f"integers must fit in 64 bits ({PARAMS_INT_MIN} to {PARAMS_INT_MAX}), "
            f"got one of {value.bit_length()} bits",
        )


def _check_float(value: float) -> None:
    if not math.isfinite(value):
        raise _Refused(ValueError, f"numbers must be finite (JSON has no NaN or infinity), got {value}")


def _check_array(value: list[Any] | tuple[Any, ...], depth: int) -> Any:
    if depth + 1 > MAX_PARAMS_DEPTH:
        raise _Refused(ValueError, f"nested more than {MAX_PARAMS_DEPTH} arrays and objects deep")
    encoded: list[Any] | None = None
    for index, item in enumerate(value):
        try:
            stored = _check_value(item, depth + 1)
        except _Refused as refused:
            refused.path.append(f"[{index}]")
            raise
        if stored is not item:
            if encoded is None:
                encoded = list(value)
            encoded[index] = stored
    return value if encoded is None else encoded


def _check_other(value: Any, depth: int) -> Any:
    """A value of a known param type (encoded), or of a subclass of a JSON type (kept), or refused."""
    kind = type(value)
    try:
        known, encoded = param_types.encode(value)
    except (TypeError, ValueError) as error:
        raise _Refused(type(error), f"{kind.__name__}: {error}") from None
    except Exception as error:  # noqa: BLE001 - an application's encoder may raise anything
        raise _Refused(
            TypeError, f"{kind.__name__}: its encoder raised {type(error).__name__}: {error}"
        ) from None
    if known:
        if type(encoded) is kind:
            raise _Refused(TypeError, f"the encoder of {kind.__name__} returned a {kind.__name__}, not JSON")
        return _check_value(encoded, depth)
    if isinstance(value, str):
        problem = unstorable_character(value)
        if problem is not None:
            raise _Refused(ValueError, f"the string holds {problem}")
    elif isinstance(value, int):
        _check_int(value)
    elif isinstance(value, float):
        _check_float(value)
    elif isinstance(value, dict):
        return _check_object(value, depth + 1)
    elif isinstance(value, list | tuple):
        return _check_array(value, depth)
    else:
        raise _Refused(
            TypeError,
            f"{kind.__name__} is not a JSON value, nor a type params can hold "
            "(register one with sa_taskqueue.register_type)",
        )
    return value


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


def check_text(argument: str, value: Any, max_length: int) -> None:
    """A non-empty string of at most ``max_length`` characters that every database stores."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a string, got {type(value).__name__}")
    if not value or len(value) > max_length:
        raise ValueError(
            f"{argument} must be a non-empty string of at most {max_length} characters, got {_shown(value)}"
        )
    problem = unstorable_character(value)
    if problem is not None:
        raise ValueError(f"{argument} holds {problem}: {_shown(value)}")


def check_task_name(name: Any, limits: ColumnLimits = DEFAULT_LIMITS) -> None:
    check_text("name", name, limits.name_length)


def check_queue_name(queue: Any, limits: ColumnLimits = DEFAULT_LIMITS) -> None:
    check_text("queue", queue, limits.queue_length)


def check_int(argument: str, value: Any, bounds: tuple[int, int] | None = None) -> None:
    """An integer (not a bool), within ``bounds`` (inclusive) when given."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{argument} must be an integer, got {value!r}")
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{argument} must be between {bounds[0]} and {bounds[1]}, got {value!r}")


def check_max_attempts(value: Any, limits: ColumnLimits = DEFAULT_LIMITS) -> None:
    check_int("max_attempts", value)
    if value < 1:
        raise ValueError(f"max_attempts must be at least 1, got {value!r}")
    check_int("max_attempts", value, limits.max_attempts_range)


def check_task_id(value: Any) -> None:
    """A task id as the 64-bit id column can hold it (ids start at 1)."""
    check_int("task_id", value, (1, ID_MAX))


def check_priority(value: Any, limits: ColumnLimits = DEFAULT_LIMITS) -> None:
    check_int("priority", value, limits.priority_range)


def check_positive_int(argument: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument} must be a positive integer, got {value!r}")


def check_run_at(run_at: Any) -> None:
    """An aware datetime that is, in UTC, within the years every database stores (1000 to 9999)."""
    check_datetime("run_at", run_at)


def check_datetime(argument: str, value: Any) -> None:
    """An aware datetime within the years every database stores; ``argument`` names it in the error."""
    if not isinstance(value, datetime):
        raise TypeError(f"{argument} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{argument} must be timezone-aware, got naive {value!r}")
    if not EARLIEST_RUN_AT <= value <= LATEST_RUN_AT:
        raise ValueError(
            f"{argument} must be between {EARLIEST_RUN_AT.isoformat()} and {LATEST_RUN_AT.isoformat()} "
            f"in UTC, got {value.isoformat()}"
        )


def check_delay(delay: Any) -> None:
    """A non-negative timedelta (how long from now a task is due)."""
    if not isinstance(delay, timedelta):
        raise TypeError(f"delay must be a timedelta, got {type(delay).__name__}")
    if delay < timedelta(0):
        raise ValueError(f"delay must not be negative, got {delay!r}")


def run_at_after(now: datetime, delay: timedelta) -> datetime:
    """``now + delay``, checked like any ``run_at`` (a ValueError, not an OverflowError, when too far)."""
    try:
        run_at = now.astimezone(UTC) + delay
    except OverflowError:
        raise ValueError(f"a delay of {delay} from now is past what a database stores") from None
    check_run_at(run_at)
    return run_at


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
    limits: ColumnLimits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """The column values of one new task, every one checked; ``run_at`` None means ``now``.

    ``limits`` are those of the task table the row goes to.
    """
    check_task_name(name, limits)
    params = storable_params(params)
    check_queue_name(queue, limits)
    check_priority(priority, limits)
    check_max_attempts(max_attempts, limits)
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


#: The columns of a task row `check_task_row` checks, and the datetimes among them.
CHECKED_COLUMNS = (
    "name",
    "queue",
    "params",
    "priority",
    "attempts",
    "max_attempts",
    "status",
    "run_at",
    "created_at",
    "started_at",
    "finished_at",
    "locked_until",
    "result",
    "unique_key",
)
_DATETIME_COLUMNS = frozenset({"run_at", "created_at", "started_at", "finished_at", "locked_until"})


def check_task_row(
    values: Mapping[str, Any], limits: ColumnLimits = DEFAULT_LIMITS, *, new: bool
) -> dict[str, Any]:
    """The values an application set on a task row itself (``session.add(Task(...))``), each checked.

    ``values`` holds only the columns that were set: a column missing, or
    None in a ``new`` row, gets its default at the INSERT.  A SQL expression
    (``Task.attempts + 1``, ``func.now()``) is not checked: the database
    computes it, and its own constraints are what hold it.  Returned: the
    values to store in place of those given (params holding datetimes,
    Decimals, ... as their JSON encoding; `storable_params`).  A new row must
    have a name.  The name is not looked up among registered tasks: the
    process adding the row need not import the task (a worker that knows no
    such task leaves it queued).
    """
    if new and values.get("name") is None:
        raise TypeError("name must be set: a task row needs the name of the task to run")
    stored: dict[str, Any] = {}
    for column, value in values.items():
        if _is_sql_expression(value):
            continue  # computed by the database at the flush: there is no value to check here
        if value is None:
            if not new and column not in _NULLABLE_COLUMNS:
                raise TypeError(f"{column} must not be None: the column holds no NULL")
            continue
        if column == "params":
            params = storable_params(value)
            if params is not value:
                stored["params"] = params
            continue
        _ROW_CHECKS[column](value, limits)
    return stored


def _is_sql_expression(value: Any) -> bool:
    """``Task.attempts + 1``, ``func.now()``, a column: SQL the database evaluates, valid SQLAlchemy."""
    return isinstance(value, ClauseElement) or hasattr(value, "__clause_element__")


def check_status(status: Any) -> None:
    """A `TaskStatus`, or the string value of one (what the column stores)."""
    if not isinstance(status, str):
        raise TypeError(f"status must be a TaskStatus, got {type(status).__name__}")
    try:
        TaskStatus(status)
    except ValueError:
        known = ", ".join(repr(member.value) for member in TaskStatus)
        raise ValueError(f"status must be one of {known}, got {_shown(status)}") from None


def _datetime_check(column: str) -> Callable[[Any, ColumnLimits], None]:
    return lambda value, _: check_datetime(column, value)


_NULLABLE_COLUMNS = frozenset({"started_at", "finished_at", "locked_until", "result", "unique_key"})

_ROW_CHECKS: dict[str, Callable[[Any, ColumnLimits], None]] = {
    "name": check_task_name,
    "queue": check_queue_name,
    "params": lambda value, _: check_params(value),
    "priority": check_priority,
    "attempts": lambda value, limits: check_int("attempts", value, limits.attempts_range),
    "max_attempts": check_max_attempts,
    "status": lambda value, _: check_status(value),
    "result": lambda value, _: check_result(value),
    "unique_key": lambda value, limits: check_text("unique_key", value, limits.unique_key_length),
    **{column: _datetime_check(column) for column in _DATETIME_COLUMNS},
}


def _shown(text: str) -> str:
    """``text`` for an error message: repr'd, and shortened when long."""
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"


__all__ = [
    "check_datetime",
    "check_delay",
    "check_int",
    "check_max_attempts",
    "check_params",
    "check_positive_int",
    "check_priority",
    "check_queue_name",
    "check_result",
    "check_retry_delay",
    "check_run_at",
    "check_status",
    "check_task_id",
    "check_task_name",
    "check_task_row",
    "check_text",
    "is_storable",
    "run_at_after",
    "storable_params",
    "task_values",
    "timeout_seconds",
]
