"""Claim with advisory locks: PostgreSQL ``pg_try_advisory_lock``, MySQL/MariaDB ``GET_LOCK``.

A claimed task is owned by a session-level advisory lock held, for the whole
run of the task, on a connection kept open for it.  When the worker process
dies its connection closes, the server drops the lock as soon as it has seen
the close, and the next recovery pass gives the task back without waiting
for the lease.

A lock function placed in a WHERE clause may be evaluated on more rows than the
LIMIT lets through, leaving locks nobody knows they hold.  So candidates are
read first without locks, and each lock is taken in a SELECT list, where
every call is evaluated exactly once and its result seen; locks beyond the
ones needed are released at once.

A claim may ask for any number of tasks.  A SELECT list has a limit
(PostgreSQL takes at most 1,664 entries), so the locks are tried in
statements of at most `LOCKS_PER_STATEMENT` calls, one after the other,
stopping as soon as enough are held: a claim of a few tasks is still one
statement, and a claim of 2,000 a handful.  Each lock held takes a slot in
the server's lock table (on PostgreSQL, ``max_locks_per_transaction`` times
``max_connections`` slots for the whole server) for as long as its task runs.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, Table, select, update
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

from sa_taskqueue.backends import SERVED_BY, backend_for
from sa_taskqueue.core.claimed import ClaimedTask, ClaimKey
from sa_taskqueue.core.exceptions import StrategyError
from sa_taskqueue.core.finished import AfterFinal, notify_finished
from sa_taskqueue.core.model import FINISHED_STATUSES, TaskStatus, has_status
from sa_taskqueue.core.rate_limit import Rates
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.claiming import (
    ClaimRequest,
    claimed_values,
    due_clause,
    due_select,
    read_back,
    whole_row,
)
from sa_taskqueue.strategies.lease import Then, orphan_values, orphans_failed, same_claim
from sa_taskqueue.strategies.limited import (
    Limits,
    assign_slots,
    candidate_window,
    candidates_query,
    lost_slot_race,
    store_missing_keys,
    taken_slots,
)
from sa_taskqueue.strategies.rated import LostRace, RatedResult, claim_on

WORKER_LOST_ERROR = "worker lost: its connection closed while the task was running"

#: How many running rows one recovery pass examines.
RECOVERY_BATCH = 500

#: The most lock calls in one SELECT list, well inside PostgreSQL's 1,664
#: entries (MySQL and MariaDB have no such limit).
LOCKS_PER_STATEMENT = 500


class AdvisoryLocks:
    """The advisory locks of one task table, one per task id, in the backend's lock functions."""

    def __init__(self, engine: Engine, table: Table) -> None:
        self.backend = backend_for(engine.dialect)
        scope = self.backend.advisory_scope(engine, table)
        self.namespace = zlib.crc32(f"sa_taskqueue:{scope}".encode())

    def try_lock(self, conn: Connection, ids: Sequence[int], enough: int | None = None) -> list[int]:
        """Try each lock once, without waiting; return the ids now locked by ``conn``, in order.

        With ``enough``, no further statement is sent once that many are
        held (the last one may still take more: the caller releases those).
        """
        locked: list[int] = []
        for chunk in _chunks(ids):
            if enough is not None and len(locked) >= enough:
                break
            calls = (self.backend.try_advisory_lock(self.namespace, task_id) for task_id in chunk)
            results = conn.execute(select(*calls)).one()
            # GET_LOCK answers 1, 0, or NULL on error; pg_try_advisory_lock a boolean.
            locked += [task_id for task_id, got in zip(chunk, results, strict=True) if got in (True, 1)]
        return locked

    def unlock(self, conn: Connection, ids: Sequence[int]) -> None:
        for chunk in _chunks(ids):
            calls = (self.backend.advisory_unlock(self.namespace, task_id) for task_id in chunk)
            conn.execute(select(*calls)).one()


