"""The command line's numbers and durations, each checked against the range it may take.

A number the database column, the clock or the operating system cannot hold
(a priority past 32 bits, an id past 64, a delay past the year 9999, a poll
interval longer than a wait can be) would otherwise fail deep inside a
driver, with a traceback.  Each is refused where it is typed instead, as a
usage error (exit code 2) that names the option and the range allowed.
"""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from sa_taskqueue.core.model import ID_MAX, INTEGER_MAX, INTEGER_MIN
from sa_taskqueue.core.validation import check_run_at
from sa_taskqueue.features.admin import LIST_LIMIT_MAX

#: The longest ``--delay`` and ``--older-than``: a century, far inside every
#: database's datetime range (and Python's, which ends in 9999).
MAX_DURATION = timedelta(days=36500)
#: The longest wait a worker option may ask for: a day.
MAX_WAIT_SECONDS = 86400.0

if TYPE_CHECKING:  # click is generic in its value type from 8.2 on, and not subscriptable before
    _IntParam = click.ParamType[int]
    _FloatParam = click.ParamType[float]
    _DurationParam = click.ParamType[timedelta]
    _ObjectParam = click.ParamType[dict[str, Any]]
    _DatetimeParam = click.ParamType[datetime]
else:
    _IntParam = _FloatParam = _DurationParam = _ObjectParam = _DatetimeParam = click.ParamType

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")


class BoundedInt(_IntParam):
    """A whole number between ``low`` and ``high``, inclusive."""

    name = "integer"

    def __init__(self, low: int, high: int) -> None:
        self.low = low
        self.high = high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip(), 10)
            except ValueError:
                self.fail(f"{value!r} is not a whole number {self.allowed}", param, ctx)
        if not self.low <= number <= self.high:
            what = param.name if param is not None and param.name else "the value"
            self.fail(f"{what} must be {self.allowed}, got {value}", param, ctx)
        return number

    @property
    def allowed(self) -> str:
        return f"between {self.low} and {self.high}"


class BoundedFloat(_FloatParam):
    """A finite number between ``low`` and ``high``, inclusive (no ``nan``, no ``inf``)."""

    name = "number"

    def __init__(self, low: float, high: float) -> None:
        self.low = low
        self.high = high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number {self.allowed}", param, ctx)
        if not math.isfinite(number) or not self.low <= number <= self.high:
            self.fail(f"{value} is out of range: it must be {self.allowed}", param, ctx)
        return number

    @property
    def allowed(self) -> str:
        return f"between {self.low:g} and {self.high:g} seconds"


class Duration(_DurationParam):
    """``30s``, ``10m``, ``2h``, ``7d``, ``1w`` or plain seconds, at most `MAX_DURATION`."""

    name = "duration"

    def __init__(self, longest: timedelta = MAX_DURATION) -> None:
        self.longest = longest

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        if isinstance(value, timedelta):
            return value
        match = _DURATION.fullmatch(str(value))
        if not match:
            self.fail(f"{value!r} is not a duration like 30s, 10m, 2h or 7d", param, ctx)
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
        if not math.isfinite(seconds) or seconds > timedelta.max.total_seconds():
            self.fail(
                f"{value!r} is longer than any date a database stores: it must be {self.allowed}", param, ctx
            )
        if seconds > self.longest.total_seconds():
            self.fail(f"{value} is out of range: it must be {self.allowed}", param, ctx)
        return timedelta(seconds=seconds)

    @property
    def allowed(self) -> str:
        return f"between 0s and {self.longest.days}d"


class JSONObject(_ObjectParam):
    """A JSON object: written out, read from a file (``@params.json``) or from stdin (``-``).

    Long or generated params are easier kept in a file or piped in than
    quoted for a shell.  A problem names where the text came from.
    """

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        text, source = self._read(str(value), param, ctx)
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            self.fail(f"{source} is not JSON: {error}", param, ctx)
        except RecursionError:
            self.fail(f"{source} is nested too deeply", param, ctx)
        if not isinstance(document, dict):
            self.fail(
                f'{source} must be a JSON object, like {{"to": "a@example.com"}}, '
                f"not a JSON {type(document).__name__}",
                param,
                ctx,
            )
        return document

    def _read(self, value: str, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, str]:
        """The text to parse, and how to name where it came from."""
        if value == "-":
            return sys.stdin.read(), "stdin"
        if value.startswith("@"):
            path = Path(value[1:])
            try:
                return path.read_text(encoding="utf-8"), f"the file {str(path)!r}"
            except OSError as error:
                self.fail(f"cannot read the file {str(path)!r}: {error.strerror or error}", param, ctx)
            except UnicodeDecodeError as error:
                self.fail(f"the file {str(path)!r} is not UTF-8 text: {error}", param, ctx)
        return value, "the value"


