"""``session.add(Task(...))`` as a way to enqueue: each row checked before the flush, workers woken at commit.

Two listeners on the `Session` class, registered when sa_taskqueue is
imported, give a task row an application adds itself what ``enqueue`` gives
its own: the same checks (`validation.check_task_row`, against the row's own
table) and, on PostgreSQL, the same NOTIFY inside the transaction.

Why session events on the class, not mapper events on `TaskMixin`:

- ``before_flush`` runs before the flush opens its transaction or sends any
  SQL.  A refused row raises there with nothing written, and the caller's
  transaction is left exactly as it was, still usable.  A mapper's
  ``before_insert`` runs inside the flush: raising there makes SQLAlchemy roll
  back the caller's whole transaction, and the session refuses all work until
  ``rollback()``.
- A listener on the `Session` class reaches every session: a `sessionmaker`'s,
  the current Session of a `scoped_session`, Flask-SQLAlchemy's subclass, and
  the Session an `AsyncSession` runs its flush in.

A refused row stays in the session as the application left it (pending, or
with its change): the next flush refuses it again, until the application
fixes the value, expunges the row or rolls back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from sqlalchemy import Engine, Insert, Table, event, inspect
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.orm import Session, UOWTransaction
from sqlalchemy.orm.state import InstanceState

from sa_taskqueue.core import at_commit
from sa_taskqueue.core.batch_members import count_flushed_finished_members, count_flushed_members
from sa_taskqueue.core.exceptions import is_missing_table, schema_missing
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.model import TaskMixin
from sa_taskqueue.core.notify import notify_enqueued
from sa_taskqueue.core.validation import CHECKED_COLUMNS, check_task_row

logger = logging.getLogger("sa_taskqueue")

#: What a new task row added without headers should carry: each hook (a tracer's) is asked in turn,
#: in ``before_flush``, and may return headers for the row (or None).  Empty unless something traces.
RowHeaders = Callable[[TaskMixin], "dict[str, str] | None"]
_row_headers: list[RowHeaders] = []


def add_row_headers(hook: RowHeaders) -> Callable[[], None]:
    """Ask ``hook`` for the headers of each new task row a flush finds without them; returns its removal.

    So a row the application adds itself, ``session.add(Task(...))``,
    carries the enqueuing code's trace context as an enqueue's rows do.
    With no hook the flush pays one list test.
    """
    _row_headers.append(hook)

    def remove() -> None:
        if hook in _row_headers:
            _row_headers.remove(hook)

    return remove


def check_task_rows(session: Session, flush_context: UOWTransaction, instances: Iterable[Any] | None) -> None:
    """``before_flush``: every new task row, and every change to a loaded one, checked before any SQL."""
    for instance in session.new:
        if isinstance(instance, TaskMixin):
            state = inspect(instance)
            values = {column: state.dict[column] for column in CHECKED_COLUMNS if column in state.dict}
            _check(instance, values, new=True)
            if _row_headers and state.dict.get("headers") is None:
                _fill_headers(instance)
    for instance in session.dirty:
        if isinstance(instance, TaskMixin):
            state = inspect(instance)
            _check(instance, _changed(state), new=False)


def _fill_headers(instance: TaskMixin) -> None:
    for hook in tuple(_row_headers):
        try:
            headers = hook(instance)
        except Exception:
            # A broken tracer must not refuse the application's row: it goes without headers.
            logger.exception("a task row's headers hook (%s) raised", getattr(hook, "__name__", hook))
            continue
        if headers:
            instance.headers = headers
            return


def notify_task_rows(session: Session, flush_context: UOWTransaction) -> None:
    """``after_flush``: a NOTIFY per queue that new task rows went to, sent in the flush's transaction.

    (``session.new`` still lists what this flush inserted.)
    """
    queues: dict[Table, set[str]] = {}
    for instance in session.new:
        if isinstance(instance, TaskMixin):
            table = _table(type(instance))
            # A queue only the INSERT knew: "" wakes the workers of every queue to look now.
            queues.setdefault(table, set()).add(_queue_of(instance, table) or "")
    for table, names in queues.items():
        notify_enqueued(session, table, names)


def missing_task_table(context: ExceptionContext) -> None:
    """``handle_error``: an INSERT into a task table that is not there raises `SchemaMissing`.

    A flush that writes an added task row (``session.add(Task(...))``, then
    ``commit``) raises from inside SQLAlchemy, past any code of ours; this
    engine event is the one place such an error passes through, for every
    engine, before it reaches the application.  SQLAlchemy keeps the driver's
    error as the cause.  Any other statement's error, and any INSERT's that
    is not about a missing task table, passes unchanged; the check costs
    nothing until a statement fails.
    """
    compiled = getattr(context.execution_context, "compiled", None)
    statement = getattr(compiled, "statement", None)
    if not isinstance(statement, Insert) or not isinstance(statement.table, Table):
        return
    table = statement.table
    if context.engine is None or not _is_task_table(table):
        return
    error = context.sqlalchemy_exception or context.original_exception
    if is_missing_table(error, context.engine, table):
        raise schema_missing(table)


def _is_task_table(table: Table) -> bool:
    """Whether a `TaskMixin` model is mapped to ``table``."""
    pending: list[type[Any]] = [TaskMixin]
    while pending:
        model = pending.pop()
        if getattr(model, "__table__", None) is table:
            return True
        pending.extend(model.__subclasses__())
    return False


def _check(instance: TaskMixin, values: dict[str, Any], *, new: bool) -> None:
    try:
        stored = check_task_row(values, _limits(_table(type(instance))), new=new)
    except (TypeError, ValueError) as error:
        # Which row, when one flush carries many: the error's own type and text, then the row.
        raise type(error)(f"{error} (in {_describe(instance, new=new)})") from None
    for column, value in stored.items():  # params with datetimes, Decimals, ...: stored as their JSON
        setattr(instance, column, value)


def _changed(state: InstanceState[Any]) -> dict[str, Any]:
    """The checked columns a loaded row's pending change sets, with their new values."""
    changed: dict[str, Any] = {}
    attributes = state.attrs
    for column in CHECKED_COLUMNS:
        if column in attributes:  # (a model of one's own may map fewer columns)
            history = attributes[column].history
            if history.added:
                changed[column] = history.added[0]
    return changed


