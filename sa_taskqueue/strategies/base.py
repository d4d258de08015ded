"""The claim-strategy contract, and the lease bookkeeping every strategy shares.

A strategy knows one way of handing a due task to exactly one worker.  The
queue is its only caller; it passes the engine, the task table and a
`ClaimRequest`, and gets plain rows back.  Everything here is Core SQL on the
table, so one strategy serves `Task` and any application table mapped with
`TaskMixin` alike.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar

from sqlalchemy import (
    BindParameter,
    ClauseElement,
    ColumnElement,
    Connection,
    Engine,
    Integer,
    Select,
    Table,
    and_,
    bindparam,
    case,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Dialect

from sa_taskqueue.claimed import ClaimedTask
from sa_taskqueue.model import TaskStatus, has_status
from sa_taskqueue.strategies.kept_connection import KeptConnection
from sa_taskqueue.strategies.prepared import PreparedStatement
from sa_taskqueue.types import UTCDateTime

LEASE_EXPIRED_ERROR = "lease expired: the worker holding this task stopped renewing it (crashed or lost)"


@dataclass(frozen=True)
class ClaimRequest:
    """What a claim asks for: how many tasks, from which queues, for whom, and until when."""

    limit: int
    queues: tuple[str, ...] | None
    worker_id: str
    now: datetime
    lease_until: datetime

    def params(self) -> dict[str, Any]:
        """The values of the bound parameters that `due_clause` and `claimed_values` leave open."""
        params: dict[str, Any] = {
            LIMIT: self.limit,
            NOW: self.now,
            WORKER: self.worker_id,
            LEASE_UNTIL: self.lease_until,
        }
        if self.queues is not None:
            params.update(zip(queue_params(len(self.queues)), self.queues, strict=True))
        return params

    @property
    def shape(self) -> tuple[int | None]:
        """What changes the claim statement's SQL (not just its parameters): how many queues it names."""
        return (len(self.queues) if self.queues is not None else None,)


# Claim statements are built once per shape and run with these parameters:
# building SQLAlchemy constructs costs more per claim than a round trip does.
# (Not column names: those are taken by the SET clause's own parameters.)
LIMIT = "claim_limit"
NOW = "claim_now"
WORKER = "claim_worker"
LEASE_UNTIL = "claim_lease_until"
QUEUES = "claim_queue"


def queue_params(count: int) -> list[str]:
    """The parameters holding a claim's queue names: one per name, so that the SQL is fixed per count."""
    return [f"{QUEUES}_{index}" for index in range(count)]