class AwareDatetime(_DatetimeParam):
    """An ISO 8601 date and time with its UTC offset (``2026-12-01T09:00:00Z``, ``...+02:00``).

    A time without an offset is refused rather than guessed: the machine's
    zone and UTC differ by hours, and a task run hours off is a quiet bug.
    """

    name = "datetime"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> datetime:
        if isinstance(value, datetime):
            moment = value
        else:
            try:
                moment = datetime.fromisoformat(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not an ISO 8601 date and time like 2026-12-01T09:00:00Z", param, ctx)
        if moment.utcoffset() is None:
            self.fail(f"{value!r} has no UTC offset: add Z (UTC) or one like +02:00", param, ctx)
        try:
            check_run_at(moment)
        except (TypeError, ValueError) as error:
            self.fail(str(error), param, ctx)
        return moment


#: A value of a 32-bit INTEGER column (``priority``).
COLUMN_INT = BoundedInt(INTEGER_MIN, INTEGER_MAX)
#: ``--max-attempts``: at least one attempt, at most what its column holds.
ATTEMPTS = BoundedInt(1, INTEGER_MAX)
#: A task id: the id column is 64-bit and ids start at 1.
TASK_ID = BoundedInt(1, ID_MAX)
#: ``--concurrency``: tasks at once in one worker (threads or child processes).
CONCURRENCY = BoundedInt(1, 1000)
#: ``purge --batch-size``: rows per transaction; the ids of one batch are
#: bound as parameters, and SQLite takes at most 32,766 of those.
BATCH_SIZE = BoundedInt(1, 10_000)
#: ``demo --tasks`` and ``demo --workers``.
DEMO_TASKS = BoundedInt(1, 1_000_000)
DEMO_WORKERS = BoundedInt(1, 64)
#: ``--poll-interval``: the longest idle wait between polls.
POLL_INTERVAL = BoundedFloat(0.001, MAX_WAIT_SECONDS)
#: ``--shutdown-timeout``: how long running tasks get after SIGTERM.
SHUTDOWN_TIMEOUT = BoundedFloat(0.0, MAX_WAIT_SECONDS)
#: ``--completion-delay``: how long a success waits for the other tasks claimed (a minute at most).
COMPLETION_DELAY = BoundedFloat(0.0, 60.0)
DURATION = Duration()
#: ``list --limit``: rows shown at once.
LIST_LIMIT = BoundedInt(1, LIST_LIMIT_MAX)
#: ``enqueue --params``.
JSON_OBJECT = JSONObject()
#: ``health --max-dead-rows`` and the other counts and sizes a threshold names.
THRESHOLD_COUNT = BoundedInt(0, ID_MAX)
#: ``health --max-transaction-age``: at most a century, like every other duration.
THRESHOLD_AGE = Duration()
#: ``enqueue --run-at``.
RUN_AT = AwareDatetime()

__all__ = [
    "ATTEMPTS",
    "BATCH_SIZE",
    "COLUMN_INT",
    "CONCURRENCY",
    "DEMO_TASKS",
    "DEMO_WORKERS",
    "DURATION",
    "JSON_OBJECT",
    "LIST_LIMIT",
    "MAX_DURATION",
    "MAX_WAIT_SECONDS",
    "POLL_INTERVAL",
    "RUN_AT",
    "SHUTDOWN_TIMEOUT",
    "TASK_ID",
    "THRESHOLD_AGE",
    "THRESHOLD_COUNT",
    "AwareDatetime",
    "BoundedFloat",
    "BoundedInt",
    "Duration",
    "JSONObject",
]
