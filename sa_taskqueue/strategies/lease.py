"""The fenced writes every strategy shares: complete, fail, release, extend, and recovery.

A claim leaves its identity in the row (worker, attempt, start time) and a
lease (``locked_until``).  Every write out of RUNNING is one UPDATE guarded by
that identity, and by the lease where the strategy says leases decide, so a
worker that lost its task (its lease ran out and another worker claimed it)
writes nothing: its UPDATE matches no row.

The final writes of plain tasks (complete, fail for good, cancel) carry one
more test, written into the SQL: ``has_dependents IS NULL`` (`no_dependents`).
A task that gained a dependent while it ran (the enqueue of the dependent
sets the flag under the row's lock) is then not written by them, and its
caller writes it again through the workflow path: the same fenced UPDATE
without that test, and the bookkeeping in its transaction (`finish_then`,
`complete_many_then`, `fail_many_then`).  So no completion can miss a
dependent, and plain tasks pay no statement for it.  Lease renewals and
give-backs do not carry the test: they end nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BindParameter,
    ClauseElement,
    ColumnElement,
    Connection,
    CursorResult,
    Engine,
    Table,
    and_,
    bindparam,
    case,
    func,
    literal,
    or_,
    select,
    update,
)

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.finished import AfterFinal, FinishedTask, announced_ids, announcing, notify_finished
from sa_taskqueue.core.model import FINISHED_STATUSES, TaskStatus, has_status
from sa_taskqueue.core.types import UTCDateTime
from sa_taskqueue.strategies.held_arrays import complete_from_arrays_statement, held_claims
from sa_taskqueue.strategies.prepared import DriverResult

if TYPE_CHECKING:
    from sa_taskqueue.strategies.executor import StatementExecutor

LEASE_EXPIRED_ERROR = "lease expired: the worker holding this task stopped renewing it (crashed or lost)"

#: The most tasks `LeaseWrites.complete_many` writes in one statement
#: (SQLite limits how deep an expression may nest).
COMPLETE_MANY_CHUNK = 100
#: The most tasks `LeaseWrites.fail_many` writes in one statement: each
#: brings a dozen parameters, and SQLite before 3.32 takes at most 999.
FAIL_MANY_CHUNK = 50
#: The columns a failure writes row by row (`fail_many_statement`); the
#: others it writes are the same for every row.
FAILURE_COLUMNS = ("status", "last_error", "run_at", "finished_at")

HELD_ID = "held_id"
HELD_BY = "held_by"
HELD_ATTEMPTS = "held_attempts"
HELD_STARTED_AT = "held_started_at"
HELD_NOW = "held_now"

#: Called in the transaction of a workflow path's fenced write, with the ids it wrote.
Then = Callable[[Connection, set[int]], None]


class LeaseWrites:
    """Guarded writes and lease recovery, run on the strategy's `StatementExecutor`.

    A strategy that says otherwise who holds a task overrides `holds` (and,
    where its locks need it, `finish`, `complete_many`, `fail_many` and
    `recover`).
    """

    executor: StatementExecutor

    def holds(self, table: Table) -> ColumnElement[bool]:
        """The condition under which a claim still owns its row: same claim, lease not over.

        Its values come from `held_params`.
        """
        return and_(
            same_claim(table), table.c.locked_until > bindparam(HELD_NOW, type_=table.c.locked_until.type)
        )

    def finish(
        self, engine: Engine, table: Table, task: ClaimedTask, values: Mapping[str, Any], now: datetime
    ) -> bool:
        """Write ``values`` to the task if ``task``'s claim still holds it; True if it did.

        Used for every transition out of RUNNING (completed, failed, retried,
        given back), so one ownership test guards them all.
        """
        with self.executor.single_statement(engine) as conn:
            return self.write_if_held(conn, table, task, values, now)

    def write_if_held(
        self,
        conn: Connection,
        table: Table,
        task: ClaimedTask,
        values: Mapping[str, Any],
        now: datetime,
        *,
        workflow: bool = False,
    ) -> bool:
        """Run the guarded UPDATE of `finish_statement` on ``conn``; True if it wrote the row.

        A final status (completed, failed) is announced on the finished
        channel where the database has one, in the same statement
        (`sa_taskqueue.core.finished.announcing`), so that a caller waiting for
        the result wakes when it commits.  A final status is written only to
        a task without dependents (`no_dependents`), unless ``workflow``: the
        caller then runs the bookkeeping in ``conn``'s transaction.
        """
        params = held_params(task, now)
        final = values.get("status") in FINISHED_STATUSES
        announce = final and backend_for(conn.dialect).notify
        fenced = final and not workflow
        if any(isinstance(value, ClauseElement) for value in values.values()):
            # Values holding SQL (release's ``attempts - 1``) are rare: built each time.
            statement = update(table).where(self.holds(table)).values(**values)
            if fenced:
                statement = statement.where(no_dependents(table))
            if announce:
                return bool(announced_ids(conn.execute(announcing(statement, table), params).scalar()))
            return conn.execute(statement, params).rowcount == 1
        names = tuple(sorted(values))

        def build() -> Any:
            statement = (
                update(table)
                .where(self.holds(table))
                .values({name: bindparam(f"set_{name}", type_=table.c[name].type) for name in names})
            )
            if fenced:
                statement = statement.where(no_dependents(table))
            return announcing(statement, table) if announce else statement

        prepared = self.executor.prepared(("finish", names, announce, fenced), conn.dialect, table, build)
        params.update({f"set_{name}": value for name, value in values.items()})
        if announce:
            return bool(announced_ids(prepared.execute(conn, params).scalar()))
        return prepared.execute(conn, params).rowcount == 1

    def complete_on(
        self,
        conn: Connection,
        table: Table,
        task: ClaimedTask,
        values: Mapping[str, Any],
        now: datetime,
        *,
        workflow: bool = False,
    ) -> bool:
        """`finish`'s fenced UPDATE, on ``conn`` inside its caller's open transaction; True if it wrote.

        A transactional task's completion: the caller commits its own writes
        with it only when it wrote, and rolls back otherwise.  Until that
        transaction ends the UPDATE holds the row's lock, so no recovery or
        claim can take the task between the fence and the commit.  With
        ``workflow`` the caller runs the bookkeeping on ``conn`` after it.
        """
        return self.write_if_held(conn, table, task, values, now, workflow=workflow)

    def finish_then(
        self,
        engine: Engine,
        table: Table,
        task: ClaimedTask,
        values: Mapping[str, Any],
        now: datetime,
        then: Then,
    ) -> bool:
        """`finish` for a workflow task: fenced UPDATE, then ``then``, in one transaction; True if written.

        Without `no_dependents`' test: ``then`` is the bookkeeping that
        releases the task's dependents and counts its batch.  It is called
        only when the row was written, with its id.
        """
        with self.transaction(engine) as conn:
            written = self.write_if_held(conn, table, task, values, now, workflow=True)
            if written:
                then(conn, {task.id})
        return written

    def complete_many_then(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
        then: Then,
    ) -> set[int]:
        """`complete_many` for workflow tasks, then ``then`` with the ids written, in one transaction."""
        with self.transaction(engine) as conn:
            written: set[int] = set()
            for start in range(0, len(tasks), COMPLETE_MANY_CHUNK):
                chunk = slice(start, start + COMPLETE_MANY_CHUNK)
                written |= self.complete_many_on(
                    conn, table, tasks[chunk], results[chunk], now, workflow=True
                )
            if written:
                then(conn, written)
        return written

    def fail_many_then(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        values: Sequence[Mapping[str, Any]],
        now: datetime,
        then: Then,
    ) -> set[int]:
        """`fail_many` for workflow tasks, then ``then`` with the ids written, in one transaction."""
        with self.transaction(engine) as conn:
            written: set[int] = set()
            for start in range(0, len(tasks), FAIL_MANY_CHUNK):
                chunk = slice(start, start + FAIL_MANY_CHUNK)
                written |= self.fail_many_on(conn, table, tasks[chunk], values[chunk], now, workflow=True)
            if written:
                then(conn, written)
        return written

    def settled(self, task: ClaimedTask) -> None:
        """The transaction that ran `complete_on` for ``task`` has ended: let go of what else held it.

        Nothing here: the row alone said who held the task.
        """

    def complete_many(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
    ) -> set[int]:
        """Mark each task still held COMPLETED with its result, in one statement; return the ids written.

        Row by row under the same guard as `finish`: a task whose claim no
        longer holds it is left alone and its id not returned.  At most
        `COMPLETE_MANY_CHUNK` tasks go in one statement.
        """
        if len(tasks) > COMPLETE_MANY_CHUNK:
            return in_chunks(
                lambda chunk: self.complete_many(engine, table, tasks[chunk], results[chunk], now),
                len(tasks),
                COMPLETE_MANY_CHUNK,
            )
        if backend_for(engine.dialect).completes_from_arrays and len(tasks) > 1:
            # (A batch of one goes by `complete_many_on`'s statement, for one
            # task: a value per column costs the driver less than an array of one.)
            return self._complete_from_arrays(engine, table, tasks, results, now)
        with self.executor.single_statement(engine) as conn:
            return self.complete_many_on(conn, table, tasks, results, now)

    def complete_many_on(
        self,
        conn: Connection,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
        *,
        workflow: bool = False,
    ) -> set[int]:
        """`complete_many` of at most `COMPLETE_MANY_CHUNK` tasks, on ``conn`` in its caller's transaction.

        For a caller that commits the completion together with more of its
        own (`ClaimStrategy.complete_and_claim`): a value per column and
        task, one statement.  Tasks with dependents are left alone unless
        ``workflow`` (`write_if_held`).
        """
        count = len(tasks)
        with_results = any(result is not None for result in results)
        backend = backend_for(conn.dialect)
        # A batch of one needs no RETURNING, whose row costs the client more
        # to read than the statement's row count: that says if it was written.
        returning = backend.update_returning and count > 1
        # Where completions are announced (PostgreSQL), the UPDATE goes in a
        # statement that also sends the ids written: one round trip still.
        announce = backend.notify

        fenced = not workflow

        def build() -> Any:
            if announce:
                return announcing(
                    complete_many_statement(table, count, with_results, returning=False, fenced=fenced), table
                )
            return complete_many_statement(table, count, with_results, returning=returning, fenced=fenced)

        statement = self.executor.prepared(
            ("complete_many", count, with_results, announce, fenced), conn.dialect, table, build
        )
        params: dict[str, Any] = {HELD_NOW: now, "finished_now": now}
        for index, (task, result) in enumerate(zip(tasks, results, strict=True)):
            params.update(held_params(task, suffix=f"_{index}"))
            if with_results:
                params[f"result_{index}"] = result
        written = statement.execute(conn, params)
        told = ids_written(written, tasks, announced=announce, returning=returning)
        if told is not None:
            return told
        if count == 1:
            return set()
        # Without RETURNING, and some rows not ours any more: the rows
        # written are those now completed at exactly ``now`` under one of
        # these claims.  (Another claim of the same task completing at the
        # same instant carries another identity, so it is never counted.)
        written_ids = select(table.c.id).where(
            has_status(table, TaskStatus.COMPLETED),
            table.c.finished_at == bindparam("finished_now", type_=table.c.finished_at.type),
            or_(*(claim_identity(table, f"_{index}") for index in range(count))),
        )
        return set(conn.execute(written_ids, params).scalars())

    def fail_many(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        values: Sequence[Mapping[str, Any]],
        now: datetime,
    ) -> set[int]:
        """Write each still-held task's failure ``values``, in one statement; return the ids written.

        ``values`` pairs with ``tasks``: what `finish` would write for each
        (``status``, ``last_error`` and ``run_at`` or ``finished_at``; and
        ``concurrency_slot`` cleared where the task holds one).  Row by row
        under the same guard as `finish`.  At most `FAIL_MANY_CHUNK` tasks go
        in one statement.  Where finished tasks are announced (PostgreSQL),
        every id written is, those queued again to retry too: their waiters
        read the row, find it unfinished, and wait on.
        """
        if len(tasks) > FAIL_MANY_CHUNK:
            return in_chunks(
                lambda chunk: self.fail_many(engine, table, tasks[chunk], values[chunk], now),
                len(tasks),
                FAIL_MANY_CHUNK,
            )
        with self.executor.single_statement(engine) as conn:
            return self.fail_many_on(conn, table, tasks, values, now)

    def fail_many_on(
        self,
        conn: Connection,
        table: Table,
        tasks: Sequence[ClaimedTask],
        values: Sequence[Mapping[str, Any]],
        now: datetime,
        *,
        workflow: bool = False,
    ) -> set[int]:
        """`fail_many` of at most `FAIL_MANY_CHUNK` tasks, on ``conn`` in its caller's transaction.

        Tasks with dependents are left alone (retries too: the statement is
        one for all its rows) unless ``workflow`` (`write_if_held`).
        """
        count = len(tasks)
        backend = backend_for(conn.dialect)
        # As in `complete_many`: a lone failure's row count says if it was written.
        returning = backend.update_returning and count > 1
        announce = backend.notify
        clears_slots = any("concurrency_slot" in row for row in values)
        fenced = not workflow

        def build() -> Any:
            statement = fail_many_statement(table, count, clears_slots=clears_slots)
            if fenced:
                statement = statement.where(no_dependents(table))
            if announce:
                return announcing(statement, table)
            return statement.returning(table.c.id) if returning else statement

        statement = self.executor.prepared(
            ("fail_many", count, clears_slots, announce, returning, fenced), conn.dialect, table, build
        )
        params: dict[str, Any] = {HELD_NOW: now}
        for index, (task, row) in enumerate(zip(tasks, values, strict=True)):
            params.update(held_params(task, suffix=f"_{index}"))
            for name in FAILURE_COLUMNS:
                params[f"{name}_{index}"] = row.get(name)
        written = statement.execute(conn, params)
        told = ids_written(written, tasks, announced=announce, returning=returning)
        if told is not None:
            return told
        if count == 1:
            return set()
        # Without RETURNING, and some rows not ours any more: the rows
        # written are those holding, under one of these claims, exactly
        # what this statement wrote to it: its status, and its finish
        # (failed for good at ``now``) or its retry's time (``now``
        # plus a backoff with jitter), never an earlier write's.
        return set(conn.execute(written_failures(table, values), params).scalars())

    def _complete_from_arrays(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
    ) -> set[int]:
        """`complete_many` in one statement for any batch size (`held_claims`), announced where it can."""
        announce = backend_for(engine.dialect).notify

        def build() -> Any:
            statement = complete_from_arrays_statement(table, HELD_NOW)
            return announcing(statement, table) if announce else statement.returning(table.c.id)

        statement = self.executor.prepared(("complete_arrays", announce), engine.dialect, table, build)
        params: dict[str, Any] = {
            HELD_NOW: now,
            "finished_now": now,
            **held_claims([task.claim_key for task in tasks], list(results), engine.dialect),
        }
        with self.executor.single_statement(engine) as conn:
            written = statement.execute(conn, params)
            if announce:
                return announced_ids(written.scalar())
            return {row[0] for row in written}

    def extend(
        self, engine: Engine, table: Table, tasks: Sequence[ClaimedTask], until: datetime, now: datetime
    ) -> set[int]:
        """Move the lease of each still-held task in ``tasks`` to ``until``; return the ids extended."""
        extend = self.executor.prepared(
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

    def claim_outcome(
        self, engine: Engine, table: Table, task: ClaimedTask
    ) -> tuple[TaskStatus, str | None] | None:
        """The status and error the row holds if it still carries ``task``'s claim and is no longer running.

        None when another claim has taken the row since (or it still runs).
        """
        with self.executor.single_statement(engine) as conn:
            row = conn.execute(
                select(table.c.status, table.c.last_error).where(
                    claim_identity(table), ~has_status(table, TaskStatus.RUNNING)
                ),
                held_params(task),
            ).first()
        return None if row is None else (TaskStatus(row[0]), row[1])

    def recover(
        self, engine: Engine, table: Table, now: datetime, after_final: AfterFinal | None = None
    ) -> int:
        """Give back tasks whose worker is gone; return how many.

        Here that means running tasks whose lease ended before ``now``: they go
        back to QUEUED, or to FAILED when they have used all their attempts
        (the lost run counted as one).  ``after_final``, given, is called in
        the same transaction with the workflow tasks that ended FAILED
        (`orphans_failed`).
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
            if after_final is not None:
                orphans_failed(conn, table, ids, now, LEASE_EXPIRED_ERROR, after_final)
            # Those out of attempts are FAILED now: their waiters are told (the
            # others, queued again, read their row and wait on).
            notify_finished(conn, table, ids)
            return result.rowcount

    def transaction(self, engine: Engine) -> AbstractContextManager[Connection]:
        """A connection in a transaction that commits on success and rolls back on error."""
        return self.executor.transaction(engine)

    def lock_rows(self, conn: Connection, query: Any) -> Any:
        """Turn a SELECT of rows this transaction will update into one safe to run concurrently."""
        return query


