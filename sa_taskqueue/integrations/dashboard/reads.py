"""What the dashboard reads from the task table: plain SELECTs, each cheap on a table of millions of rows.

Nothing here writes: every action goes through the queue's own methods
(`TaskQueue.cancel`, `Admin.retry`, ...).  Each function takes the sync
engine and the table, and runs where the queue says its engine may be used
(`TaskQueue.run_sync`).

The table's indexes decide the shape of each query:

- the task list walks the primary key backwards (``WHERE id < :before
  ORDER BY id DESC LIMIT n``), so a page costs its rows whatever the table
  holds; a filter no index serves (a name, a queue, a text search) is
  applied within a bounded id window, so a search that finds little stops
  after `SCAN_WINDOW` ids and offers to search further back;
- the throughput chart reads ``(status, finished_at)``, the index retention
  deletes by, over the last hour only;
- the counts per queue and status are `Admin.status`, as ``sa-taskqueue
  status`` shows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, Table, Text, case, cast, func, literal, or_, select

from sa_taskqueue.core.model import TaskStatus, has_status

#: How many tasks one page of the task list shows.
PAGE_SIZE = 50
#: How many ids one page of a filtered list searches at most before it stops and offers "older".
SCAN_WINDOW = 100_000
#: The chart's span and its bars.
CHART_MINUTES = 60


@dataclass
class QueueRow:
    """One queue on the overview."""

    name: str
    counts: dict[str, int]
    paused: bool
    oldest_due: timedelta | None


@dataclass
class Throughput:
    """Tasks finished per minute over the last hour, oldest minute first."""

    start: datetime
    completed: list[int]
    failed: list[int]


@dataclass
class TaskFilters:
    """The task list's filters, as the form gives them (None: not filtered)."""

    queue: str | None = None
    name: str | None = None
    status: TaskStatus | None = None
    since: datetime | None = None
    until: datetime | None = None
    q: str | None = None
    #: The members of one batch: the ``batch_id`` index finds them, so no id window is needed for it alone.
    batch: int | None = None

    @property
    def any(self) -> bool:
        return any(value is not None for value in vars(self).values())

    @property
    def unindexed(self) -> bool:
        """Whether a filter no index serves is set: then the walk is bounded to a window of ids."""
        return any(value is not None for key, value in vars(self).items() if key != "batch")


@dataclass
class TaskPage:
    """One page of the task list, newest first, and where the next one starts."""

    rows: list[dict[str, Any]]
    #: The ``before`` of the next page (None: this is the last page).
    next_before: int | None
    #: The lowest id searched when the page stopped at its scan window (then ``rows`` may be short).
    searched_down_to: int | None = None


def queue_rows(
    engine: Engine, table: Table, counts: dict[str, dict[str, int]], paused: frozenset[str], now: datetime
) -> list[QueueRow]:
    """Each queue with tasks or paused: its counts, whether it is paused, its oldest due task's wait.

    The oldest due task per queue reads the queued rows only (the claim
    index leads with the status, and holds nothing else where partial
    indexes exist).
    """
    with engine.connect() as conn:
        oldest = dict(
            conn.execute(
                select(table.c.queue, func.min(table.c.run_at))
                .where(has_status(table, TaskStatus.QUEUED), table.c.run_at <= now)
                .group_by(table.c.queue)
            ).all()
        )
    names = sorted(set(counts) | set(paused))
    return [
        QueueRow(
            name=name,
            counts={status.value: counts.get(name, {}).get(status.value, 0) for status in TaskStatus},
            paused=name in paused,
            oldest_due=None if oldest.get(name) is None else max(now - oldest[name], timedelta(0)),
        )
        for name in names
    ]


def throughput(engine: Engine, table: Table, now: datetime) -> Throughput:
    """Completed and failed tasks per minute over the last `CHART_MINUTES` minutes, by ``finished_at``.

    One query per status (its literal lets the partial index serve it),
    counted by the database, so no row leaves it: the minute of each row is
    a CASE over the minute boundaries, nested as a binary search (six tests a
    row, not up to sixty); the ``(status, finished_at)`` index serves the range.
    """
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=CHART_MINUTES)
    minute = _minute_of(table.c.finished_at, start, 0, CHART_MINUTES).label("minute")
    completed = [0] * CHART_MINUTES
    failed = [0] * CHART_MINUTES
    with engine.connect() as conn:
        for status in (TaskStatus.COMPLETED, TaskStatus.FAILED):
            into = completed if status is TaskStatus.COMPLETED else failed
            rows = conn.execute(
                select(minute, func.count())
                .where(has_status(table, status), table.c.finished_at >= start, table.c.finished_at < end)
                .group_by(minute)
            )
            for index, count in rows:
                into[int(index)] = int(count)
    return Throughput(start=start, completed=completed, failed=failed)


def _minute_of(column: Any, start: datetime, low: int, high: int) -> Any:
    """The minute ``low <= m < high`` after ``start`` that ``column`` falls in, as nested CASEs."""
    if high - low == 1:
        return literal(low)
    middle = (low + high) // 2
    return case(
        (column < start + timedelta(minutes=middle), _minute_of(column, start, low, middle)),
        else_=_minute_of(column, start, middle, high),
    )


def task_page(
    engine: Engine, table: Table, filters: TaskFilters, before: int | None, *, limit: int = PAGE_SIZE
) -> TaskPage:
    """Up to ``limit`` tasks with ids below ``before``, newest first, matching ``filters``.

    Unfiltered, the primary key is walked backwards and the page costs its
    rows.  Filtered, the walk is bounded to `SCAN_WINDOW` ids below
    ``before``: a filter that matches few rows returns what the window
    holds, and the next page continues below it.
    """
    columns = [
        column for column in table.c if column.name not in ("params", "result", "last_error", "headers")
    ]
    query = select(*columns)
    window_floor: int | None = None
    with engine.connect() as conn:
        if before is None:
            before = (conn.scalar(select(func.max(table.c.id))) or 0) + 1
        if filters.unindexed:
            window_floor = max(before - SCAN_WINDOW, 0)
            query = query.where(table.c.id >= window_floor)
        query = query.where(table.c.id < before)
        if filters.queue is not None:
            query = query.where(table.c.queue == filters.queue)
        if filters.name is not None:
            query = query.where(table.c.name == filters.name)
        if filters.status is not None:
            query = query.where(table.c.status == filters.status)
        if filters.since is not None:
            query = query.where(table.c.created_at >= filters.since)
        if filters.until is not None:
            query = query.where(table.c.created_at < filters.until)
        if filters.batch is not None:
            query = query.where(table.c.batch_id == filters.batch)
        if filters.q is not None:
            # The stored JSON as text (a real CAST: PostgreSQL's jsonb has no LIKE), and the error text.
            query = query.where(
                or_(
                    cast(table.c.params, Text()).icontains(filters.q, autoescape=True),
                    table.c.last_error.icontains(filters.q, autoescape=True),
                )
            )
        rows = [row._asdict() for row in conn.execute(query.order_by(table.c.id.desc()).limit(limit + 1))]
        lowest = conn.scalar(select(func.min(table.c.id))) if window_floor is not None else None
    more = len(rows) > limit
    rows = rows[:limit]
    if more:
        return TaskPage(rows=rows, next_before=rows[-1]["id"])
    if window_floor is not None and lowest is not None and window_floor > lowest:
        # The window ended before the page filled: older ids were not searched yet.
        return TaskPage(rows=rows, next_before=window_floor, searched_down_to=window_floor)
    return TaskPage(rows=rows, next_before=None)
