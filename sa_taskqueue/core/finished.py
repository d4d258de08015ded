"""NOTIFY when tasks finish, so that a caller waiting for a result wakes at once on PostgreSQL.

The notification is sent inside the transaction that writes the final
status, so it reaches listeners when, and only if, that write commits.  The
payload is the finished ids, comma-separated, in as many notifications as
PostgreSQL's payload limit needs.  Like the enqueue channel, it is a hint
only: a waiter reads the row itself, and keeps polling in case a
notification is lost.  Other dialects have no channel; their waiters poll.

The hot writes (completions, failures) announce only the tasks someone
waits for (`announcing`); `notify_finished`, for the rare ones (cancels,
lease recovery), announces every id it is given.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    Boolean,
    Connection,
    Integer,
    Select,
    Table,
    Text,
    Update,
    case,
    cast,
    func,
    literal,
    not_,
    select,
)

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.model import TaskStatus

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


def wait_namespace(table: Table) -> int:
    """The first key of the advisory locks by which waiters of this table's tasks say they wait (an int4)."""
    value = zlib.crc32(f"sa_taskqueue_wait:{table.name}".encode())
    return value - 0x1_0000_0000 if value >= 0x8000_0000 else value


def wait_key(task_id: int) -> int:
    """The second key of the lock of a task's waiters: its id's low 31 bits.

    Ids sharing one cost a needless NOTIFY at most.
    """
    return task_id % WAIT_KEYS


#: How many second keys there are: an int4 holds 2**31 non-negative values.
WAIT_KEYS = 2**31


def announcing(statement: Update, table: Table) -> Select[Any]:
    """``statement`` (an UPDATE writing a final status) as one that also announces the waited ids it wrote.

    (A worker's batch of failures may queue some of its tasks again to
    retry: they are announced too, and their waiters read the row and wait on.)

    For PostgreSQL, where the hot writes run in autocommit: a second
    statement, or a BEGIN and COMMIT around the two, would cost round trips
    on every completion, where this costs none.  The UPDATE runs in a CTE
    returning the ids; the SELECT around it sends, in one ``pg_notify``, the
    ids someone waits for, and sends nothing when nobody waits.

    Nobody waiting is the common case, and a NOTIFY is not free: PostgreSQL
    serialises the commits of every transaction that sent one, on a lock
    held through the commit's flush.  A waiter holds a shared advisory lock
    on its task (`wait_namespace`, `wait_key`) before it reads the row; here
    each row written tries the exclusive one for the statement's
    transaction.  Not getting it means a waiter holds it: that id is
    announced.  Getting it means nobody waits now, and a waiter arriving
    later blocks on it until this commits, then reads the finished row.

    It returns one row: every id written, comma-separated (None if none), as
    `announced_ids` reads them.  The payload stays under the limit while a
    statement writes at most a few hundred rows (`COMPLETE_MANY_CHUNK` is 100).
    """
    written = statement.returning(table.c.id).cte("finished_rows")
    key = cast(written.c.id % literal(WAIT_KEYS), Integer)
    free = func.pg_try_advisory_xact_lock(literal(wait_namespace(table)), key, type_=Boolean)
    checked = select(written.c.id, not_(free).label("waited")).cte("checked_rows")
    ids = func.string_agg(cast(checked.c.id, Text), literal(","))
    waited_ids = func.string_agg(cast(checked.c.id, Text), literal(",")).filter(checked.c.waited)
    notify = func.pg_notify(literal(finished_channel_name(table)), waited_ids)
    announce = case((func.bool_or(checked.c.waited), notify))
    return select(ids.label("finished_ids"), announce).select_from(checked)


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


class FinishedTask(NamedTuple):
    """A task whose final status (completed, failed, cancelled) a transaction has just written.

    What the workflow bookkeeping needs of it, in that same transaction:
    the batch it belongs to, and whether tasks depend on it (None: not
    known, looked up).
    """

    id: int
    status: TaskStatus
    batch_id: int | None = None
    has_dependents: bool | None = None


#: Called in the transaction that wrote final statuses, with those tasks and
#: the time written (`sa_taskqueue.features.workflows.bookkeeping.after_final`).
AfterFinal = Callable[[Connection, Table, Sequence[FinishedTask], datetime], None]


__all__ = [
    "WAIT_KEYS",
    "AfterFinal",
    "FinishedTask",
    "announced_ids",
    "announcing",
    "finished_channel_name",
    "finished_payloads",
    "notify_finished",
    "wait_key",
    "wait_namespace",
]
