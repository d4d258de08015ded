"""How ``sa-taskqueue list`` and ``show`` print tasks: a table for people, JSON for scripts.

The rows are `sa_taskqueue.features.admin.list_tasks` and ``get_task``'s (column ->
value); what a person sees is chosen here, what a script gets is every
column, with times as ISO 8601 in UTC.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from rich.console import Console
from rich.table import Table as RichTable

from sa_taskqueue.features.admin import Undecodable

#: The columns ``show`` prints in its table, in this order; the long ones
#: (params, result, last error) follow it, each as a block of its own.
_SHOWN_FIRST = (
    "id",
    "name",
    "queue",
    "priority",
    "status",
    "attempts",
    "max_attempts",
    "run_at",
    "created_at",
    "started_at",
    "finished_at",
    "locked_by",
    "locked_until",
)
_BLOCKS = ("params", "result", "last_error")
_LABELS = {"locked_by": "lease holder", "locked_until": "lease ends", "last_error": "last error"}


def human_age(age: timedelta) -> str:
    """``12.0s``, ``3.5m``, ``2.0h``, ``4.1d``: how long ago, at a glance."""
    seconds = age.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(seconds, 0.0):.1f}s"


def json_value(value: Any) -> Any:
    """``value`` as JSON takes it: times in ISO 8601, a stored text that is not JSON as that text."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Undecodable):
        return value.text
    if isinstance(value, enum.Enum):  # TaskStatus
        return value.value
    return value


def rows_json(rows: Iterable[dict[str, Any]]) -> str:
    return json.dumps([{key: json_value(value) for key, value in row.items()} for row in rows], default=str)


def row_json(row: dict[str, Any]) -> str:
    return json.dumps({key: json_value(value) for key, value in row.items()}, indent=2, default=str)


def print_list(console: Console, rows: list[dict[str, Any]], now: datetime) -> None:
    """The tasks as a table, newest first, as ``rows`` come."""
    table = RichTable(title="tasks (newest first)")
    for heading, justify in (
        ("id", "right"),
        ("name", "left"),
        ("queue", "left"),
        ("status", "left"),
        ("attempts", "right"),
        ("run_at (UTC)", "left"),
        ("age", "right"),
        ("worker", "left"),
    ):
        table.add_column(heading, justify=justify, no_wrap=heading in ("id", "run_at (UTC)"))  # type: ignore[arg-type]
    for row in rows:
        table.add_row(
            str(row["id"]),
            row["name"],
            row["queue"],
            _text(row["status"]),
            f"{row['attempts']}/{row['max_attempts']}",
            _short_time(row["run_at"]),
            human_age(now - row["created_at"]) if row.get("created_at") else "",
            row.get("locked_by") or "",
        )
    if not rows:
        table.add_row("", "(no tasks)", *("" for _ in range(6)))
    console.print(table)


def print_task(console: Console, row: dict[str, Any]) -> None:
    """Every column of one task: a table of the short ones, then params, result and error verbatim."""
    table = RichTable(title=f"task {row['id']}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    others = [key for key in row if key not in _SHOWN_FIRST and key not in _BLOCKS]
    for key in (*(key for key in _SHOWN_FIRST if key in row), *others):
        table.add_row(_LABELS.get(key, key), _text(row[key]))
    console.print(table)
    for key in _BLOCKS:
        if key not in row:
            continue
        console.print(f"{_LABELS.get(key, key)}:", style="bold")
        # Printed as stored: no markup read into it, no wrapping of a traceback's lines.
        console.print(_block(key, row[key]), markup=False, highlight=False, soft_wrap=True)


def _short_time(value: datetime | None) -> str:
    """To the second, in UTC, without the offset: the column's heading says UTC."""
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    return str(json_value(value))


def _block(key: str, value: Any) -> str:
    if value is None:
        return "  (none)"
    if isinstance(value, Undecodable):
        return f"{value.text}\n  (stored text, not JSON)"
    if key == "last_error":
        return str(value)  # a traceback, verbatim
    return json.dumps(value, indent=2, sort_keys=True, default=str)


__all__ = ["human_age", "json_value", "print_list", "print_task", "row_json", "rows_json"]