class ClaimStrategy(ABC):
    """How workers take tasks without two of them ever holding the same one.

    Each method runs its own short transaction on connections from the given
    engine and never touches an application's session.
    """

    #: The registered name (``"skip_locked"``, ``"conditional_update"``, ``"advisory_lock"``).
    name: ClassVar[str]

    @classmethod
    def unsupported_reason(cls, dialect: Dialect) -> str | None:
        """Why this strategy cannot run on ``dialect``, or None when it can.

        Called before the first connect, so only ``dialect.name`` is reliable;
        version checks belong in `check_server`.
        """
        return None

    def check_server(self, dialect: Dialect) -> None:
        """Raise `StrategyError` if the connected server's version cannot run this strategy."""

    def recovery_interval(self, lease: timedelta) -> timedelta:
        """How often the queue looks for tasks of workers that are gone.

        A lease-based strategy can only act once a lease has run out, so a
        quarter of the lease (at most ten seconds) keeps recovery prompt
        without a query on every claim.
        """
        return min(lease / 4, timedelta(seconds=10))

    def prepare(self, engine: Engine) -> None:
        """Set up ``engine`` once before the first claim (connection settings the strategy relies on)."""

    @abstractmethod
    def claim(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        """Mark up to ``request.limit`` due queued tasks RUNNING for ``request.worker_id`` and commit.

        Returns the claimed rows as they are after the claim (status running,
        attempts incremented, started_at, locked_by and locked_until set), in
        any order, each with at least the `READ_BACK` columns and those.  No
        row is returned to two concurrent callers.
        """

    def finding_statement(self, dialect: Dialect, table: Table, request: ClaimRequest) -> Any:
        """The statement whose plan decides how fast a claim finds its rows (what EXPLAIN should see).

        Its parameters are `ClaimRequest.params`.
        """
        return due_select(table, request, table.c.id).limit(limit_param())

    def finish(
        self, engine: Engine, table: Table, task: ClaimedTask, values: Mapping[str, Any], now: datetime
    ) -> bool:
        """Write ``values`` to the task if ``task``'s claim still holds it; True if it did.

        Used for every transition out of RUNNING (completed, failed, retried,
        given back), so one ownership test guards them all.
        """
        with self.single_statement(engine) as conn:
            return self.write_if_held(conn, table, task, values, now)

    def write_if_held(
        self, conn: Connection, table: Table, task: ClaimedTask, values: Mapping[str, Any], now: datetime
    ) -> bool:
        """Run the guarded UPDATE of `finish_statement` on ``conn``; True if it wrote the row."""
        statement, params = self.finish_statement(table, task, values, now, conn.dialect)
        if isinstance(statement, PreparedStatement):
            return statement.execute(conn, params).rowcount == 1
        return conn.execute(statement, params).rowcount == 1

    def complete_many(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
    ) -> set[int]:
        """Mark each task still held COMPLETED with its result, in one statement; return the ids written.

        The guard of the lease strategies, row by row: a task whose claim no
        longer holds it is left alone and its id not returned.  A strategy
        that says otherwise who holds a task (its own `holds`) overrides this
        too, as the advisory-lock one does.  At most
        `COMPLETE_MANY_CHUNK` tasks go in one statement (SQLite limits how deep
        an expression may nest).
        """
        if len(tasks) > COMPLETE_MANY_CHUNK:
            done: set[int] = set()
            for start in range(0, len(tasks), COMPLETE_MANY_CHUNK):
                chunk = slice(start, start + COMPLETE_MANY_CHUNK)
                done |= self.complete_many(engine, table, tasks[chunk], results[chunk], now)
            return done
        count = len(tasks)
        with_results = any(result is not None for result in results)
        dialect = engine.dialect
        statement = self.prepared(
            ("complete_many", count, with_results),
            dialect,
            table,
            lambda: complete_many_statement(table, count, with_results, returning=dialect.update_returning),
        )
        params: dict[str, Any] = {HELD_NOW: now, "finished_now": now}
        for index, (task, result) in enumerate(zip(tasks, results, strict=True)):
            params.update(
                {
                    f"{HELD_ID}_{index}": task.id,
                    f"{HELD_BY}_{index}": task.locked_by,
                    f"{HELD_ATTEMPTS}_{index}": task.attempts,
                    f"{HELD_STARTED_AT}_{index}": task.started_at,
                }
            )
            if with_results:
                params[f"result_{index}"] = result
        with self.single_statement(engine) as conn:
            result_rows = statement.execute(conn, params)
            if dialect.update_returning:
                return {row[0] for row in result_rows}
            if result_rows.rowcount == count:
                return {task.id for task in tasks}
            # Without RETURNING, and some rows not ours any more: the rows
            # this statement wrote are those completed at exactly ``now``.
            written = conn.execute(
                select(table.c.id).where(
                    table.c.id.in_([task.id for task in tasks]),
                    has_status(table, TaskStatus.COMPLETED),
                    table.c.finished_at == now,
                )
            )
            return set(written.scalars())

    def finish_statement(
        self, table: Table, task: ClaimedTask, values: Mapping[str, Any], now: datetime, dialect: Dialect
    ) -> tuple[Any, dict[str, Any]]:
        """The guarded UPDATE writing ``values`` to ``task``'s row, and its parameters.

        A `PreparedStatement` for the usual values, a construct when they hold
        SQL (release's ``attempts - 1``: rare, built each time).
        """
        params = held_params(task, now)
        if any(isinstance(value, ClauseElement) for value in values.values()):
            return update(table).where(self.holds(table)).values(**values), params
        names = tuple(sorted(values))
        statement = self.prepared(
            ("finish", names),
            dialect,
            table,
            lambda: (
                update(table)
                .where(self.holds(table))
                .values({name: bindparam(f"set_{name}", type_=table.c[name].type) for name in names})
            ),
        )
        params.update({f"set_{name}": value for name, value in values.items()})
        return statement, params

    def extend(
        self, engine: Engine, table: Table, tasks: Sequence[ClaimedTask], until: datetime, now: datetime
    ) -> set[int]:
        """Move the lease of each still-held task in ``tasks`` to ``until``; return the ids extended."""
        extend = self.prepared(
            ("extend",),
            engine.dialect,
            table,
            lambda: (
                update(table)
                .where(self.holds(table))
                .values(locked_until=bindparam("new_lease_until", type_=table.c.locked_until.type))
            ),
        )
        extended: set[int] = set()
        with self.transaction(engine) as conn:
            for task in tasks:
                result = extend.execute(conn, {**held_params(task, now), "new_lease_until": until})
                if result.rowcount == 1:
                    extended.add(task.id)
        return extended

    def holds(self, table: Table) -> ColumnElement[bool]:
        """The condition under which a claim still owns its row: same claim, lease not over.

        Its values come from `held_params`.
        """
        return and_(
            same_claim(table), table.c.locked_until > bindparam(HELD_NOW, type_=table.c.locked_until.type)
        )

    def recover(self, engine: Engine, table: Table, now: datetime) -> int:
        """Give back tasks whose worker is gone; return how many.

        Here that means running tasks whose lease ended before ``now``: they go
        back to QUEUED, or to FAILED when they have used all their attempts
        (the lost run counted as one).
        """
        with self.transaction(engine) as conn:
            expired = select(table.c.id).where(
                has_status(table, TaskStatus.RUNNING), table.c.locked_until < now
            )
            ids = list(conn.scalars(self.lock_rows(conn, expired)))
            if not ids:
                return 0
            result = conn.execute(
                update(table)
                .where(
                    table.c.id.in_(ids),
                    has_status(table, TaskStatus.RUNNING),
                    table.c.locked_until < now,
                )
                .values(**orphan_values(table, now, LEASE_EXPIRED_ERROR))
            )
            return result.rowcount

    def lock_rows(self, conn: Connection, query: Any) -> Any:
        """Turn a SELECT of rows this transaction will update into one safe to run concurrently."""
        return query

    def prepared(
        self, name: tuple[Any, ...], dialect: Dialect, table: Table, build: Callable[[], Any]
    ) -> PreparedStatement:
        """The statement ``name`` for this table, compiled for ``dialect`` on first use and kept."""
        cache: dict[tuple[Any, ...], PreparedStatement] = self.__dict__.setdefault("_prepared", {})
        key = (*name, table, dialect)
        found = cache.get(key)
        if found is None:
            found = cache[key] = PreparedStatement(build(), dialect, table)
        return found

    def claim_statement(
        self, name: str, dialect: Dialect, table: Table, request: ClaimRequest, build: Callable[[], Any]
    ) -> PreparedStatement:
        """The claim statement ``name`` for this table and request shape, prepared on first use."""
        return self.prepared((name, request.shape), dialect, table, build)

    def kept_connection(self, engine: Engine, *, autocommit: bool) -> KeptConnection:
        """The connection this strategy keeps for ``engine``'s hot statements, in either mode."""
        kept: dict[tuple[Engine, bool], KeptConnection] = self.__dict__.setdefault("_kept", {})
        found = kept.get((engine, autocommit))
        if found is None:
            with _KEPT_MUTEX:
                found = kept.setdefault((engine, autocommit), KeptConnection(engine, autocommit=autocommit))
        return found

    @contextmanager
    def transaction(self, engine: Engine) -> Iterator[Connection]:
        """A connection in a transaction that commits on success and rolls back on error.

        Where claims run in transactions (MySQL, MariaDB, Oracle) that is the
        kept connection; on PostgreSQL and SQLite, whose claims and
        completions run in autocommit, transactions are rare and pooled.
        """
        if engine.dialect.name in AUTOCOMMIT_DIALECTS:
            with engine.begin() as conn:
                yield conn
            return
        with self.kept_connection(engine, autocommit=False).lend() as conn:
            yield conn

    @contextmanager
    def single_statement(self, engine: Engine) -> Iterator[Connection]:
        """The kept connection, for one statement that is atomic on its own (a claim, a completion).

        On PostgreSQL and SQLite it is in autocommit.  PostgreSQL drivers send
        BEGIN and COMMIT as round trips of their own, which would triple the
        cost of every claim and completion, while switching them to autocommit
        is a client-side flag.  An SQLite UPDATE in autocommit mode takes the
        write lock before it reads (waiting out the busy timeout), so it needs
        no BEGIN IMMEDIATE around it.  MySQL drivers pay a round trip to switch
        autocommit, so there it is a plain transaction (UPDATE by primary key
        takes no gap locks, so no isolation level needs setting for it).
        """
        autocommit = engine.dialect.name in AUTOCOMMIT_DIALECTS
        with self.kept_connection(engine, autocommit=autocommit).lend() as conn:
            yield conn

    def close(self) -> None:
        """Release whatever the strategy holds: its kept connections (and, in some, locks)."""
        for kept in list(self.__dict__.get("_kept", {}).values()):
            kept.close()


#: The most tasks `ClaimStrategy.complete_many` writes in one statement.
COMPLETE_MANY_CHUNK = 100

#: Dialects whose single-statement claims and completions run in autocommit.
AUTOCOMMIT_DIALECTS = ("postgresql", "sqlite")
_KEPT_MUTEX = threading.Lock()

HELD_ID = "held_id"
HELD_BY = "held_by"
HELD_ATTEMPTS = "held_attempts"
HELD_STARTED_AT = "held_started_at"
HELD_NOW = "held_now"


def same_claim(table: Table) -> ColumnElement[bool]:
    """The row is still running under the claim bound by `held_params`.

    Worker id and attempt alone repeat when a task is given back unrun and
    claimed again by the same worker; the claim's start time does not.
    """
    return and_(claim_identity(table), has_status(table, TaskStatus.RUNNING))


def claim_identity(table: Table, suffix: str = "") -> ColumnElement[bool]:
    """Id, worker, attempt and start time as bound by `held_params` (names ending in ``suffix``)."""

    def held(name: str, column: str) -> BindParameter[Any]:
        return bindparam(f"{name}{suffix}", type_=table.c[column].type)

    return and_(
        table.c.id == held(HELD_ID, "id"),
        table.c.locked_by == held(HELD_BY, "locked_by"),
        table.c.attempts == held(HELD_ATTEMPTS, "attempts"),
        table.c.started_at == held(HELD_STARTED_AT, "started_at"),
    )


def complete_many_statement(table: Table, count: int, with_results: bool, *, returning: bool) -> Any:
    """The UPDATE completing ``count`` held tasks at once, each under its own `same_claim` test.

    Its parameters are `held_params` names suffixed ``_0`` .. ``_{count-1}``,
    ``held_now``, ``finished_now`` and, ``with_results``, ``result_0`` ...
    """

    def param(name: str, index: int, column: str) -> BindParameter[Any]:
        return bindparam(f"{name}_{index}", type_=table.c[column].type)

    held = or_(*(claim_identity(table, f"_{index}") for index in range(count)))
    result: Any = None
    if with_results:
        result = case(
            *(
                (table.c.id == param(HELD_ID, index, "id"), param("result", index, "result"))
                for index in range(count)
            ),
            else_=None,
        )
    statement = (
        update(table)
        .where(
            has_status(table, TaskStatus.RUNNING),
            table.c.locked_until > bindparam(HELD_NOW, type_=table.c.locked_until.type),
            held,
        )
        .values(
            status=TaskStatus.COMPLETED,
            finished_at=bindparam("finished_now", type_=table.c.finished_at.type),
            locked_until=None,
            result=result,
        )
    )
    return statement.returning(table.c.id) if returning else statement


def held_params(task: ClaimedTask, now: datetime) -> dict[str, Any]:
    """The values for `same_claim` and `ClaimStrategy.holds`: which claim, and the time now."""
    return {
        HELD_ID: task.id,
        HELD_BY: task.locked_by,
        HELD_ATTEMPTS: task.attempts,
        HELD_STARTED_AT: task.started_at,
        HELD_NOW: now,
    }


def due_clause(table: Table, request: ClaimRequest) -> ColumnElement[bool]:
    """Queued, due, and (when asked) in one of the requested queues; values from `ClaimRequest.params`."""
    clause = and_(
        has_status(table, TaskStatus.QUEUED),
        table.c.run_at <= bindparam(NOW, type_=table.c.run_at.type),
    )
    if request.queues is not None:
        names = queue_params(len(request.queues))
        clause = and_(
            clause, table.c.queue.in_([bindparam(name, type_=table.c.queue.type) for name in names])
        )
    return clause


def due_select(table: Table, request: ClaimRequest, *columns: Any) -> Select[Any]:
    """Due rows in claim order: what every strategy reads to find work (it adds the limit and locks)."""
    return select(*columns).where(due_clause(table, request)).order_by(*claim_order(table))


def limit_param() -> BindParameter[int]:
    """The claim's row limit, bound at execution."""
    return bindparam(LIMIT, type_=Integer())


def claim_order(table: Table) -> tuple[Any, ...]:
    """Smaller priority first, then earlier run_at, then older id: the order the claim index holds."""
    return (table.c.priority, table.c.run_at, table.c.id)


def claimed_values(table: Table, request: ClaimRequest) -> dict[str, Any]:
    """The columns a claim sets, as SQL (attempts is incremented in the database)."""
    return {
        "status": TaskStatus.RUNNING,
        "attempts": table.c.attempts + 1,
        "started_at": bindparam(NOW, type_=table.c.started_at.type),
        "locked_by": bindparam(WORKER, type_=table.c.locked_by.type),
        "locked_until": bindparam(LEASE_UNTIL, type_=table.c.locked_until.type),
    }


#: The columns a claim reads back of each row it takes.  The rest of a claimed
#: task is what the claim itself wrote, known without asking; and each column
#: read costs the driver and SQLAlchemy a few microseconds a row.
READ_BACK = ("id", "name", "queue", "priority", "params", "attempts", "max_attempts", "run_at", "created_at")


def read_back(table: Table) -> list[Any]:
    """The `READ_BACK` columns of ``table``."""
    return [table.c[name] for name in READ_BACK]


def claimed_row(row: Mapping[str, Any], request: ClaimRequest) -> dict[str, Any]:
    """A row read back after the claim's UPDATE, with the values the claim wrote."""
    claimed = dict(row)
    claimed.update(
        status=TaskStatus.RUNNING,
        started_at=request.now,
        locked_by=request.worker_id,
        locked_until=request.lease_until,
    )
    return claimed


def apply_claim(row: Mapping[str, Any], request: ClaimRequest) -> dict[str, Any]:
    """A row read before the claim's UPDATE, as it is after it (for dialects without RETURNING)."""
    claimed = claimed_row(row, request)
    claimed["attempts"] = row["attempts"] + 1
    return claimed


def orphan_values(table: Table, now: datetime, reason: str) -> dict[str, Any]:
    """A running task whose worker is gone: back to queued, or failed if out of attempts."""
    out_of_attempts = table.c.attempts >= table.c.max_attempts
    return {
        "status": case((out_of_attempts, TaskStatus.FAILED.value), else_=TaskStatus.QUEUED.value),
        "finished_at": case((out_of_attempts, literal(now, UTCDateTime())), else_=None),
        "last_error": reason,
        "locked_until": None,
    }


__all__ = [
    "READ_BACK",
    "ClaimRequest",
    "ClaimStrategy",
    "apply_claim",
    "claim_order",
    "claimed_row",
    "claimed_values",
    "due_clause",
    "due_select",
    "held_params",
    "limit_param",
    "orphan_values",
    "read_back",
]