def _chunks(ids: Sequence[int]) -> list[Sequence[int]]:
    """``ids`` in runs of at most `LOCKS_PER_STATEMENT`: one SELECT list each."""
    return [ids[start : start + LOCKS_PER_STATEMENT] for start in range(0, len(ids), LOCKS_PER_STATEMENT)]


def claim_key(row: Any) -> ClaimKey:
    """The `ClaimedTask.claim_key` of a claimed row."""
    return (row["id"], row["locked_by"], row["attempts"], row["started_at"])


@dataclass
class _Holder:
    """A connection holding the advisory locks of the tasks of one claim, while they run.

    The connection is used by whichever task thread finishes first, so every
    use goes through ``mutex``.
    """

    conn: Connection
    locks: AdvisoryLocks
    claims: set[ClaimKey]
    mutex: threading.RLock = field(default_factory=threading.RLock)


def releases_lock(values: Any, *, written: bool) -> bool:
    """Whether a guarded write of ``values`` ends the claim, so that its lock goes.

    Only a write out of RUNNING does: a running task's progress is written
    through the same guard and keeps its lock, or recovery would find the
    lock free and queue the task again while it runs.  A final write the
    ``has_dependents`` test refused keeps it too: the task gained a dependent
    while it ran, and its caller writes it again through the workflow path
    (`finish_then`, which lets go after) or lets go itself (`settled`).
    """
    if "status" not in values:
        return False
    return written or values["status"] not in FINISHED_STATUSES


