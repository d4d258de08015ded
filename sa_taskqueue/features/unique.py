"""Unique tasks: one queued or running task per task name and unique key, kept so by the database.

The task table's unique index on ``active_unique_key`` (``<length of
name>:<name><unique key>`` while queued or running, else NULL) is what
refuses a second active task; nothing here checks before it inserts, which
two transactions could both pass.  An enqueue whose row clashes writes
nothing and returns the task that holds the key, and the caller's
transaction goes on as if the INSERT had not been tried:

- where the database can skip a clashing row in the INSERT itself
  (PostgreSQL, SQLite: ``ON CONFLICT (active_unique_key) WHERE
  active_unique_key IS NOT NULL DO NOTHING``), that is the statement;
- elsewhere (MySQL, MariaDB, Oracle) the INSERT runs inside a SAVEPOINT,
  rolled back on the duplicate-key error of that index alone.  Not ``INSERT
  IGNORE``, which would let through, as warnings, what else is wrong with a row.

Then the task holding the key is read.  It may have finished in between,
freeing the key: the INSERT is tried again, a bounded number of times.

A key comes from ``unique_key=`` at enqueue, or is derived from the params
``@queue.task(unique_by=(...))`` names (`derive_key`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Insert, Select, String, Table, cast, func, insert, literal, select
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core import validation
from sa_taskqueue.core.exceptions import DatabaseBusy
from sa_taskqueue.core.limits import ColumnLimits
from sa_taskqueue.core.notify import notify_enqueued

T = TypeVar("T")

#: How many times an enqueue tries again when the task holding its key
#: finished between the clash and the read (each time freeing the key).
INSERT_ATTEMPTS = 5

#: What a derived key longer than the column becomes: this prefix and the
#: SHA-256 of the canonical JSON, in hex.
HASHED_PREFIX = "sha256:"


def check_unique_by(unique_by: Any, func: Callable[..., Any], task_name: str) -> tuple[str, ...] | None:
    """``unique_by`` as a tuple of parameter names the function takes (None: no derived key).

    Refused at registration: a single string (a tuple of its letters is
    rarely meant), an empty sequence, a name that is not a string, a name
    twice, and a name the function cannot take as a keyword argument.
    """
    if unique_by is None:
        return None
    if isinstance(unique_by, str) or not isinstance(unique_by, Sequence | frozenset | set):
        raise TypeError(
            f"unique_by must be a tuple of parameter names, got {unique_by!r} "
            f"(for one parameter, write unique_by=({unique_by!r},))"
        )
    names = tuple(unique_by)
    if not names:
        raise ValueError("unique_by must name at least one parameter of the task function")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"unique_by must hold parameter names (strings), got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"unique_by names a parameter twice: {names!r}")
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):  # no signature to read: any keyword may fit
        return names
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return names
    keywords = {
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    unknown = [name for name in names if name not in keywords]
    if unknown:
        takes = ", ".join(sorted(keywords)) or "none"
        raise ValueError(
            f"unique_by of task {task_name!r} names {', '.join(map(repr, unknown))}, which the function "
            f"does not take as a keyword argument (it takes: {takes})"
        )
    return names


def derive_key(unique_by: tuple[str, ...], params: Mapping[str, Any], task_name: str, max_length: int) -> str:
    """The key of a task registered with ``unique_by``: the canonical JSON of those params.

    A JSON object of the named params and their values, keys sorted, no
    spaces, non-ASCII characters as they are (``{"user_id":42}``): the same
    params give the same key in every process and release.  ``1`` and
    ``1.0`` differ, as in JSON.  A key longer than the column holds is
    ``sha256:`` and the hex SHA-256 of that JSON instead.  Every param
    named must be passed: a default the function would fill in is not part
    of the params, so a missing one is refused (`ValueError`).
    """
    missing = [name for name in unique_by if name not in params]
    if missing:
        raise ValueError(
            f"params of task {task_name!r} lack {', '.join(map(repr, missing))}, which its unique_by "
            "names: pass them, so that the unique key can be derived"
        )
    canonical = json.dumps(
        {name: params[name] for name in unique_by},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    if len(canonical) <= max_length:
        return canonical
    return HASHED_PREFIX + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def key_of(
    unique_key: Any,
    unique_by: tuple[str, ...] | None,
    params: Mapping[str, Any],
    task_name: str,
    limits: ColumnLimits,
) -> str | None:
    """The unique key of one enqueue, checked: ``unique_key`` if given, else derived from ``unique_by``."""
    if unique_key is not None:
        validation.check_text("unique_key", unique_key, limits.unique_key_length)
        return str(unique_key)
    if unique_by is None:
        return None
    key = derive_key(unique_by, params, task_name, limits.unique_key_length)
    validation.check_text("unique_key", key, limits.unique_key_length)
    return key


# SQL --------------------------------------------------------------------------------


def active_key(name: str, key: str) -> ColumnElement[Any]:
    """The ``active_unique_key`` a row of this name and key holds, computed by the database.

    The generated column's own expression on the values: the database's
    ``LENGTH`` counts as it does for the column (MySQL counts bytes).
    """
    named = literal(name, String())
    return cast(func.length(named), String(10)) + literal(":", String()) + named + literal(key, String())


def index_where(table: Table) -> ColumnElement[bool]:
    """The predicate of the partial unique index (``active_unique_key IS NOT NULL``)."""
    return table.c.active_unique_key.is_not(None)


def insert_statement(
    dialect: Dialect, table: Table, values: Mapping[str, Any], model: type[Any] | None = None
) -> Insert:
    """The INSERT of one keyed task: skipping a clash where the database can, plain elsewhere.

    Returns the new id where the dialect has INSERT ... RETURNING (skipped:
    no row); where it also skips clashes, and a ``model`` is given, the new
    row as that ORM class instead, so that no read follows.
    """
    backend = backend_for(dialect)
    orm = model is not None and backend.insert_skips_conflicts and dialect.insert_returning
    into: Table | type[Any] = model if orm and model is not None else table
    statement = (
        backend.insert_skipping_conflicts(into, table.c.active_unique_key, index_where(table))
        if backend.insert_skips_conflicts
        else insert(into)
    )
    statement = statement.values(dict(values))
    if dialect.insert_returning:
        statement = statement.returning(into if orm else table.c.id)
    return statement


def holder_statement(
    dialect: Dialect, table: Table, name: str, key: str, model: type[Any] | None = None
) -> Select[Any]:
    """The queued or running task holding ``key`` for ``name``, found through the unique index.

    Its id, or the ``model`` object.
    """
    found = table.c.id if model is None else model
    statement = select(found).where(table.c.active_unique_key == active_key(name, key))
    if backend_for(dialect).snapshot_reads:
        # A locking read sees the latest committed row, not the snapshot's
        # (MySQL: LOCK IN SHARE MODE / FOR SHARE), and keeps it until commit.
        statement = statement.with_for_update(read=True)
    return statement


def index_name(table: Table) -> str:
    """The name of the unique index on ``active_unique_key`` (``ux_<table>_unique`` on TaskMixin tables)."""
    for index in table.indexes:
        if index.unique and [column.name for column in index.columns] == ["active_unique_key"]:
            return str(index.name)
    return f"ux_{table.name}_unique"


def add(session: Session, model: type[T], values: Mapping[str, Any]) -> T:
    """`TaskQueue.enqueue` of a keyed task: the new task, or the one holding its key, loaded in ``session``.

    A NOTIFY (PostgreSQL) goes with a new task only: a clash wakes nobody.
    """
    return add_or_find(session, model, values)[0]


def add_or_find(session: Session, model: type[T], values: Mapping[str, Any]) -> tuple[T, bool]:
    """`add`, and whether the task is new (False: the task holding the key, nothing written)."""
    table = _table_of(model)
    session.flush()  # what the caller added first goes first, as with a plain enqueue
    found, inserted = _insert_or_find(session, table, values, model)
    if inserted:
        notify_enqueued(session, table, {values["queue"]})
    # An id where the INSERT could not return the row (a savepoint's, MySQL's).
    task = found if isinstance(found, model) else load_task(session, model, int(found))
    return task, inserted


def add_many(session: Session, table: Table, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """`TaskQueue.enqueue_many` of keyed tasks: one id per row, in order, one task per distinct key.

    One INSERT per distinct key (each may clash on its own); a later row with
    a key an earlier row of the call took gets that row's task.
    """
    return add_many_or_find(session, table, rows)[0]


def add_many_or_find(
    session: Session, table: Table, rows: Sequence[Mapping[str, Any]]
) -> tuple[list[int], list[int]]:
    """`add_many`'s ids, and the positions of the rows written as new tasks."""
    ids: list[int] = []
    new: list[int] = []
    held: dict[str, int] = {}
    queues: set[str] = set()
    for position, row in enumerate(rows):
        key = row["unique_key"]
        if key not in held:
            held[key], inserted = insert_unique(session, table, row)
            if inserted:
                queues.add(row["queue"])
                new.append(position)
        ids.append(held[key])
    if queues:
        notify_enqueued(session, table, queues)
    return ids, new