def no_dependents(table: Table) -> ColumnElement[bool]:
    """``has_dependents IS NULL``: the test a plain task's final write carries (no bound value)."""
    return table.c.has_dependents.is_(None)


def orphans_failed(
    conn: Connection, table: Table, ids: Sequence[int], now: datetime, reason: str, after_final: AfterFinal
) -> None:
    """Recovery's workflow tasks among ``ids`` that it just wrote FAILED: ``after_final`` for them.

    Read after recovery's UPDATE, in its transaction: the rows it wrote are
    locked by it, so what is read is what it wrote.  Plain tasks are not
    passed on.
    """
    rows = conn.execute(
        select(table.c.id, table.c.batch_id, table.c.has_dependents).where(
            table.c.id.in_(ids),
            has_status(table, TaskStatus.FAILED),
            table.c.finished_at == literal(now, UTCDateTime()),
            table.c.last_error == reason,
            or_(table.c.batch_id.is_not(None), table.c.has_dependents.is_not(None)),
        )
    ).all()
    if rows:
        after_final(
            conn,
            table,
            [FinishedTask(row[0], TaskStatus.FAILED, row[1], bool(row[2])) for row in rows],
            now,
        )


def in_chunks(write: Callable[[slice], set[int]], count: int, size: int) -> set[int]:
    """``write`` each slice of at most ``size`` of ``count`` tasks, one after the other; every id written."""
    written: set[int] = set()
    for start in range(0, count, size):
        written |= write(slice(start, start + size))
    return written