def _queue_of(instance: TaskMixin, table: Table) -> str | None:
    """The queue a new row went to, if known without a SELECT: its own, or the column's default.

    None when only the INSERT knew it (a server default not read back, a
    default computed by a function): reading the attribute would load it
    with one SELECT per row, inside the flush.
    """
    queue = inspect(instance).dict.get("queue")
    if isinstance(queue, str):
        return queue
    default = table.c.queue.default
    if default is not None and default.is_scalar:
        return str(getattr(default, "arg", ""))
    return None


@cache
def _limits(table: Table) -> ColumnLimits:
    return ColumnLimits.of(table)


def _table(model: type[TaskMixin]) -> Table:
    table = getattr(model, "__table__", None)
    if not isinstance(table, Table):
        raise TypeError(f"{model.__name__} is a TaskMixin but not mapped to a table")
    return table


def _describe(instance: TaskMixin, *, new: bool) -> str:
    name = inspect(instance).dict.get("name")
    what = f"{'a new' if new else 'a changed'} {type(instance).__name__} row"
    if isinstance(name, str) and len(name) <= 80:
        return f"{what} named {name!r}"
    return what


def listen() -> None:
    """Register the listeners on the `Session` class, these and `at_commit`'s (once: repeats are ignored)."""
    if not event.contains(Session, "before_flush", check_task_rows):
        event.listen(Session, "before_flush", check_task_rows)
    # After the dependencies' own listener (registered when the queue's modules are imported, before
    # this runs): a dependent refused for a missing parent is refused before its batch counts it.
    if not event.contains(Session, "before_flush", count_flushed_members):
        event.listen(Session, "before_flush", count_flushed_members)
    if not event.contains(Session, "after_flush", count_flushed_finished_members):
        event.listen(Session, "after_flush", count_flushed_finished_members)
    if not event.contains(Session, "after_flush", notify_task_rows):
        event.listen(Session, "after_flush", notify_task_rows)
    if not event.contains(Engine, "handle_error", missing_task_table):
        event.listen(Engine, "handle_error", missing_task_table)
    at_commit.listen()


__all__ = [
    "RowHeaders",
    "add_row_headers",
    "check_task_rows",
    "listen",
    "missing_task_table",
    "notify_task_rows",
]