class AdvisoryLockStrategy(ClaimStrategy):
    """A session-level advisory lock per running task, on a connection held for the run."""

    name = "advisory_lock"

    def __init__(self) -> None:
        super().__init__()
        self._holders: dict[ClaimKey, _Holder] = {}
        self._holders_mutex = threading.Lock()
        self._recovery_after_id = 0

    @classmethod
    def unsupported_reason(cls, dialect: Dialect) -> str | None:
        if backend_for(dialect).advisory_locks:
            return None
        return (
            f"advisory_lock needs {SERVED_BY['advisory_locks']}; "
            f"the {dialect.name!r} dialect has no advisory locks"
        )

    def check_server(self, dialect: Dialect) -> None:
        # A server that has advisory locks may still keep them per node (a
        # Galera cluster): known once the engine has connected.
        reason = backend_for(dialect).advisory_locks_not_exclusive()
        if reason is not None:
            raise StrategyError(f"advisory_lock cannot run here: {reason}")

    def recovery_interval(self, lease: timedelta) -> timedelta:
        # A free lock is proof its worker is gone, so there is no lease to
        # wait for: look every second (not on every claim, which would add
        # round trips to each one).
        return min(lease / 4, timedelta(seconds=1))

    def claim(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        locks = AdvisoryLocks(engine, table)
        # Autocommit: every statement commits on its own, so nothing but the
        # advisory locks stays held on this connection while the tasks run.
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            candidates = list(
                conn.scalars(
                    due_select(table, request, table.c.id).limit(request.limit * 2 + 8),
                    request.params(),
                )
            )
            locked = locks.try_lock(conn, candidates, enough=request.limit)
            wanted, surplus = locked[: request.limit], locked[request.limit :]
            locks.unlock(conn, surplus)
            rows = self._mark_running(conn, table, request, wanted) if wanted else []
            claimed_ids = {row["id"] for row in rows}
            # A candidate can have been claimed and finished by another worker
            # between our read and our lock; the re-check in the UPDATE left it.
            locks.unlock(conn, [task_id for task_id in wanted if task_id not in claimed_ids])
        except BaseException:
            # Closing the DBAPI connection is the one sure way to drop every
            # session lock it may hold; a pooled connection would keep them.
            conn.invalidate()
            conn.close()
            raise
        return self._hold(conn, locks, rows)

    def claim_limited(
        self, engine: Engine, table: Table, request: ClaimRequest, limits: Limits
    ) -> list[dict[str, Any]]:
        """As `claim`, each row also taking a free slot of its concurrency key (`strategies.limited`).

        The advisory locks stay what says who holds a task; the slot is one
        more column of the UPDATE that marks it running.  Each UPDATE commits
        on its own here (autocommit), so a slot another claimer took at the
        same moment fails just that row's UPDATE, whose lock is given back.
        """
        locks = AdvisoryLocks(engine, table)
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            taken = taken_slots(conn, table, request, limits)
            full = sorted(key for key, (limit, slots) in taken.items() if len(slots) >= limit)
            query = candidates_query(table, request, full).limit(candidate_window(request))
            candidates = [dict(row) for row in conn.execute(query, request.params()).mappings()]
            plan = assign_slots(candidates, taken, limits, request.limit)
            store_missing_keys(conn, table, candidates, {row["id"] for _, _, row in plan}, limits)
            locked = set(locks.try_lock(conn, [row["id"] for _, _, row in plan]))
            rows: list[dict[str, Any]] = []
            for key, slot, row in sorted(plan, key=lambda item: (item[0], item[1])):
                if row["id"] not in locked:
                    continue
                try:
                    rows += self._mark_running(
                        conn, table, request, [row["id"]], concurrency_key=key, concurrency_slot=slot
                    )
                except DBAPIError as error:
                    if not lost_slot_race(engine, error):
                        raise
                    # The slot was taken meanwhile: only this row's UPDATE is undone.
            claimed_ids = {row["id"] for row in rows}
            locks.unlock(conn, [task_id for task_id in locked if task_id not in claimed_ids])
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        return self._hold(conn, locks, rows)

    def claim_rated(self, engine: Engine, table: Table, request: ClaimRequest, rates: Rates) -> RatedResult:
        """As `claim`, for rate-limited tasks (`strategies.rated`), holding each started task's lock.

        The candidates are locked (session locks, which outlive the
        transaction) before the rated claim decides which start, in one
        transaction for the windows' compare-and-set; the locks of those not
        started are given back after it.  A claim that loses a race returns
        nothing this time.
        """
        locks = AdvisoryLocks(engine, table)
        conn = engine.connect()
        locked: list[int] = []

        def lock(conn: Connection, ids: list[int]) -> list[int]:
            got = locks.try_lock(conn, ids)
            locked.extend(got)
            return got

        query = due_select(table, request, *read_back(table)).limit(candidate_window(request))
        result = RatedResult([])
        try:
            try:
                with conn.begin():
                    result = claim_on(conn, table, request, rates, query, lock)
            except LostRace:
                pass
            except DBAPIError as error:
                if not lost_slot_race(engine, error):
                    raise
            # Held between tasks as the plain claim's connection is: committing on its own.
            conn.execution_options(isolation_level="AUTOCOMMIT")
            started = {row["id"] for row in result.rows}
            locks.unlock(conn, [task_id for task_id in locked if task_id not in started])
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        return replace(result, rows=self._hold(conn, locks, result.rows))

    def _hold(
        self, conn: Connection, locks: AdvisoryLocks, rows: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Keep ``conn``, and the locks it holds, for as long as ``rows``' tasks run."""
        if not rows:
            conn.close()
            return []
        holder = _Holder(conn=conn, locks=locks, claims={claim_key(row) for row in rows})
        with self._holders_mutex:
            for key in holder.claims:
                self._holders[key] = holder
        return rows

    def _mark_running(
        self, conn: Connection, table: Table, request: ClaimRequest, ids: list[int], **also: Any
    ) -> list[dict[str, Any]]:
        # Holding the lock, re-check that each row is still queued and due.
        claim = (
            update(table)
            .where(table.c.id.in_(ids), due_clause(table, request))
            .values(**claimed_values(table, request), **also)
        )
        if backend_for(conn.dialect).update_returning:
            returned = conn.execute(claim.returning(*whole_row(table)), request.params())
            return [dict(row) for row in returned.mappings()]
        # MySQL and MariaDB have no UPDATE ... RETURNING.  We hold these rows'
        # locks, so the rows we just marked are exactly those now running
        # under our worker id.
        conn.execute(claim, request.params())
        rows = conn.execute(
            select(*whole_row(table)).where(
                table.c.id.in_(ids),
                has_status(table, TaskStatus.RUNNING),
                table.c.locked_by == request.worker_id,
            )
        ).mappings()
        return [dict(row) for row in rows]

    def holds(self, table: Table) -> ColumnElement[bool]:
        # The advisory lock, not the lease, says who owns the task: the row is
        # ours while it is still this claim's, however long the task runs.
        return same_claim(table)

    def finish(self, engine: Engine, table: Table, task: ClaimedTask, values: Any, now: datetime) -> bool:
        key = task.claim_key
        with self._holders_mutex:
            holder = self._holders.get(key)
        if holder is None:
            # Not this strategy's claim, or one already finished or given up:
            # the guarded UPDATE alone decides, and no lock is touched.
            return super().finish(engine, table, task, values, now)
        with holder.mutex:
            if key not in holder.claims:
                return super().finish(engine, table, task, values, now)
            try:
                written = self.write_if_held(holder.conn, table, task, values, now)
            except DBAPIError as error:
                if error.connection_invalidated:
                    # The connection, and with it every lock it held, is gone.
                    self._drop(holder)
                # Otherwise the row was refused (bad data): the lock stays so
                # the caller can still record a failure under it.
                raise
            if releases_lock(values, written=written):
                self._release(holder, key)
        return written

    def complete_on(
        self,
        conn: Connection,
        table: Table,
        task: ClaimedTask,
        values: Any,
        now: datetime,
        *,
        workflow: bool = False,
    ) -> bool:
        """The fenced completion of a transactional task, on its own connection, not the lock holder's.

        The advisory lock stays on the holder's connection until the task's
        transaction has ended (`settled` then releases it); the UPDATE here is
        fenced on the claim's identity (locked_by, attempts, started_at,
        status RUNNING), as `finish` is.  That is safe against recovery
        giving the task to another worker meanwhile: recovery can take the
        lock only once the holder's connection is gone, and then changes the
        row with an UPDATE of its own, conditioned on status RUNNING.  Both
        UPDATEs take the row's lock, so they are serialised by the database:
        if recovery's commits first, ours re-reads the row, finds it QUEUED
        (or claimed again, under another identity) and matches nothing, and
        the task's transaction rolls back; if ours comes first, recovery
        waits for our commit and then finds the row COMPLETED, and leaves it.
        Either way exactly one of them changes the row.
        """
        return self.write_if_held(conn, table, task, values, now, workflow=workflow)

    def finish_then(
        self, engine: Engine, table: Table, task: ClaimedTask, values: Any, now: datetime, then: Then
    ) -> bool:
        # In a transaction on another connection, as a transactional task's
        # completion is (`complete_on`): the lock goes once it has ended.
        try:
            return super().finish_then(engine, table, task, values, now, then)
        finally:
            self.settled(task)

    def complete_many_then(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
        then: Then,
    ) -> set[int]:
        # Row by row under `holds` (the claim, not the lease), as `complete_many` writes them.
        values = {"status": TaskStatus.COMPLETED, "finished_at": now, "locked_until": None}
        rows = [{**values, "result": result} for result in results]
        return self._write_each_then(engine, table, tasks, rows, now, then)

    def fail_many_then(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        values: Sequence[Mapping[str, Any]],
        now: datetime,
        then: Then,
    ) -> set[int]:
        return self._write_each_then(engine, table, tasks, values, now, then)

    def _write_each_then(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        rows: Sequence[Mapping[str, Any]],
        now: datetime,
        then: Then,
    ) -> set[int]:
        """Each of ``rows`` under its task's claim, then ``then``, in one transaction; the locks go after."""
        try:
            with self.transaction(engine) as conn:
                written = {
                    task.id
                    for task, row in zip(tasks, rows, strict=True)
                    if self.write_if_held(conn, table, task, row, now, workflow=True)
                }
                if written:
                    then(conn, written)
            return written
        finally:
            for task in tasks:
                self.settled(task)

    def settled(self, task: ClaimedTask) -> None:
        # Only now may the lock go: released earlier, recovery could take it
        # while the task's transaction is still open (harmless, by the fence,
        # but a needless rollback).
        key = task.claim_key
        with self._holders_mutex:
            holder = self._holders.get(key)
        if holder is not None:
            self._release(holder, key)

    def complete_many(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
    ) -> set[int]:
        # Each task's lock is released with its own completion.
        values = {"status": TaskStatus.COMPLETED, "finished_at": now, "locked_until": None}
        return {
            task.id
            for task, result in zip(tasks, results, strict=True)
            if self.finish(engine, table, task, {**values, "result": result}, now)
        }

    def fail_many(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        values: Sequence[Mapping[str, Any]],
        now: datetime,
    ) -> set[int]:
        # As complete_many: each failure releases its task's lock as it is written.
        return {
            task.id
            for task, row in zip(tasks, values, strict=True)
            if self.finish(engine, table, task, row, now)
        }

    def _release(self, holder: _Holder, key: ClaimKey) -> None:
        """Unlock one finished task; give the connection back once it holds no more."""
        with holder.mutex:
            with self._holders_mutex:
                self._holders.pop(key, None)
            holder.claims.discard(key)
            try:
                holder.locks.unlock(holder.conn, [key[0]])
            except DBAPIError:
                self._drop(holder)
                raise
            if not holder.claims:
                holder.conn.close()

    def recover(
        self, engine: Engine, table: Table, now: datetime, after_final: AfterFinal | None = None
    ) -> int:
        """Give back running tasks whose lock is free: their worker's connection is gone."""
        locks = AdvisoryLocks(engine, table)
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            # One page of running rows per pass, moving on each time, so every
            # running row is looked at however many there are.
            running = list(
                conn.scalars(
                    select(table.c.id)
                    .where(has_status(table, TaskStatus.RUNNING), table.c.id > self._recovery_after_id)
                    .order_by(table.c.id)
                    .limit(RECOVERY_BATCH)
                )
            )
            self._recovery_after_id = running[-1] if len(running) == RECOVERY_BATCH else 0
            with self._holders_mutex:
                ours = {key[0] for key in self._holders}
            orphans = locks.try_lock(conn, [task_id for task_id in running if task_id not in ours])
            recovered = 0
            if orphans:
                # In a transaction of its own, on another connection, while
                # this one holds the locks: the workflow bookkeeping of the
                # tasks that end FAILED goes in it.
                with engine.begin() as written:
                    result = written.execute(
                        update(table)
                        .where(table.c.id.in_(orphans), has_status(table, TaskStatus.RUNNING))
                        .values(**orphan_values(table, now, WORKER_LOST_ERROR))
                    )
                    recovered = result.rowcount
                    if after_final is not None:
                        orphans_failed(written, table, orphans, now, WORKER_LOST_ERROR, after_final)
                    # Those out of attempts are FAILED now: told at commit.
                    notify_finished(written, table, orphans)
                locks.unlock(conn, orphans)
        except BaseException:
            conn.invalidate()
            raise
        finally:
            conn.close()
        return recovered

    def close(self) -> None:
        """Drop every lock this strategy holds; the recovery pass then gives those tasks back."""
        with self._holders_mutex:
            holders = {id(holder): holder for holder in self._holders.values()}
            self._holders.clear()
        for holder in holders.values():
            self._drop(holder)
        super().close()

    def _drop(self, holder: _Holder) -> None:
        """Close the holder's connection, which drops every lock it held."""
        with holder.mutex:
            with self._holders_mutex:
                for key in holder.claims:
                    self._holders.pop(key, None)
            holder.claims.clear()
            if not holder.conn.closed:
                holder.conn.invalidate()
                holder.conn.close()
