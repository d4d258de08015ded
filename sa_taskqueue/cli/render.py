"""How ``sa-taskqueue list`` and ``show`` print tasks: a table for people, JSON for scripts.

The rows are `sa_taskqueue.features.admin.list_tasks` and ``get_task``'s (column ->
value); what a person sees is chosen here, what a script gets is every
column, with times as ISO 8601 in UTC.

Everything printed is scrubbed of the secrets of the URLs the command was
given (a row stored before the queue scrubbed its errors may hold one).  A
listing prints many rows, so each long value is cut to `LISTED_VALUE_LENGTH`
characters around a marker saying how much was cut: fifty tasks with a 20 MB
result each would otherwise print a gigabyte.  ``show`` prints one task whole.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from rich.console import Console
from rich.table import Table as RichTable

from sa_taskqueue.core.redaction import Redactor
from sa_taskqueue.features.admin import Undecodable

#: The longest value a listing prints of a column, in characters: of its JSON
#: text for the params and the result, of the text for the others.
LISTED_VALUE_LENGTH = 1000

#: The key a listed row in JSON gains when a value of it was cut: column -> the length of the whole value.
CUT_KEY = "_cut"

_CUT_MARKER = " ... [{cut:,} of {whole:,} characters cut: `sa-taskqueue show {task_id}` prints them] ... "

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


#: A width no row reaches: what a table printed to a pipe or a file may take.
_UNBOUNDED_WIDTH = 1_000_000


def output_console() -> Console:
    """Where the commands print: the terminal, at its width; anything else (a pipe, a file), unbounded.

    Off a terminal rich assumes 80 columns and cuts a table's cells to fit
    (``shop.…``), so ``sa-taskqueue list | grep shop.orders`` would miss the
    very rows it looks for; there a table is as wide as its longest cell.
    """
    console = Console()
    return console if console.is_terminal else Console(width=_UNBOUNDED_WIDTH)


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


def rows_json(
    rows: Iterable[dict[str, Any]],
    redactor: Redactor | None = None,
    *,
    limit: int | None = LISTED_VALUE_LENGTH,
) -> str:
    """The rows as one JSON array, each value longer than ``limit`` cut (None: printed whole).

    A cut value becomes a string: its head and tail (of its JSON text, for
    a params or result) around a marker saying how much was cut, and the row
    gains `CUT_KEY`, mapping each column cut to the length of its whole value,
    so that a script can tell a cut value from a string that looks like one.
    """
    return json.dumps([listed_row(row, redactor, limit) for row in rows], default=str)


def row_json(row: dict[str, Any], redactor: Redactor | None = None) -> str:
    """One task as a JSON object of every column, whole."""
    return json.dumps(scrubbed_row(row, redactor), indent=2, default=str)


def scrubbed_row(row: dict[str, Any], redactor: Redactor | None) -> dict[str, Any]:
    """The row as JSON takes it (`json_value`), every string in it scrubbed by ``redactor``."""
    scrub: Callable[[Any], Any] = redactor.value if redactor is not None else _same
    return {key: scrub(json_value(value)) for key, value in row.items()}


def listed_row(row: dict[str, Any], redactor: Redactor | None, limit: int | None) -> dict[str, Any]:
    """`scrubbed_row`, with each value longer than ``limit`` characters cut (see `rows_json`)."""
    listed = scrubbed_row(row, redactor)
    if limit is None:
        return listed
    cut: dict[str, int] = {}
    for key, value in listed.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > limit:
            listed[key] = cut_text(text, limit, row.get("id"))
            cut[key] = len(text)
    if cut:
        listed[CUT_KEY] = cut
    return listed


def cut_text(text: str, limit: int, task_id: Any) -> str:
    """``text`` cut in the middle to about ``limit`` characters, around a marker saying how much was cut.

    The head says what a value is (a params' first keys, an error's type);
    the tail of an error text is its last line, the exception and message.
    """
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    marker = _CUT_MARKER.format(cut=len(text) - limit, whole=len(text), task_id=task_id)
    return f"{text[:head]}{marker}{text[len(text) - tail :]}"


def _same(value: Any) -> Any:
    return value


def print_list(
    console: Console, rows: list[dict[str, Any]], now: datetime, redactor: Redactor | None = None
) -> None:
    """The tasks as a table, newest first, as ``rows`` come: the short columns alone, scrubbed."""
    scrub: Callable[[str], str] = redactor.text if redactor is not None else _same
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
        cells = (
            str(row["id"]),
            row["name"],
            row["queue"],
            _text(row["status"]),
            f"{row['attempts']}/{row['max_attempts']}",
            _short_time(row["run_at"]),
            human_age(now - row["created_at"]) if row.get("created_at") else "",
            row.get("locked_by") or "",
        )
        table.add_row(*(cut_text(scrub(cell), LISTED_VALUE_LENGTH, row["id"]) for cell in cells))
    if not rows:
        table.add_row("", "(no tasks)", *("" for _ in range(6)))
    console.print(table)


def print_task(console: Console, row: dict[str, Any], redactor: Redactor | None = None) -> None:
    """Every column of one task, whole: a table of the short ones, then params, result and error verbatim.

    Verbatim but for the secrets ``redactor`` knows, shown as ``***``.
    """
    if redactor is not None:
        row = {
            key: Undecodable(redactor.text(value.text))
            if isinstance(value, Undecodable)
            else redactor.value(value)
            for key, value in row.items()
        }
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


__all__ = [
    "CUT_KEY",
    "LISTED_VALUE_LENGTH",
    "cut_text",
    "human_age",
    "json_value",
    "listed_row",
    "output_console",
    "print_list",
    "print_task",
    "row_json",
    "rows_json",
    "scrubbed_row",
]
