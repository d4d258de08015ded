"""NOTIFY when tasks finish, so that a caller waiting for a result wakes at once on PostgreSQL.

The notification is sent inside the transaction that writes the final
status, so it reaches listeners when, and only if, that write commits.  The
payload is the finished ids, comma-separated, in as many notifications as
PostgreSQL's payload limit needs.  Like the enqueue channel, it is a hint
only: a waiter reads the row itself, and keeps polling in case a
notification is lost.  Other dialects have no channel; their waiters poll.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, Select, Table, Text, Update, case, cast, func, literal, select

from sa_taskqueue.backends import backend_for

#: Below PostgreSQL's 8,000-byte payload limit, with room to spare.
PAYLOAD_BYTES = 7000


def finished_channel_name(table: Table) -> str:
    """The channel on which the ids of one task table's finished tasks are announced."""
    return f"sa_taskqueue_fin_{table.name}"[:63]


def notify_finished(conn: Connection, table: Table, task_ids: Iterable[int]) -> None:
    """Within ``conn``'s open transaction: announce ``task_ids`` as finished when it commits."""
    if not backend_for(conn.dialect).notify:
        return
    channel = finished_channel_name(table)
    for payload in finished_payloads(task_ids):
        conn.execute(select(func.pg_notify(channel, payload)))


def announcing(statement: Update, table: Table) -> Select[Any]:
    """``statement`` (an UPDATE writing a final status) as one that also announces the ids it wrote.

    For PostgreSQL, where the hot writes run in autocommit: a second
    statement, or a BEGIN and COMMIT around the two, would cost round trips
    on every completion, where this costs none.  The UPDATE runs in a CTE
    returning the ids; the SELECT around it sends them in one ``pg_notify``,
    and only if there are any.  It returns one row: the ids written,
    comma-separated (None if none), as `announced_ids` reads them.  The
    payload stays under the limit while a statement writes at most a few
    hundred rows (`COMPLETE_MANY_CHUNK` is 100).
    """
    written = statement.returning(table.c.id).cte("finished_rows")
    ids = func.string_agg(cast(written.c.id, Text), literal(","))
    notify = func.pg_notify(literal(finished_channel_name(table)), ids)
    return select(ids.label("finished_ids"), case((func.count() > 0, notify))).select_from(written)


def announced_ids(text: str | None) -> set[int]:
    """The ids an `announcing` statement's row names."""
    return set() if not text else {int(part) for part in text.split(",")}


def finished_payloads(task_ids: Iterable[int]) -> list[str]:
    """``task_ids`` as comma-separated payloads, each under `PAYLOAD_BYTES`."""
    payloads: list[str] = []
    current: list[str] = []
    size = 0
    for task_id in sorted(set(task_ids)):
        text = str(task_id)
        if current and size + len(text) + 1 > PAYLOAD_BYTES:
            payloads.append(",".join(current))
            current, size = [], 0
        current.append(text)
        size += len(text) + 1
    if current:
        payloads.append(",".join(current))
    return payloads


__all__ = ["announced_ids", "announcing", "finished_channel_name", "finished_payloads", "notify_finished"]
