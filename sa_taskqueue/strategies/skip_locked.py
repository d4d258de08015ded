"""Claim with ``SELECT ... FOR UPDATE SKIP LOCKED``: PostgreSQL, MySQL 8, MariaDB 10.6+, Oracle.

Concurrent claimers each lock a different set of due rows and skip the rows
another claimer has locked, so they never wait on each other and never take
the same row.  The lock lasts only for the claim's short transaction; after
that the lease (``locked_by``/``locked_until``) is what says who holds a task.

SQLAlchemy renders the locking clause for each dialect, but the claim around
it takes one of three shapes, chosen by what the backend can do.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Select, Table, bindparam, select, update
from sqlalchemy.engine import Dialect

from sa_taskqueue.backends import FETCH_ROWS_OPTION, backend_for
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.exceptions import StrategyError
from sa_taskqueue.core.finished import announced_ids
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.claiming import (
    ClaimRequest,
    apply_claim,
    claimed_row,
    claimed_values,
    due_select,
    limit_param,
    read_back,
    whole_row,
)
from sa_taskqueue.strategies.complete_and_claim import FINISHED_IDS, complete_and_claim_statement
from sa_taskqueue.strategies.held_arrays import held_claims
from sa_taskqueue.strategies.lease import COMPLETE_MANY_CHUNK, HELD_NOW
from sa_taskqueue.strategies.limited import candidate_window
from sa_taskqueue.strategies.spreading import NodeSpreading, SpreadingOptions


class SkipLockedStrategy(ClaimStrategy):
    """Row locks taken with SKIP LOCKED for the length of the claim, then a lease."""

    name = "skip_locked"
    locking_reads = True

    def __init__(self, *, spreading: SpreadingOptions | None = None) -> None:
        """``spreading``: how claims spread over a multi-primary cluster's nodes (`SpreadingOptions`).

        By default they spread on a Galera node once a claim has lost a
        certification conflict to another node's, for a while, and nowhere
        else; ``SpreadingOptions(enabled=False)`` claims as on one server.
        """
        super().__init__()
        self.spreading = NodeSpreading(spreading)

    @classmethod
    def unsupported_reason(cls, dialect: Dialect) -> str | None:
        backend = backend_for(dialect)
        if backend.serialised_writes:
            return (
                f"{backend.label} has no row locks (SQLAlchemy drops FOR UPDATE when compiling for it), "
                "so skip_locked cannot run there; use conditional_update"
            )
        if not backend.skip_locked:
            return f"skip_locked has not been written for the {dialect.name!r} dialect"
        return None

    def check_server(self, dialect: Dialect) -> None:
        backend = backend_for(dialect)
        if not backend.has_skip_locked():
            version = ".".join(map(str, backend.server_version))
            needed = ".".join(map(str, backend.skip_locked_since or ()))
            raise StrategyError(
                f"{backend.label} {version} has no SKIP LOCKED (needs {needed}+); use conditional_update"
            )

    def finding_statement(self, dialect: Dialect, table: Table, request: ClaimRequest) -> Any:
        backend = backend_for(dialect)
        if not backend.limit_with_for_update:
            return self.unbounded_locking_select(table, request)
        if backend.update_from_locked_cte:
            return self.one_statement_claim(table, request)
        return locking_select(table, request, *read_back(table)).limit(limit_param())

    def claim(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        backend = backend_for(engine.dialect)
        if not backend.limit_with_for_update:
            return self._claim_from_unbounded_cursor(engine, table, request)
        if backend.update_from_locked_cte:
            return self._claim_in_one_statement(engine, table, request)
        return self._claim_then_update(engine, table, request)

    # One statement (PostgreSQL) -------------------------------------------------

    def one_statement_claim(self, table: Table, request: ClaimRequest) -> Any:
        """Lock in a CTE, ``UPDATE ... FROM`` it, ``RETURNING`` the rows.

        A CTE is evaluated once, so the LIMIT holds.  The tempting
        ``UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)``
        lets the planner re-run the subquery (on a join or a recheck) and
        claim more than n rows.
        """
        claimable = locking_select(table, request, table.c.id).limit(limit_param()).cte("claimable")
        return (
            update(table)
            .where(table.c.id == claimable.c.id)
            .values(**claimed_values(table, request))
            .returning(*read_back(table))
        )

    def _claim_in_one_statement(
        self, engine: Engine, table: Table, request: ClaimRequest
    ) -> list[dict[str, Any]]:
        claim = self.executor.prepared(
            ("claim", request.shape), engine.dialect, table, lambda: self.one_statement_claim(table, request)
        )
        with self.executor.single_statement(engine) as conn:
            return [claimed_row(row, request) for row in claim.rows(conn, request.params())]

    # A completion and the next claim in one statement (PostgreSQL) -------------------

    def completes_and_claims_at_once(self, dialect: Dialect) -> bool:
        backend = backend_for(dialect)
        if not backend.limit_with_for_update or self._completes_or_claims_its_own_way(SkipLockedStrategy):
            return False
        if backend.update_from_locked_cte:
            return backend.completes_from_arrays and backend.notify
        return True  # (the lock, then the update: in the completion's transaction)

    def complete_and_claim(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
        request: ClaimRequest,
    ) -> tuple[set[int], list[dict[str, Any]]]:
        """Both in one statement (`complete_and_claim_statement`) where it can be, else in one transaction.

        In one transaction (MySQL, MariaDB) the completion goes first: the
        rows it writes are this worker's own, which no claim would wait
        for, and the claim's locks are then held only for its own two statements.
        """
        at_once = self.completes_and_claims_at_once(engine.dialect)
        if not tasks or len(tasks) > COMPLETE_MANY_CHUNK or not at_once:
            return super().complete_and_claim(engine, table, tasks, results, now, request)
        if not backend_for(engine.dialect).update_from_locked_cte:
            with self.spreading.watching(engine.dialect), self.transaction(engine) as conn:
                written = self.complete_many_on(conn, table, tasks, results, now)
                return written, self._lock_then_update(conn, table, request)
        statement = self.executor.prepared(
            ("complete_and_claim", request.shape),
            engine.dialect,
            table,
            lambda: complete_and_claim_statement(table, self.one_statement_claim(table, request), HELD_NOW),
        )
        params = {
            **request.params(),
            HELD_NOW: now,
            "finished_now": now,
            **held_claims([task.claim_key for task in tasks], list(results), engine.dialect),
        }
        with self.executor.single_statement(engine) as conn:
            rows = statement.rows(conn, params)
        written = announced_ids(rows[0][FINISHED_IDS])
        claimed = []
        for row in rows:
            del row[FINISHED_IDS]
            if row["id"] is not None:  # (else the one row of a claim that found nothing)
                claimed.append(claimed_row(row, request))
        return written, claimed

    # Lock, then update (MySQL and MariaDB) ---------------------------------------

    def _claim_then_update(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        # Without UPDATE ... RETURNING, and where LIMIT is refused inside an
        # IN (...) subquery (MySQL's error 1235), the claim is two statements
        # in one transaction: lock the whole rows, then update them by id.
        # The rows as claimed are computed from what was read, not read again.
        with self.spreading.watching(engine.dialect), self.transaction(engine) as conn:
            return self._lock_then_update(conn, table, request)

    def _lock_then_update(
        self, conn: Connection, table: Table, request: ClaimRequest
    ) -> list[dict[str, Any]]:
        """`_claim_then_update`'s two statements on ``conn``, in its caller's transaction."""
        dialect = conn.dialect
        params = request.params()
        partition = self.spreading.partition(conn)
        if partition is not None:
            # Galera certifies at commit, and a row lock holds only on its own
            # node: workers of two nodes lock the same rows and one of them
            # fails at commit.  Once they have met, each node takes its own
            # share first.
            rows = self.spreading.locked_rows(
                lambda name, build: self.executor.prepared(name, dialect, table, build),
                conn,
                table,
                request,
                partition,
            )
        else:
            lock = self.executor.prepared(
                ("lock", request.shape),
                dialect,
                table,
                lambda: locking_select(table, request, *read_back(table)).limit(limit_param()),
            )
            rows = lock.rows(conn, params)
        if rows:
            ids = claimed_id_params(len(rows))
            mark = self.executor.prepared(
                ("mark", len(rows), request.shape),
                dialect,
                table,
                lambda: mark_claimed(table, request, ids),
            )
            mark.execute(conn, {**params, **dict(zip(ids, (row["id"] for row in rows), strict=True))})
        return [apply_claim(row, request) for row in rows]

    # An unbounded cursor (Oracle) --------------------------------------------------

    def unbounded_locking_select(self, table: Table, request: ClaimRequest) -> Select[Any]:
        """The locking query where no row limit may stand beside FOR UPDATE: no limit in the SQL at all.

        The database locks a SKIP LOCKED cursor's rows as they are fetched
        (Oracle does), so the claim fetches ``limit`` rows from this unbounded
        cursor, with the driver told to fetch no more, and locks just those.
        SQLAlchemy also drops FOR UPDATE inside a subquery on Oracle, so the
        lock cannot move into one.
        """
        return locking_select(table, request, table.c.id)

    def _claim_from_unbounded_cursor(
        self, engine: Engine, table: Table, request: ClaimRequest
    ) -> list[dict[str, Any]]:
        lock = self.unbounded_locking_select(table, request).execution_options(
            **{FETCH_ROWS_OPTION: request.limit}
        )
        params = request.params()
        with self.transaction(engine) as conn:
            cursor = conn.execute(lock, params)
            ids = [row[0] for row in cursor.fetchmany(request.limit)]
            cursor.close()
            if not ids:
                return []
            conn.execute(
                mark_claimed(table, request, claimed_id_params(len(ids))),
                {**params, **dict(zip(claimed_id_params(len(ids)), ids, strict=True))},
            )
            rows = conn.execute(select(*whole_row(table)).where(table.c.id.in_(ids))).mappings().all()
        return [dict(row) for row in rows]

    # Limited claims ----------------------------------------------------------------

    def limited_candidates(self, dialect: Dialect, query: Select[Any], request: ClaimRequest) -> Any:
        locked = skipping_locked(query)
        if not backend_for(dialect).limit_with_for_update:
            # Oracle: no row limit beside FOR UPDATE; the claim fetches only
            # the window from this unbounded cursor, and the driver is told
            # to fetch no more, so only those rows are locked.
            return locked.execution_options(**{FETCH_ROWS_OPTION: candidate_window(request)})
        return locked.limit(candidate_window(request))

    # Shared -------------------------------------------------------------------------

    def lock_rows(self, conn: Connection, query: Any) -> Any:
        return skipping_locked(query)

    @contextmanager
    def transaction(self, engine: Engine) -> Iterator[Connection]:
        """A transaction fit for locking reads that skip locked rows (READ COMMITTED on MySQL)."""
        with self.executor.transaction(engine) as conn:
            backend_for(conn.dialect).begin_locking_reads(conn)
            yield conn


def claimed_id_params(count: int) -> list[str]:
    """The parameters holding the ids of ``count`` locked rows: one per id, so the SQL is fixed per count."""
    return [f"claimed_id_{index}" for index in range(count)]


def mark_claimed(table: Table, request: ClaimRequest, id_params: list[str]) -> Any:
    """UPDATE the rows whose ids are bound to ``id_params`` to claimed."""
    ids = [bindparam(name, type_=table.c.id.type) for name in id_params]
    return update(table).where(table.c.id.in_(ids)).values(**claimed_values(table, request))


def locking_select(table: Table, request: ClaimRequest, *columns: Any) -> Select[Any]:
    """Due rows in claim order, locked with SKIP LOCKED; the caller adds a LIMIT where the database allows."""
    return skipping_locked(due_select(table, request, *columns))


def skipping_locked(query: Select[Any]) -> Select[Any]:
    """``query`` locking the rows it returns and skipping those another transaction has locked.

    Every locking read of this strategy goes through here, and so does the
    self-test's (`sa_taskqueue.health.self_test`): what the claim sends is what is proven.
    """
    return query.with_for_update(skip_locked=True)