def insert_unique(session: Session, table: Table, values: Mapping[str, Any]) -> tuple[int, bool]:
    """Insert the keyed task ``values`` in the session's transaction, unless its key is held.

    Returns the id of the new task and True, or the id of the queued or
    running task of the same name and key and False (nothing written).
    Either way the session's transaction is as usable as before.
    """
    found, inserted = _insert_or_find(session, table, values, None)
    return int(found), inserted


def _insert_or_find(
    session: Session, table: Table, values: Mapping[str, Any], model: type[Any] | None
) -> tuple[Any, bool]:
    """`insert_unique`, with the task as a ``model`` object where the statement can return it."""
    name, key = values["name"], values["unique_key"]
    # Connected first: what a MySQL dialect can do (RETURNING on MariaDB
    # 10.5+) is known only once it has met its server.
    dialect = session.connection(bind_arguments={"clause": table}).dialect
    for _ in range(INSERT_ATTEMPTS):
        inserted = _try_insert(session, table, insert_statement(dialect, table, values, model), dialect)
        if inserted is not None:
            return inserted, True
        holder = session.execute(holder_statement(dialect, table, name, key, model)).scalar_one_or_none()
        if holder is not None:
            return holder, False
        # The holder finished between the clash and the read: the key is free again.
    raise DatabaseBusy(
        f"the unique key {key!r} of task {name!r} was held and freed again {INSERT_ATTEMPTS} times "
        "while enqueueing: try again"
    )