def ids_written(
    result: CursorResult[Any] | DriverResult,
    tasks: Sequence[ClaimedTask],
    *,
    announced: bool,
    returning: bool,
) -> set[int] | None:
    """The ids a guarded UPDATE of ``tasks`` wrote, as its ``result`` tells them.

    From the `announcing` row, or the rows RETURNING sent, or else from the
    row count when it counts every task; None when it counts fewer, and
    only a query can tell which.
    """
    if announced:
        return announced_ids(result.scalar())
    if returning:
        return {row[0] for row in result}
    if result.rowcount == len(tasks):
        return {task.id for task in tasks}
    return None


def same_claim(table: Table) -> ColumnElement[bool]:
    """The row is still running under the claim bound by `held_params`.

    The row is to be found by its id: its status test is one no index
    serves where a planner would otherwise walk the lease index, every
    running row, to find it (`Backend.unindexed`).
    """
    return and_(claim_identity(table), has_status(table, TaskStatus.RUNNING, indexed=False))


def claim_identity(table: Table, suffix: str = "") -> ColumnElement[bool]:
    """The row carries the `ClaimedTask.claim_key` bound by `held_params` (names ending in ``suffix``)."""

    def held(name: str, column: str) -> BindParameter[Any]:
        return bindparam(f"{name}{suffix}", type_=table.c[column].type)

    return and_(
        table.c.id == held(HELD_ID, "id"),
        table.c.locked_by == held(HELD_BY, "locked_by"),
        table.c.attempts == held(HELD_ATTEMPTS, "attempts"),
        table.c.started_at == held(HELD_STARTED_AT, "started_at"),
    )


