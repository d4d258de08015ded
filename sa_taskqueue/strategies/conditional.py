"""Claim with an atomic conditional UPDATE: SQLite, MySQL/MariaDB too old for SKIP LOCKED, any other database.

No row is locked while a claim looks for work.  A task is taken by an UPDATE
whose WHERE clause repeats the test that made it claimable (still queued,
still due, same attempt), so of several claimers racing for one row exactly
one UPDATE matches it; the others match nothing and move on.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, Table, bindparam, update
from sqlalchemy.engine import Dialect

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.claiming import (
    ClaimRequest,
    apply_claim,
    claimed_row,
    claimed_values,
    due_clause,
    due_select,
    limit_param,
    read_back,
)
from sa_taskqueue.strategies.lease import COMPLETE_MANY_CHUNK

CANDIDATE_ID = "candidate_id"
CANDIDATE_ATTEMPTS = "candidate_attempts"


class ConditionalUpdateStrategy(ClaimStrategy):
    """Compare-and-set on (status, attempts): the database's row update is the lock."""

    name = "conditional_update"

    def finding_statement(self, dialect: Dialect, table: Table, request: ClaimRequest) -> Any:
        if _claims_in_one_statement(dialect):
            return self.one_statement_claim(table, request)
        return super().finding_statement(dialect, table, request)

    def claim(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        if _claims_in_one_statement(engine.dialect):
            return self._claim_returning(engine, table, request)
        return self._claim_row_by_row(engine, table, request)

    def one_statement_claim(self, table: Table, request: ClaimRequest) -> Any:
        """One UPDATE of the first due rows, RETURNING them (where writes are serialised: SQLite 3.35+)."""
        due_ids = due_select(table, request, table.c.id).limit(limit_param()).scalar_subquery()
        return (
            update(table)
            .where(table.c.id.in_(due_ids))
            .values(**claimed_values(table, request))
            .returning(*read_back(table))
        )

    def _claim_returning(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        # One statement on its own: the database's write lock is taken when it
        # starts, before its subquery reads anything, so no other process can
        # write between this UPDATE's subquery and its update, and the claim
        # is exact without a transaction around it.
        claim = self.executor.prepared(
            ("claim", request.shape), engine.dialect, table, lambda: self.one_statement_claim(table, request)
        )
        with self.executor.single_statement(engine) as conn:
            return [claimed_row(row, request) for row in claim.rows(conn, request.params())]

    def completes_and_claims_at_once(self, dialect: Dialect) -> bool:
        # Where writes are serialised (SQLite), each transaction holds the
        # write lock and syncs the log once: one for both halves a task.
        return _claims_in_one_statement(dialect) and not self._completes_or_claims_its_own_way(
            ConditionalUpdateStrategy
        )

    def complete_and_claim(
        self,
        engine: Engine,
        table: Table,
        tasks: Sequence[ClaimedTask],
        results: Sequence[Any],
        now: datetime,
        request: ClaimRequest,
    ) -> tuple[set[int], list[dict[str, Any]]]:
        """The completion's UPDATE, then the claim's, in one write transaction where writes are serialised."""
        at_once = self.completes_and_claims_at_once(engine.dialect)
        if not tasks or len(tasks) > COMPLETE_MANY_CHUNK or not at_once:
            return super().complete_and_claim(engine, table, tasks, results, now, request)
        claim = self.executor.prepared(
            ("claim", request.shape), engine.dialect, table, lambda: self.one_statement_claim(table, request)
        )
        with self.transaction(engine) as conn:
            written = self.complete_many_on(conn, table, tasks, results, now)
            rows = claim.rows(conn, request.params())
        return written, [claimed_row(row, request) for row in rows]

    def _claim_row_by_row(self, engine: Engine, table: Table, request: ClaimRequest) -> list[dict[str, Any]]:
        # Where writers run side by side, each candidate is taken by its own
        # compare-and-set UPDATE, whose row count says whether this claimer
        # won it.  (This needs no RETURNING, so MySQL and MariaDB run it too.)
        candidates = self.executor.prepared(
            ("candidates", request.shape),
            engine.dialect,
            table,
            lambda: due_select(table, request, *read_back(table)).limit(limit_param()),
        )
        take = self.executor.prepared(
            ("take", request.shape),
            engine.dialect,
            table,
            lambda: (
                update(table)
                .where(
                    table.c.id == bindparam(CANDIDATE_ID),
                    table.c.attempts == bindparam(CANDIDATE_ATTEMPTS),
                    due_clause(table, request),
                )
                .values(**claimed_values(table, request))
            ),
        )
        params = request.params()
        claimed: list[dict[str, Any]] = []
        with self.transaction(engine) as conn:
            for row in candidates.rows(conn, params):
                won = take.execute(
                    conn, {**params, CANDIDATE_ID: row["id"], CANDIDATE_ATTEMPTS: row["attempts"]}
                )
                if won.rowcount == 1:
                    claimed.append(apply_claim(row, request))
        return claimed


def _claims_in_one_statement(dialect: Dialect) -> bool:
    backend = backend_for(dialect)
    return backend.serialised_writes and backend.update_returning