def load_task(session: Session, model: type[T], task_id: int) -> T:
    """The task ``task_id`` as an ORM object of ``session`` (what ``enqueue`` returns).

    Where plain reads come from the transaction's snapshot (MySQL), a row
    another transaction committed since is loaded with the locking read that
    found it.
    """
    table = _table_of(model)
    dialect = session.connection(bind_arguments={"clause": table}).dialect
    locking = {"read": True} if backend_for(dialect).snapshot_reads else None
    task = session.get(model, task_id, with_for_update=locking)
    if task is None:  # written or found in this very transaction: it cannot be gone
        raise LookupError(f"task {task_id} vanished from the caller's own transaction")
    return task


def _table_of(model: type[Any]) -> Table:
    table = getattr(model, "__table__", None)
    if not isinstance(table, Table):
        raise TypeError(f"{model!r} is not a mapped task model")
    return table


def _try_insert(session: Session, table: Table, statement: Insert, dialect: Dialect) -> Any | None:
    """What ``statement`` returns of the new row (its id, or its ORM object), or None when the key is held."""
    backend = backend_for(dialect)
    if backend.insert_skips_conflicts:
        result = session.execute(statement)
        if dialect.insert_returning:
            return result.scalar_one_or_none()
        return None if result.rowcount == 0 else int(result.inserted_primary_key[0])  # type: ignore[attr-defined]
    try:
        # The duplicate key undoes the statement only, but the session must
        # not carry an error through: the savepoint is rolled back with it.
        with session.begin_nested():
            result = session.execute(statement)
            new_id = result.scalar_one() if dialect.insert_returning else result.inserted_primary_key[0]  # type: ignore[attr-defined]
    except IntegrityError as error:
        if backend.duplicate_key(error.orig, index_name(table)):
            return None
        raise
    return int(new_id)


__all__ = [
    "HASHED_PREFIX",
    "INSERT_ATTEMPTS",
    "active_key",
    "add",
    "add_many",
    "add_many_or_find",
    "add_or_find",
    "check_unique_by",
    "derive_key",
    "holder_statement",
    "index_name",
    "insert_statement",
    "insert_unique",
    "key_of",
    "load_task",
]