def held_params(task: ClaimedTask, now: datetime | None = None, *, suffix: str = "") -> dict[str, Any]:
    """The values for `same_claim` (the task's `ClaimedTask.claim_key`) and, given ``now``, the lease test."""
    task_id, locked_by, attempts, started_at = task.claim_key
    params = {
        f"{HELD_ID}{suffix}": task_id,
        f"{HELD_BY}{suffix}": locked_by,
        f"{HELD_ATTEMPTS}{suffix}": attempts,
        f"{HELD_STARTED_AT}{suffix}": started_at,
    }
    if now is not None:
        params[HELD_NOW] = now
    return params


def complete_many_statement(
    table: Table, count: int, with_results: bool, *, returning: bool, fenced: bool = True
) -> Any:
    """The UPDATE completing ``count`` held tasks at once, each under its own claim test.

    Its parameters are `held_params` names suffixed ``_0`` .. ``_{count-1}``,
    ``held_now``, ``finished_now`` and, ``with_results``, ``result_0`` ...
    The rows are found by their ids, as in `same_claim`.  ``fenced``: only
    tasks without dependents (`no_dependents`).
    """
    held = or_(*(claim_identity(table, f"_{index}") for index in range(count)))
    result: Any = None
    if with_results:
        result = case(
            *(
                (
                    table.c.id == bindparam(f"{HELD_ID}_{index}", type_=table.c.id.type),
                    bindparam(f"result_{index}", type_=table.c.result.type),
                )
                for index in range(count)
            ),
            else_=None,
        )
    statement = (
        update(table)
        .where(
            has_status(table, TaskStatus.RUNNING, indexed=False),
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
    if fenced:
        statement = statement.where(no_dependents(table))
    return statement.returning(table.c.id) if returning else statement


def fail_many_statement(table: Table, count: int, *, clears_slots: bool) -> Any:
    """The UPDATE writing ``count`` held tasks' failures at once, each under its own claim test.

    Its parameters are `held_params` names suffixed ``_0`` .. ``_{count-1}``,
    ``held_now``, and each of `FAILURE_COLUMNS` suffixed likewise: a row's
    ``status`` and ``last_error`` are written, its ``run_at`` (a retry) and
    ``finished_at`` (a failure for good) only where given, not None.  With
    ``clears_slots`` every row's ``concurrency_slot`` is cleared (it is
    already clear where the task holds none).  The rows are found by their
    ids, as in `same_claim`.
    """

    def row_by_row(name: str, *, keep_unless_given: bool = False, otherwise: Any = None) -> Any:
        column = table.c[name]
        whens = []
        for index in range(count):
            value: Any = bindparam(f"{name}_{index}", type_=column.type)
            if keep_unless_given:
                value = func.coalesce(value, column)
            whens.append((table.c.id == bindparam(f"{HELD_ID}_{index}", type_=table.c.id.type), value))
        return case(*whens, else_=otherwise)

    # Every row written is one of the batch's, so one WHEN always matches:
    # the ELSE is never taken.  The error's is NULL rather than the column,
    # as a result's is in `complete_many_statement`: Oracle keeps it in a
    # CLOB, which its CASE will not mix with a text bind.
    values: dict[str, Any] = {
        "status": row_by_row("status", otherwise=table.c.status),
        "last_error": row_by_row("last_error"),
        "run_at": row_by_row("run_at", keep_unless_given=True, otherwise=table.c.run_at),
        "finished_at": row_by_row("finished_at", keep_unless_given=True, otherwise=table.c.finished_at),
        "locked_until": None,
    }
    if clears_slots:
        values["concurrency_slot"] = None
    return (
        update(table)
        .where(
            has_status(table, TaskStatus.RUNNING, indexed=False),
            table.c.locked_until > bindparam(HELD_NOW, type_=table.c.locked_until.type),
            or_(*(claim_identity(table, f"_{index}") for index in range(count))),
        )
        .values(values)
    )


def written_failures(table: Table, values: Sequence[Mapping[str, Any]]) -> Any:
    """The ids of the rows `fail_many_statement`, run with the same parameters, wrote ``values`` to."""

    def bound(name: str, index: int) -> BindParameter[Any]:
        return bindparam(f"{name}_{index}", type_=table.c[name].type)

    written = []
    for index, row in enumerate(values):
        mark = "finished_at" if row.get("finished_at") is not None else "run_at"
        written.append(
            and_(
                claim_identity(table, f"_{index}"),
                table.c.status == bound("status", index),
                table.c[mark] == bound(mark, index),
            )
        )
    return select(table.c.id).where(or_(*written))


def orphan_values(table: Table, now: datetime, reason: str) -> dict[str, Any]:
    """A running task whose worker is gone: back to queued, or failed if out of attempts."""
    out_of_attempts = table.c.attempts >= table.c.max_attempts
    return {
        "status": case((out_of_attempts, TaskStatus.FAILED.value), else_=TaskStatus.QUEUED.value),
        "finished_at": case((out_of_attempts, literal(now, UTCDateTime())), else_=None),
        "last_error": reason,
        "locked_until": None,
        # A limited task's slot, cleared as in `TaskQueue.fail` (it stops counting once not running).
        "concurrency_slot": None,
    }


__all__ = [
    "COMPLETE_MANY_CHUNK",
    "FAIL_MANY_CHUNK",
    "LEASE_EXPIRED_ERROR",
    "LeaseWrites",
    "claim_identity",
    "complete_many_statement",
    "fail_many_statement",
    "held_params",
    "no_dependents",
    "orphan_values",
    "orphans_failed",
    "same_claim",
]
